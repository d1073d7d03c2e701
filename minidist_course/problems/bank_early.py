"""The worked problems of chapters 01, 02, 05, 06 and 08: each answer computed by the planner, the
cost model, the launch helpers or the tensor-parallel accounting, never typed in.

Hardware numbers: H100-80GB and A100-80GB memory and dense bf16 peak from
:data:`minidist_course.planner.calc.GPUS` (NVIDIA's data sheets); links from
:data:`minidist_course.planner.published.LINKS` — NVLink 4 at 450 GB/s per direction (H100 data
sheet), one InfiniBand port per GPU, HDR 25 GB/s (DGX A100 data sheet) or NDR 50 GB/s (DGX H100
data sheet). Latencies (α) are assumptions, stated in each question. GPT-3 175B's shape: Brown et
al. 2020, Table 2.1 and §2.1 (96 layers, d_model 12,288, 96 heads, context 2,048).
"""

from __future__ import annotations

import math

from minidist.env import parse_tasks_per_node, plan_devices
from minidist.tensor_parallel.accounting import block_formula

from ..bench.collectives import busbw_factor
from ..diagrams.launch import rank_layout
from ..planner import calc, context_parallel, cost
from ..planner.published import LINKS
from ..planner.scaling import comm_compute_ratio, dp_scaling
from ..planner.search import Config, ModelSpec, predict
from .core import Problem, register

H100, A100 = calc.GPUS["H100-80GB"], calc.GPUS["A100-80GB"]
NVLINK4, NDR, HDR = LINKS["nvlink4"], LINKS["ib-ndr"], LINKS["ib-hdr"]   # (alpha s, beta s/B)
NCCL_TIMEOUT = 600.0   # s: torch's default NCCL process-group timeout (torch.distributed.constants)
B = calc.human_bytes

# ---------------------------------------------------------------------------------- chapter 01
CYCLIC_NODES = parse_tasks_per_node("8(x4)")       # SLURM_TASKS_PER_NODE of 4 nodes × 8 GPUs


def _local_rank(rank: int, counts, distribution: str) -> int:
    return next(row.index(rank) for row in rank_layout(counts, distribution) if rank in row)


def _params_per_shared_rank() -> float:
    plan = plan_devices("cuda", "auto", local_world_size=6, gpus=4)
    return H100["memory"] * plan.memory_fraction / calc.training_memory(1.0).total


def _timeout_cost() -> float:
    return 1024 * NCCL_TIMEOUT / 3600 * cost.price("H100-80GB")


# ---------------------------------------------------------------------------------- chapter 02
def _algbw_ceiling() -> float:
    return (1 / NVLINK4[1]) / busbw_factor("all_reduce", 8)


def _ring_vs_doubling(world: int, alpha: float, beta: float) -> float:
    """Bytes N where a ring all-reduce and recursive doubling take the same time (bisection on
    calc.comm_time, in log N: below N recursive doubling is faster)."""
    def gap(n):
        return (calc.comm_time("all_reduce", n, world, alpha, beta, "ring")
                - calc.comm_time("all_reduce", n, world, alpha, beta, "recursive_doubling"))
    lo, hi = 1.0, 1e15                      # gap(lo) > 0 (latency: ring slower), gap(hi) < 0
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return math.sqrt(lo * hi)


def _fsdp_gather() -> float:
    return calc.comm_time("all_gather", calc.weights_bytes(7e9, "bf16"), 64, *NDR)


# ---------------------------------------------------------------------------------- chapter 05
F_A100 = A100["peak_flops"] * 0.5                       # chapter 05's A100s at 50 % of peak
GPT_1B3 = ModelSpec(layers=24, hidden=2048, heads=16, vocab=50257, seq_len=512)


def _ratio_at(k: int, world: int = 64) -> float:
    return comm_compute_ratio(dp_scaling(GPT_1B3, [1, world], F_A100, "weak",
                                         batch_per_device=k)[-1])


def _sequences_to_hide() -> int:
    return next(k for k in range(1, 10_000) if _ratio_at(k) < 2 / 3)


def _one_batch_efficiency(k: int, world: int = 64) -> float:
    return dp_scaling(GPT_1B3, [1, world], F_A100, "weak", batch_per_device=k)[-1]["efficiency"]


def _accumulated_efficiency(k: int, world: int = 64) -> float:
    """Weak-scaling efficiency at ``world`` with ``k`` accumulated micro-batches of 1 sequence
    (only the last micro-batch's backward overlaps the all-reduce)."""
    def step(w):
        return predict(GPT_1B3, Config(w, 1, 1, k), w * k, F_A100, math.inf).step_s
    return step(1) / step(world)


def _bucket_time(dtype: str) -> float:
    return calc.comm_time("all_reduce", calc.weights_bytes(1.3e9, dtype), 64, *HDR)


TOKENS_05 = 8 * 2048
WAIT_05 = 0.1       # s per step in the data lane: a stated measurement


def _compute_05() -> float:
    return calc.training_time(calc.training_flops(1.3e9, TOKENS_05), 1, H100["peak_flops"], 0.4)


def _mfu_with_wait() -> float:
    return cost.mfu(TOKENS_05 / (_compute_05() + WAIT_05), 6 * 1.3e9, H100["peak_flops"])


# ---------------------------------------------------------------------------------- chapter 06
L3, H3, V3, S3 = 96, 12288, 50257, 2048        # GPT-3 175B (Brown et al. 2020)


def _tp_block_bytes() -> float:
    return block_formula(1, S3, H3, 8, 2)["bytes_sent"]


def _sp_saving() -> float:
    kw = dict(tp=8, recompute="selective")
    return (context_parallel.activation_bytes(L3, H3, V3, S3, sequence_parallel=False, **kw)
            - context_parallel.activation_bytes(L3, H3, V3, S3, sequence_parallel=True, **kw))


def _tp_layer(tp: int, link) -> tuple[float, float, int]:
    """(TP communication s, compute s, all-reduces) of one GPT-3 layer, one sequence, forward and
    backward, on H100s at 40 % MFU: block_formula's all-reduces of b·s·h bf16 values per pass,
    each priced by calc.comm_time on ``link``; the layer's training FLOPs, 6·12h²·s plus the
    attention term (cost.training_flops), split over ``tp`` GPUs."""
    n_ar = 2 * block_formula(1, S3, H3, tp, 2)["ops"]["all_reduce"]     # forward + backward
    comm = n_ar * calc.comm_time("all_reduce", S3 * H3 * 2, tp, *link)
    flops = cost.training_flops(12 * H3 ** 2, S3, n_layer=1, n_ctx=S3, d_attn=H3)
    return comm, flops / tp / (H100["peak_flops"] * 0.4), n_ar


def _tp_ratio(tp: int, link) -> float:
    comm, compute, _ = _tp_layer(tp, link)
    return comm / compute


# ---------------------------------------------------------------------------------- chapter 08
HOSTS = [f"node{i}" for i in range(1, 13)]               # 12 nodes of 8 GPUs


def _rank_on_node2() -> int:
    node_rank = sorted(HOSTS).index("node2")             # the rendezvous sorts the addresses
    return rank_layout([8] * len(HOSTS))[node_rank][3]


GRAD_7B = calc.weights_bytes(7e9, "bf16")                # bf16 gradients of a 7B model


def _inter_node_phase() -> float:
    return calc.comm_time("all_reduce", GRAD_7B / 8, 16, *NDR)


def _flat_ring() -> float:
    return calc.comm_time("all_reduce", GRAD_7B, 128, *NDR)


register(
    Problem("01.1", "Slurm starts 4 nodes × 8 GPUs (`SLURM_TASKS_PER_NODE=8(x4)`) with "
            "`srun --distribution=cyclic`, which deals the ranks round-robin over the nodes. "
            "Which local rank (the GPU, `cuda:LOCAL_RANK`) does global rank 13 have?",
            lambda: _local_rank(13, CYCLIC_NODES, "cyclic"), "",
            lambda a: f"Cyclic: rank r goes to node r mod 4, as its (r div 4)-th task there: rank 13 "
                      f"is on node {13 % len(CYCLIC_NODES)} with local rank {a:.0f}. `RANK % 8` "
                      f"would give {13 % 8}, a GPU that another rank of that node uses; with block "
                      f"distribution (torchrun's numbering) it would have been local rank "
                      f"{_local_rank(13, CYCLIC_NODES, 'block')}. Read `LOCAL_RANK` "
                      "(`SLURM_LOCALID`).",
            rel_tol=0.0, source="srun man page, --distribution"),
    Problem("01.2", "`minidist.run(fn, 6, device=\"cuda\")` on a machine with 4 H100-80GB GPUs: "
            "ranks share GPUs, each may use 1/(ranks per GPU) of one. How many parameters can one "
            "rank train with mixed-precision Adam (16 bytes per parameter, activations ignored)?",
            _params_per_shared_rank, "parameters",
            lambda a: f"ceil(6 / 4) = {plan_devices('cuda', 'auto', 6, 4).ranks_per_gpu} ranks per "
                      f"GPU, so {B(H100['memory'] / 2)} each, over gloo (NCCL refuses two ranks "
                      f"on one device: backend {plan_devices('cuda', 'auto', 6, 4).backend!r}); "
                      f"/ 16 bytes = {a:.3g} parameters.",
            source="ZeRO §3.1; NVIDIA H100 data sheet"),
    Problem("01.3", "A 1,024-GPU H100 job deadlocks in its first step (a ring of blocking sends) "
            "and NCCL's watchdog ends it after torch's default 10-minute timeout. At the course's "
            "illustrative 4.00 USD per H100-hour, what did the wait cost?",
            _timeout_cost, "USD",
            lambda a: f"1,024 GPUs × {NCCL_TIMEOUT / 3600:.3g} h = {1024 * NCCL_TIMEOUT / 3600:.1f} "
                      f"GPU-hours × {cost.price('H100-80GB'):.2f} USD. Test with a short "
                      "`init(timeout=...)` on a few ranks first, and post sends and receives "
                      "together (`isend`/`irecv`).",
            source="torch.distributed.constants (default_pg_nccl_timeout); "
                   "minidist_course.planner.cost.PRICES (illustrative)"),
    Problem("02.1", "Eight H100s in one node, NVLink 4 at 450 GB/s per GPU and direction. A ring "
            "all-reduce's busbw is at most that link speed: what is the largest algbw (GB/s of "
            "the user's tensor) it can show?",
            lambda: _algbw_ceiling() / 1e9, "GB/s",
            lambda a: f"algbw = busbw / (2 (W − 1)/W) = 450 / {busbw_factor('all_reduce', 8)} = "
                      f"{a:.1f} GB/s: each GPU must move {busbw_factor('all_reduce', 8)} bytes per "
                      f"byte of the tensor. On 2 GPUs the factor is "
                      f"{busbw_factor('all_reduce', 2):.0f} and algbw could reach 450.",
            source="nccl-tests doc/PERFORMANCE.md; NVIDIA H100 data sheet"),
    Problem("02.2", "64 ranks, α = 10 µs per message, 50 GB/s links (InfiniBand NDR). Below which "
            "all-reduce size is recursive doubling (log₂W steps of the whole tensor) faster than "
            "the ring?",
            lambda: _ring_vs_doubling(64, *NDR), "bytes",
            lambda a: f"Equal times: log₂W (α + Nβ) = 2 (W − 1) α + 2 (W − 1)/W · Nβ gives N = "
                      f"(126 − 6) α / ((6 − 126/64) β) = {B(a)}. At 1 MB recursive doubling takes "
                      f"{calc.comm_time('all_reduce', 1e6, 64, *NDR, 'recursive_doubling') * 1e3:.2f}"
                      f" ms, the ring {calc.comm_time('all_reduce', 1e6, 64, *NDR) * 1e3:.2f} ms; "
                      f"at 1 GB {calc.comm_time('all_reduce', 1e9, 64, *NDR, 'recursive_doubling'):.3f}"
                      f" s against {calc.comm_time('all_reduce', 1e9, 64, *NDR):.3f} s.",
            source="Thakur, Rabenseifner & Gropp 2005 §4; DGX H100 data sheet"),
    Problem("02.3", "FSDP / ZeRO-3 rebuilds a 7B model's bf16 weights with an all-gather on 64 GPUs "
            "(one 50 GB/s NDR port each, α = 10 µs). How many seconds does one ring all-gather of "
            "all the weights take?",
            _fsdp_gather, "s",
            lambda a: f"(W − 1) α + (W − 1)/W · N β = 63 · 10 µs + 63/64 · "
                      f"{B(calc.weights_bytes(7e9, 'bf16'))} / 50 GB/s = {a:.3f} s — half a ring "
                      "all-reduce, and paid again for the backward.",
            source="DGX H100 data sheet"),
    Problem("05.1", "Chapter 05's communication-bound case: a 1.3B GPT (24 layers, width 2,048), "
            "sequences of 512 tokens, on 64 A100s at 50 % MFU, gradients all-reduced over one "
            "200 Gb/s HDR port per GPU (α = 10 µs). How many sequences per device per all-reduce "
            "bring the communication/computation ratio below 2/3?",
            _sequences_to_hide, "sequences",
            lambda a: f"The ratio is {_ratio_at(1):.2f} with 1 sequence and falls as 1/k "
                      f"(≈ 2βF/(3T)): {_ratio_at(int(a) - 1):.3f} at {a - 1:.0f}, "
                      f"{_ratio_at(int(a)):.3f} at {a:.0f}. In one micro-batch of {a:.0f} the "
                      f"all-reduce hides behind the backward (efficiency "
                      f"{_one_batch_efficiency(int(a)):.2f}). Accumulating {a:.0f} micro-batches "
                      f"of 1 with `no_sync()` pays the all-reduce once per step too, but only the "
                      f"last backward overlaps it: "
                      f"efficiency {_accumulated_efficiency(int(a)):.2f}, against "
                      f"{_accumulated_efficiency(1):.2f} without accumulation.",
            rel_tol=0.0, source="NVIDIA A100 and DGX A100 data sheets"),
    Problem("05.2", "A 1.3B model trained under bf16 autocast keeps fp32 parameters, so DDP "
            "all-reduces fp32 buckets. On 64 A100s (one 25 GB/s HDR port each, α = 10 µs), how "
            "many seconds per step does a 16-bit compression hook save?",
            lambda: _bucket_time("fp32") - _bucket_time("bf16"), "s",
            lambda a: f"Ring all-reduce of {B(calc.weights_bytes(1.3e9, 'fp32'))}: "
                      f"{_bucket_time('fp32'):.3f} s; of {B(calc.weights_bytes(1.3e9, 'bf16'))}: "
                      f"{_bucket_time('bf16'):.3f} s. Half the bandwidth term; the latency term "
                      "2 (W − 1) α stays. Autocast saves activation bytes and time in the "
                      "matrix units, not gradient bytes.",
            source="NVIDIA DGX A100 data sheet"),
    Problem("05.3", "A 1.3B GPT trains on one H100 with 8 sequences of 2,048 tokens per step, its "
            "forward and backward running at 40 % MFU, and the timeline's data lane shows 0.1 s of "
            "waiting for the next batch every step. What MFU does the run measure?",
            _mfu_with_wait, "",
            lambda a: f"Compute {_compute_05():.3f} s (6 · 1.3e9 · 16,384 FLOPs / (989e12 · 0.4)) "
                      f"+ {WAIT_05} s waiting: {TOKENS_05 / (_compute_05() + WAIT_05):,.0f} tokens/s"
                      f" × 6 · 1.3e9 FLOPs / 989e12 = {a:.3f}. Loader workers that prefetch (or "
                      "preprocessing offline) bring it back to 0.4.",
            source="PaLM App. B (MFU); NVIDIA H100 data sheet"),
    Problem("06.1", "GPT-3 175B (hidden 12,288, sequences of 2,048) with tensor parallelism over 8 "
            "GPUs, one sequence per micro-batch, bf16 activations: how many bytes does each GPU "
            "send for one transformer block's forward pass?",
            _tp_block_bytes, "bytes",
            lambda a: f"2 all-reduces (after attention and after the MLP) of b·s·h · 2 bytes = "
                      f"{B(S3 * H3 * 2)}, each sending 2 (W − 1)/W of it: 2 · "
                      f"{busbw_factor('all_reduce', 8)} · "
                      f"{B(S3 * H3 * 2)} = {B(a)}; the backward as much again. With sequence "
                      "parallelism: 2 all-gathers + 2 reduce-scatters, the same bytes.",
            source="Shoeybi et al. 2019 §3; Brown et al. 2020 Table 2.1"),
    Problem("06.2", "The same GPT-3 with TP = 8 and selective recomputation, one sequence: how many "
            "bytes of activations per GPU does sequence parallelism save over the 96 layers?",
            _sp_saving, "bytes",
            lambda a: f"Per layer s·b·h (10 + 24/t) bytes without SP and s·b·h · 34/t with it: "
                      f"{B(S3 * H3 * (10 + 24 / 8))} against {B(S3 * H3 * 34 / 8)}. Over 96 "
                      f"layers 10 · s·b·h · (1 − 1/t) · 96 = {B(a)}: the LayerNorm, dropout and "
                      "residual tensors, no "
                      "longer replicated on every TP rank.",
            source="Korthikanti et al. 2022 §4.2, Table 2"),
    Problem("06.3", "One GPT-3 layer, one sequence, TP = 8 over NVLink 4 (450 GB/s, α = 5 µs) on "
            "H100s at 40 % MFU: what fraction of the layer's forward-and-backward compute do its "
            "TP all-reduces take (they are not overlapped)?",
            lambda: _tp_ratio(8, NVLINK4), "",
            lambda a: f"{_tp_layer(8, NVLINK4)[2]} all-reduces of {B(S3 * H3 * 2)} take "
                      f"{_tp_layer(8, NVLINK4)[0] * 1e3:.2f} ms; the layer's "
                      f"72·s·h² + 12·s²·h = "
                      f"{cost.training_flops(12 * H3 ** 2, S3, n_layer=1, n_ctx=S3, d_attn=H3):.3g}"
                      f" FLOPs / 8 GPUs / (989e12 · 0.4) = {_tp_layer(8, NVLINK4)[1] * 1e3:.2f} ms: "
                      f"{a:.1%}.",
            source="Narayanan et al. 2021 §5.1; NVIDIA H100 data sheet"),
    Problem("08.1", "torchrun's c10d rendezvous numbers the nodes by sorting their host names. A "
            "job runs on node1 … node12, 8 GPUs each: which global rank does local rank 3 on "
            "node2 get?",
            _rank_on_node2, "",
            lambda a: f"Sorted as strings: {', '.join(sorted(HOSTS)[:5])}, …: node2 is node "
                      f"{sorted(HOSTS).index('node2')}, so its ranks are "
                      f"{rank_layout([8] * 12)[sorted(HOSTS).index('node2')][0]}–"
                      f"{rank_layout([8] * 12)[sorted(HOSTS).index('node2')][-1]} and local rank "
                      f"3 is {a:.0f} — not 11, and rank 0 is on node1, then node10.",
            rel_tol=0.0, source="torch/distributed/elastic/rendezvous/dynamic_rendezvous.py"),
    Problem("08.2", "Problem 06.3's layer with TP = 16 across two nodes: the all-reduces now cross "
            "InfiniBand NDR (50 GB/s per GPU, α = 10 µs). What fraction of the compute do they "
            "take now?",
            lambda: _tp_ratio(16, NDR), "",
            lambda a: f"{_tp_layer(16, NDR)[2]} all-reduces at "
                      f"{_tp_layer(16, NDR)[0] / _tp_layer(16, NDR)[2] * 1e3:.2f} ms each against "
                      f"{_tp_layer(16, NDR)[1] * 1e3:.2f} ms of compute: {a:.2f}×, "
                      f"{a / _tp_ratio(8, NVLINK4):.0f} times the "
                      f"{_tp_ratio(8, NVLINK4):.3f} of TP = 8 inside a node. Hence TP stays in the "
                      "node and pipeline or data parallelism crosses nodes.",
            source="NVIDIA DGX H100 data sheet"),
    Problem("08.3", "A 7B model's bf16 gradients, 16 DGX H100 nodes, each GPU with its own NDR port "
            "(50 GB/s, α = 10 µs). Hierarchically, each GPU all-reduces its 1/8 shard with its "
            "counterparts on the other 15 nodes, all 8 rails at once. Seconds for that inter-node "
            "phase?",
            _inter_node_phase, "s",
            lambda a: f"Ring over 16 nodes of {B(GRAD_7B / 8)}: 30 α + 2 · 15/16 · "
                      f"{B(GRAD_7B / 8)} / 50 GB/s = {a:.4f} s; the network carries "
                      f"{B(cost.data_parallel_traffic(GRAD_7B, 1, 16))} per step, "
                      f"{B(cost.data_parallel_traffic(GRAD_7B, 1, 16) / 16)} out of each node "
                      f"through its 8 ports. A flat ring of all 128 GPUs whose every step runs at "
                      f"one port's 50 GB/s (the planner's DP model) predicts {_flat_ring():.3f} s, "
                      f"{_flat_ring() / a:.1f}× longer: what the 8 rails working at once buy. The "
                      f"reduce-scatter and all-gather inside each node, over NVLink 4, add "
                      f"{2 * calc.comm_time('reduce_scatter', GRAD_7B, 8, *NVLINK4):.3f} s.",
            source="NVIDIA DGX H100 data sheet"),
)
