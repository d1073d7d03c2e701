"""The worked problems of chapters 07b, 08b, 10, 11, 12, 14, 15 and 16: each answer computed by the
pipeline simulator, the planner, the library's own pure functions (device plan, clipping, expert
capacity, ring-all-reduce bytes, the two-level link coefficients), never typed in.

Hardware numbers: H100-80GB and A100-80GB memory and dense bf16 peak from
:data:`minidist_course.planner.calc.GPUS` (NVIDIA's data sheets); NVLink 3 (300 GB/s each way, the
planner's ``LINKS["nvlink3"]``, A100 data sheet). Everything else — latencies, link speeds between
data centres, compute times — is stated as an assumption in the question, or comes from the paper
named in the problem's source.
"""

from __future__ import annotations

import math

import torch

from minidist.context_parallel import causal_work
from minidist.data_parallel.clip import clip_by_global_norm_
from minidist.data_parallel.compression import ring_allreduce_bytes
from minidist.comm.tuner_topology import link_coefficients
from minidist.env import plan_devices
from minidist.expert_parallel.router import expert_capacity
from minidist.pipeline_parallel import one_f_one_b, peak_bytes, simulate, zb_h1, zb_v

from ..planner import calc, cost
from ..planner import context_parallel as cp
from ..planner.expert_parallel import MoESpec, predict_ep
from ..planner.published import LINKS, MEGATRON_TABLE1
from ..planner.search import Config, ModelSpec, predict
from .core import Problem, register

H100, A100 = calc.GPUS["H100-80GB"], calc.GPUS["A100-80GB"]
B = calc.human_bytes
HOUR = 3600.0

# ---------------------------------------------------------------- 07b: zero-bubble pipelines
P8, M32 = 8, 32


def _sim(schedule, t_f=1.0, t_b=2.0, t_w=1.0):
    """Equal costs by default: F, B and W one unit each (a fused backward is B + W = 2)."""
    return simulate(schedule, t_f, t_b, t_w=t_w)


def _zbv_ms() -> float:
    return 1e3 * _sim(zb_v(P8, M32), 0.010, 0.020, 0.010).makespan


def _two_gb(mb: int, stage: int) -> float:
    return 2e9        # bytes one micro-batch leaves on a stage until its W (or fused B)


def _zbh1_extra_bytes() -> float:
    last = P8 - 1
    return peak_bytes(zb_h1(P8, M32), _two_gb)[last] - peak_bytes(one_f_one_b(P8, M32), _two_gb)[last]


# ---------------------------------------------------------------- 08b: two kinds of link
NVLINK4, NDR = LINKS["nvlink4"], LINKS["ib-ndr"]   # (alpha s, beta s/byte); one NDR port per GPU
GIB = float(1 << 30)


def _per_nic(algorithm: str, M: int, L: int, nbytes: float) -> float:
    """Bytes the busiest GPU sends across nodes in an all-reduce of ``nbytes`` on M nodes × L
    GPUs (the inter-node coefficient of :func:`minidist.comm.tuner_topology.link_coefficients`:
    a flat ring's node-boundary GPU sends all of its ring traffic across)."""
    return link_coefficients("all_reduce", algorithm, M, L)["inter"][1] * nbytes


def _two_level_s(algorithm: str, M: int, L: int, nbytes: float) -> float:
    """Seconds of an all-reduce on M nodes × L GPUs, NVLink 4 inside a node and one NDR port per
    GPU between nodes, every step of a flat ring waiting on the slower link."""
    if algorithm == "ring":
        return calc.comm_time("all_reduce", nbytes, M * L, *NDR)
    return (2 * calc.comm_time("reduce_scatter", nbytes, L, *NVLINK4)
            + calc.comm_time("all_reduce", nbytes / L, M, *NDR))


GRAD_7B_BF16 = calc.weights_bytes(7e9, "bf16")


def _hsdp_per_gpu(replicas: int = 2, shard: int = 8) -> float:
    """Bytes each GPU sends across nodes per HSDP step: its 1/shard of the bf16 gradients
    all-reduced over the replicas (the all-gathers and the reduce-scatter stay in the node)."""
    return calc.comm_bytes_per_rank("all_reduce", GRAD_7B_BF16 / shard, replicas)


def _fsdp_per_boundary_gpu(world: int = 16) -> float:
    """FSDP over all 16 GPUs as one flat ring: per step two all-gathers of the bf16 weights and a
    reduce-scatter of the gradients; a GPU at a node boundary sends all of it across."""
    return (2 * calc.comm_bytes_per_rank("all_gather", GRAD_7B_BF16, world)
            + calc.comm_bytes_per_rank("reduce_scatter", GRAD_7B_BF16, world))


# ---------------------------------------------------------------- 10: frameworks
def _clipped_lr(lr: float = 0.5, norm_parts=(1.5, 2.0), max_norm: float = 1.0) -> float:
    """The SGD step size after clipping a gradient of norm |norm_parts| (2.5) at ``max_norm``,
    with the library's clip (the same ``min(1, max_norm / (norm + 1e-6))`` as torch's)."""
    g = torch.tensor(norm_parts, dtype=torch.float64)
    before = g.clone()
    clip_by_global_norm_(g.square().sum().reshape(1), [g], max_norm, reduce=lambda t: None)
    return lr * float(g[0] / before[0])


# ---------------------------------------------------------------- 11: GPUs
def _share(ranks: int, gpus: int) -> float:
    """Bytes each rank may allocate on an H100-80GB when ``ranks`` share ``gpus`` GPUs."""
    return H100["memory"] * plan_devices("cuda", "auto", ranks, gpus).memory_fraction


CONTEXT = 287e6       # bytes of one CUDA context with lazy loading (pytorch/pytorch#86509)


def _oversubscribed(ranks: int = 4) -> float:
    plan = plan_devices("cuda", "auto", ranks, 1)
    allocators = ranks * plan.memory_fraction * H100["memory"]
    return allocators + ranks * CONTEXT - H100["memory"]


PCIE = 64e9           # bytes/s each way: H100 SXM's PCIe Gen5 x16, "128 GB/s" both ways (data sheet)


def _staged_bytes(ranks: int = 4, grad_bytes: float = 2 * 1.3e9) -> float:
    """Bytes each rank copies device -> host to send its share of a ring all-reduce."""
    return calc.comm_bytes_per_rank("all_reduce", grad_bytes, ranks)


def _staging_s(ranks: int = 4) -> float:
    return ranks * _staged_bytes(ranks) / PCIE


# ---------------------------------------------------------------- 12: the 3-D planner
_, _HEADS, _HIDDEN, _LAYERS, _T, _P, _GPUS, _BATCH, _TFLOPS = MEGATRON_TABLE1[6]   # the 146B row
BIG = ModelSpec(_LAYERS, _HIDDEN, _HEADS, 51200, 2048)
_DP = _GPUS // (_T * _P)
PAPER = Config(_DP, _T, _P, _BATCH // _DP, 0, "full")       # micro-batch 1: 96 per replica
RATE = 0.5 * A100["peak_flops"]                               # the planner's A100 assumption


def _paper_prediction():
    return predict(BIG, PAPER, _BATCH, RATE, A100["memory"], precision="megatron-fp16")


def _model_flops_per_token() -> float:
    """6·N plus attention's 12·L·s·h (PaLM, App. B)."""
    return 6 * BIG.params + cost.attention_flops_per_token(BIG.layers, BIG.seq_len, BIG.hidden)


def _planner_mfu() -> float:
    q = _paper_prediction()
    return cost.mfu(q.tokens_per_s / _GPUS, _model_flops_per_token(), A100["peak_flops"])


# ---------------------------------------------------------------- 14: context parallelism
SEVEN_B = dict(layers=32, hidden=4096, heads=32, vocab=32000, params=6.7e9)   # Llama-2-7B's shape
NVLINK = LINKS["nvlink3"]                                                    # (alpha, beta)


def _act(seq_len: int, cp_size: int) -> float:
    return cp.activation_bytes(SEVEN_B["layers"], SEVEN_B["hidden"], SEVEN_B["vocab"], seq_len,
                               cp=cp_size)


def _ring(seq_len: int):
    return cp.ring_time(SEVEN_B["hidden"], SEVEN_B["heads"], seq_len, 8, *NVLINK, flop_rate=400e12)


def _shortest_hidden() -> int:
    return next(s for s in range(1024, 1 << 22, 1024) if _ring(s).hidden == 1.0)


def _longest_cp8() -> dict:
    rows = cp.longest_context(SEVEN_B["layers"], SEVEN_B["hidden"], SEVEN_B["heads"],
                              SEVEN_B["vocab"], SEVEN_B["params"], n_devices=8,
                              device_memory=H100["memory"])
    return next(r for r in rows if r["cp"] == 8)


def _imbalance(seq_len: int = 8192, world: int = 8) -> float:
    """The busiest rank's causal (query, key) pairs over the mean, contiguous split."""
    work = causal_work("contiguous", seq_len, world)
    return max(work) / (sum(work) / world)


# ---------------------------------------------------------------- 15: mixture of experts
ROUTED = (1600, 1400, 1000, 1100, 900, 1200, 500, 492)       # rows per expert, T·k = 8,192


def _dropped() -> int:
    cap = expert_capacity(4096, 8, 2, 1.25)
    return sum(max(0, n - cap) for n in ROUTED)


MOE_7B = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq_len=4096)


def _a2a():
    return predict_ep(MOE_7B, MoESpec(8, 2, 1.25), 8, tokens_per_rank=4096)


# ---------------------------------------------------------------- 16: fault tolerance
MTBF_LLAMA3 = 54 * 24 * HOUR / 419          # seconds between interruptions on 16,384 GPUs
MTBF_8X = MTBF_LLAMA3 * 16_384 / 131_072     # 8x the GPUs fail 8x as often


def _lost_gpu_hours() -> float:
    tau = cost.young_interval(60.0, MTBF_LLAMA3)
    return cost.expected_lost_work(tau, restart_time=600.0) * 16_384 / HOUR


WAN = 1.25e9          # bytes/s: an assumed 10 Gb/s link per replica between data centres


def _ddp_wan_s() -> float:
    return ring_allreduce_bytes(int(1.3e9), 8) / WAN


def _diloco_h() -> int:
    return next(h for h in range(1, 100_000) if _ddp_wan_s() / h <= 0.1 * 0.5)


register(
    # ------------------------------------------------------------------------------ 07b
    Problem("07b.1", "A pipeline of P = 8 ranks runs ZB-H1 on M = 32 micro-batches, with F, B and W "
            "one unit each (so 1F1B's fused backward takes 2). What fraction of the time is bubble?",
            lambda: _sim(zb_h1(P8, M32)).bubble, "",
            lambda a: f"The simulated step takes {_sim(zb_h1(P8, M32)).makespan:g} units = 3M + P − 1, "
                      f"of which each rank computes 3M = 96: bubble (P − 1)/(3M + P − 1) = 7/103 = "
                      f"{a:.4f}, against 1F1B's {_sim(one_f_one_b(P8, M32)).bubble:.4f} "
                      f"({_sim(one_f_one_b(P8, M32)).makespan:g} units = 3(M + P − 1)): a third of "
                      "the idle time, because the W ops fill the drain.",
            source="Qi et al. 2023, \"Zero Bubble Pipeline Parallelism\", §2.1 (ZB-H1)"),
    Problem("07b.2", "The same P = 8, M = 32 with ZB-V (two chunks per rank in a V). One micro-batch "
            "through a whole rank's share of the model takes 10 ms forward and 20 ms backward, 10 ms "
            "of it the weight gradients (W). How many milliseconds does one step take?",
            _zbv_ms, "ms",
            lambda a: f"Each chunk op costs half, and the only idle time left is the first forward's "
                      f"way down through half-size chunks: 3M · 10 ms + (P − 1)/2 · 10 ms = "
                      f"{a:.1f} ms, against ZB-H1's "
                      f"{1e3 * _sim(zb_h1(P8, M32), 0.010, 0.020, 0.010).makespan:.0f} ms and 1F1B's "
                      f"{1e3 * _sim(one_f_one_b(P8, M32), 0.010, 0.020, 0.010).makespan:.0f} ms.",
            rel_tol=0.01, source="Qi et al. 2023, arXiv:2401.10241 §6 (ZB-V)"),
    Problem("07b.3", "In ZB-H1 (P = 8, M = 32) a micro-batch's activations stay until its W. If each "
            "micro-batch leaves 2 GB of activations on a stage, how many more bytes does the last "
            "stage hold at its peak than under 1F1B?",
            _zbh1_extra_bytes, "bytes",
            lambda a: f"1F1B's last stage runs each backward right after its forward: "
                      f"{peak_bytes(one_f_one_b(P8, M32), lambda m, s: 1)[P8 - 1]} micro-batch in "
                      f"flight; ZB-H1 delays its W by r = 7 backwards, so it holds "
                      f"{peak_bytes(zb_h1(P8, M32), lambda m, s: 1)[P8 - 1]} = min(P, M), like 1F1B's "
                      f"first stage: 7 × 2 GB = {B(a)} more on the last stage, the same peak over the "
                      "pipeline.",
            source="Qi et al. 2023, §2.1 (ZB-H1's memory: p·M_B, as 1F1B's first stage)"),
    # ------------------------------------------------------------------------------ 08b
    Problem("08b.1", "4 nodes × 8 GPUs (W = 32), each GPU with its own network port, all-reduce "
            "1 GiB of gradients. With one flat ring through all 32 GPUs, how many times more "
            "bytes leave through the busiest port than with the hierarchical all-reduce "
            "(reduce-scatter in the node, all-reduce of each 1/8 piece across the nodes, "
            "all-gather in the node)?",
            lambda: _per_nic("ring", 4, 8, GIB) / _per_nic("hierarchical", 4, 8, GIB), "×",
            lambda a: f"The flat ring crosses a node boundary at 4 of its 32 links, and each GPU "
                      f"before a boundary sends all its ring traffic across: 2(W − 1)/W · n = "
                      f"{_per_nic('ring', 4, 8, GIB) / GIB:.4g} GiB. Hierarchically every GPU's "
                      f"port carries its piece's ring of M = 4: 2(M − 1)/M · n/L = "
                      f"{_per_nic('hierarchical', 4, 8, GIB) / GIB:.4g} GiB — {a:.3g}× less. In "
                      f"all, {4 * _per_nic('ring', 4, 8, GIB) / GIB:.4g} GiB cross the nodes "
                      f"against {32 * _per_nic('hierarchical', 4, 8, GIB) / GIB:.4g} GiB: the "
                      "total barely changes, but 32 ports share it instead of 4.",
            source="minidist.comm.tuner_topology.link_coefficients; Jia et al. 2018 §4.3"),
    Problem("08b.2", "2 nodes × 8 H100 (NVLink 4: 450 GB/s each way, α = 5 µs; one NDR port of "
            "50 GB/s per GPU, α = 10 µs) all-reduce 1 GiB. A flat ring of 16 whose every step "
            "waits on an NDR port, against the hierarchical all-reduce: how many times faster is "
            "the hierarchical one in the α-β model?",
            lambda: _two_level_s("ring", 2, 8, GIB) / _two_level_s("hierarchical", 2, 8, GIB), "×",
            lambda a: f"Flat: 30 α + 2 · 15/16 · 1 GiB / 50 GB/s = "
                      f"{_two_level_s('ring', 2, 8, GIB) * 1e3:.2f} ms. Hierarchical: a "
                      f"reduce-scatter and an all-gather of 8 over NVLink, "
                      f"{2 * calc.comm_time('reduce_scatter', GIB, 8, *NVLINK4) * 1e3:.2f} ms, "
                      f"then a ring of 2 over NDR on 1/8 GiB, "
                      f"{calc.comm_time('all_reduce', GIB / 8, 2, *NDR) * 1e3:.2f} ms: "
                      f"{_two_level_s('hierarchical', 2, 8, GIB) * 1e3:.2f} ms, {a:.2f}× faster. "
                      "NCCL's own rings are not this flat ring: it runs one ring per port, so all "
                      "8 ports work at once (NVIDIA/nccl#412), and on 2 nodes it may pick its "
                      "tree algorithm instead (NVIDIA/nccl-tests#196).",
            source="NVIDIA H100 and DGX H100 data sheets (minidist_course.planner.published.LINKS; "
                   "the α values are assumptions)"),
    Problem("08b.3", "A 7B model in bf16 on 2 nodes × 8 GPUs with HSDP: parameters sharded over "
            "the 8 GPUs of a node, replicated over the 2 nodes. How many bytes does each GPU send "
            "across nodes per step?",
            _hsdp_per_gpu, "bytes",
            lambda a: f"Only the gradients cross: each GPU all-reduces its 1/8 of the "
                      f"{B(GRAD_7B_BF16)} of bf16 gradients with its counterpart on the other node, "
                      f"2 · 1/2 · {B(GRAD_7B_BF16 / 8)} = {B(a)}; both all-gathers and the "
                      f"reduce-scatter stay on NVLink. FSDP over all 16 GPUs as one flat ring sends "
                      f"2 · 15/16 · {B(GRAD_7B_BF16)} (two all-gathers) + 15/16 · "
                      f"{B(GRAD_7B_BF16)} (the reduce-scatter) = {B(_fsdp_per_boundary_gpu())} "
                      f"from each GPU at a node boundary, "
                      f"{_fsdp_per_boundary_gpu() / a:.1f}× more.",
            source="Zhao et al. 2023, \"PyTorch FSDP\" §3.2.2 (hybrid sharding)"),
    # ------------------------------------------------------------------------------ 10
    Problem("10.1", "Eight TensorFlow workers under MultiWorkerMirroredStrategy train a 10-class "
            "classifier; at initialisation its mean cross-entropy is ln 10. What loss does "
            "tf_keras' `model.fit` print for the first step?",
            lambda: 8 * math.log(10), "",
            lambda a: f"Under this strategy `fit` reports the loss multiplied by the number of "
                      f"workers: 8 × ln 10 = 8 × "
                      f"{math.log(10):.4f} = {a:.2f}. The weights are right; only the logged number "
                      "is scaled. The custom loop makes it explicit: each replica divides its loss "
                      "sum by the global batch, and the replicas' losses are summed.",
            source="course chapter 10, section 6 (tf_keras' model.fit under "
                   "MultiWorkerMirroredStrategy)"),
    Problem("10.2", "DeepSpeed (since v0.19.3) clips gradients at a global norm of 1.0 when the "
            "config does not say otherwise. A plain-SGD step at learning rate 0.5 meets a gradient "
            "of global norm 2.5. What step size does it really take?",
            _clipped_lr, "",
            lambda a: f"The gradient is scaled by min(1, 1.0/(2.5 + 1e-6)) = {a / 0.5:.6f}, so the "
                      f"step is 0.5 × {a / 0.5:.4f} = {a:.4f}, {a / 0.5:.0%} of the step the script asks "
                      "for. Nothing fails: the run silently trains with another learning rate "
                      "whenever the norm exceeds 1 (chapter 10's job sets gradient_clipping to 0).",
            source="GRADIENT_CLIPPING_DEFAULT in deepspeed/runtime/constants.py (PR #8068)"),
    Problem("10.3", "A TensorFlow script divides each replica's summed loss by the global batch, "
            "because TF's replica context sums the gradients. Ported unchanged to Horovod's "
            "`DistributedOptimizer` (which averages) on 16 workers at learning rate 0.4: what "
            "learning rate does it effectively train with?",
            lambda: 0.4 / 16, "",
            lambda a: "Each replica's gradient is already 1/16 of its share of the global mean; "
                      f"averaging divides by 16 once more: 0.4 / 16 = {a:.4f}. Summing and averaging "
                      "must not both happen: pick one.",
            source="op=Average, the default of DistributedOptimizer in horovod/torch/optimizer.py"),
    # ------------------------------------------------------------------------------ 11
    Problem("11.1", "Eight ranks are launched with `device=\"cuda\"` on a node with three "
            "H100-80GB GPUs. How many bytes may each rank allocate on its GPU?",
            lambda: _share(8, 3), "bytes",
            lambda a: f"Rank i computes on GPU i mod 3, so up to ceil(8/3) = "
                      f"{plan_devices('cuda', 'auto', 8, 3).ranks_per_gpu} ranks share a GPU, and "
                      f"every rank may use 1/3 of its memory: 80 GB / 3 = {B(a)} (GPU 2, with two "
                      "ranks, leaves a third unused). The backend is gloo: NCCL refuses two ranks "
                      "on one device.",
            source="NVIDIA H100 data sheet; NCCL troubleshooting guide"),
    Problem("11.2", "Four ranks share one GPU, each limited to 1/4 of its memory "
            "(`set_per_process_memory_fraction`, which limits the caching allocator only). Each "
            "also holds a CUDA context of 287 MB. If every allocator fills its share, by how many "
            "bytes does the demand exceed the GPU's memory?",
            _oversubscribed, "bytes",
            lambda a: f"The four shares add up to the whole GPU; the contexts come on top: 4 × "
                      f"287 MB = {B(a)}, whatever the GPU's size. Leave that headroom (smaller "
                      "batches), or the last rank to allocate runs out of memory.",
            source="pytorch/pytorch#86509 (287 MB with lazy loading, 667 MB without); PyTorch docs, "
                   "torch.cuda.set_per_process_memory_fraction"),
    Problem("11.3", "The same four ranks all-reduce the bf16 gradients of a 1.3B-parameter model "
            "(2.6 GB) with a ring over gloo: every byte sent is first copied device→host into a "
            "pinned buffer, every byte received host→device. The GPU's PCIe Gen5 x16 link carries "
            "64 GB/s each way. At least how many seconds of copying is that?",
            _staging_s, "s",
            lambda a: f"Each rank sends 2 · 3/4 · 2.6 GB = {B(_staged_bytes())} and receives as "
                      f"much; the 4 ranks share one link: 4 × {B(_staged_bytes())} = "
                      f"{B(4 * _staged_bytes())} each way / 64 GB/s = {a:.3f} s, both directions "
                      "overlapping. From pageable memory the driver would first copy each byte "
                      "into its own pinned bounce buffer: one more copy per byte.",
            source="NVIDIA H100 data sheet (PCIe Gen5: 128 GB/s); NVIDIA technical blog, \"How to "
                   "Optimize Data Transfers in CUDA C/C++\" (2012)"),
    # ------------------------------------------------------------------------------ 12
    Problem("12.1", "Megatron-LM's 146B model (80 layers, hidden 12,288, 96 heads, vocabulary "
            "51,200, sequence 2,048) on 1,536 A100-80GB at (dp, tp, pp) = (24, 8, 8), batch 2,304 in "
            "micro-batches of one sequence, full recomputation, 20 bytes of model state per "
            "parameter: how many bytes per GPU does the planner predict?",
            lambda: _paper_prediction().memory["total"], "bytes",
            lambda a: (lambda q: f"Weights + gradients + optimizer state of the first stage's 10 "
                                 f"layers and embedding shard, / tp = 8: "
                                 f"{B(q.memory['weights'] + q.memory['grads'] + q.memory['optimizer'])}; "
                                 f"activations: {q.in_flight:g} micro-batches in flight (1F1B) × 10 "
                                 f"layer inputs of 2·s·h bytes, plus one layer's full set while it is "
                                 f"recomputed: {B(q.memory['activations'])}. Total {B(a)}: it fits "
                                 "in 80 GB with headroom.")(_paper_prediction()),
            source="Narayanan et al. 2021, Table 1; Korthikanti et al. 2022, Table 2"),
    Problem("12.2", "The planner, assuming each A100 computes at half its 312 TFLOP/s peak, NVLink 3 "
            "inside a node and InfiniBand HDR between nodes: how many seconds does one step of "
            "Problem 12.1's configuration take?",
            lambda: _paper_prediction().step_s, "s",
            lambda a: (lambda t: f"Compute (forward, recomputed forward, backward of 96 "
                                 f"micro-batches) {t['compute']:.2f} s + bubble 7/96 of it "
                                 f"{t['bubble']:.2f} s + exposed TP {t['tp']:.2f} s, PP "
                                 f"{t['pp']:.2f} s and DP "
                                 f"{t['exposed'] - t['tp'] - t['pp']:.2f} s = {a:.1f} s."
                       )(_paper_prediction().time),
            rel_tol=0.05, source="Narayanan et al. 2021, §2.2 and §5.1; planner.search"),
    Problem("12.3", "What model FLOPs utilisation (MFU) does Problem 12.2's step time mean? Count "
            "6·N plus attention's 12·L·s·h FLOPs per token.",
            _planner_mfu, "",
            lambda a: f"{_BATCH} × 2048 tokens / {_paper_prediction().step_s:.1f} s / 1536 GPUs = "
                      f"{_paper_prediction().tokens_per_s / _GPUS:.1f} tokens/s per GPU × "
                      f"{_model_flops_per_token():.4g} FLOPs / 312e12 = {a:.3f}. Below the assumed "
                      "0.5: the recomputed forward counts in the time, not in the model's FLOPs "
                      "(at most 0.5 × 3/4), and the bubble and communication add time. The paper "
                      f"measured {_TFLOPS} TFLOP/s of hardware FLOPs, an MFU of "
                      f"{_TFLOPS / 312 * 6 / 8:.3f}.",
            source="PaLM (Chowdhery et al. 2022), App. B; Narayanan et al. 2021, Table 1"),
    # ------------------------------------------------------------------------------ 14
    Problem("14.1", "Llama-2-7B's shape (32 layers, hidden 4,096, vocabulary 32,000) with full "
            "recomputation, one sequence of 131,072 tokens: how many bytes of activations does each "
            "GPU hold with context parallelism over cp = 8 ranks?",
            lambda: _act(131_072, 8), "bytes",
            lambda a: f"Per token: 32 layer inputs of 2h bytes, one layer's full set 34h and the "
                      f"fp32 logits 4V = {_act(1, 1):,.0f} bytes; each rank keeps 131,072/8 tokens: "
                      f"{B(a)}, against {B(_act(131_072, 1))} on one GPU, which does not fit.",
            source="Korthikanti et al. 2022, Table 2"),
    Problem("14.2", "Ring attention for the same shape on cp = 8 ranks over NVLink 3 (α = 5 µs, "
            "300 GB/s) at 400 TFLOP/s: what is the shortest sequence, a multiple of 1,024, whose "
            "K/V transfers hide completely behind the block compute, forward and backward?",
            _shortest_hidden, "tokens",
            lambda a: f"A step moves 2·(S/8)·h bf16 values (plus the fp32 dK/dV backward) and "
                      f"computes 2·h·(S/8)² FLOPs forward, twice that backward: compute grows with the "
                      f"square of the block. At S = {a - 1024:,.0f}, "
                      f"{_ring(a - 1024).hidden:.1%} is hidden; at S = {a:,.0f} all of it "
                      f"({1e3 * _ring(a).comm_s:.2f} ms of transfers under "
                      f"{1e3 * _ring(a).block_s:.2f} ms of compute per layer).",
            rel_tol=0.0, source="Liu et al. 2023, Ring Attention §3; NVIDIA A100 data sheet"),
    Problem("14.3", "Eight H100-80GB, tp = 1 and cp = 8: bf16 weights and gradients replicated, "
            "Adam's 12 bytes per parameter sharded over the 8 ranks, full recomputation. "
            "What is the longest context of Llama-2-7B (6.7e9 parameters) that fits, as a multiple "
            "of 1,024 tokens?",
            lambda: _longest_cp8()["seq_len"], "tokens",
            lambda a: f"Model state 6.7e9 · (2 + 2 + 12/8) = {B(_longest_cp8()['states'])} leaves "
                      f"{B(H100['memory'] - _longest_cp8()['states'])} for activations of "
                      f"{_act(1, 1):,.0f} bytes per token over 8 ranks: {a:,.0f} tokens. "
                      f"A contiguous causal split would also leave the ranks unequal: the last does "
                      f"{_imbalance():.2f}× the mean work, which the zigzag split evens out.",
            rel_tol=0.01, source="Korthikanti et al. 2022, Table 2; ZeRO §5 (sharded optimizer state)"),
    # ------------------------------------------------------------------------------ 15
    Problem("15.1", "A mixture-of-experts layer with E = 8 experts, top-2 routing and capacity "
            "factor 1.25 sees 4,096 tokens. How many rows may each expert take?",
            lambda: expert_capacity(4096, 8, 2, 1.25), "rows",
            lambda a: f"ceil(T · k · factor / E) = ceil(4096 · 2 · 1.25 / 8) = {a:.0f}: the fair "
                      "share of the 8,192 assignments, 1,024, with 25 % slack.",
            rel_tol=0.0, source="Switch Transformer (Fedus et al. 2021), §2.2; Megatron-LM's "
                                "get_capacity"),
    Problem("15.2", "The router of Problem 15.1 sends its 8,192 rows to the experts as "
            "1,600, 1,400, 1,000, 1,100, 900, 1,200, 500 and 492. How many rows are dropped?",
            _dropped, "rows",
            lambda a: f"Only experts over the capacity of {expert_capacity(4096, 8, 2, 1.25)} drop: "
                      f"(1600 − 1280) + (1400 − 1280) = {a:.0f} rows, {a / 8192:.1%} of the "
                      "assignments, which ride the residual connection unchanged — although "
                      "experts 6 and 7 have room. The aux loss is what pushes the router back.",
            rel_tol=0.0, source="GShard (Lepikhin et al. 2020); Switch Transformer §2.2"),
    Problem("15.3", "Llama-2-7B's shape with every MLP replaced by E = 8 experts, top-2, capacity "
            "factor 1.25, sharded over ep = 8 ranks, 4,096 tokens per rank, bf16 activations, "
            "balanced routing: how many bytes does each rank send in all-to-alls per step?",
            lambda: _a2a()["a2a_bytes"], "bytes",
            lambda a: f"Per MoE layer 4 exchanges (dispatch and combine, forward and backward) of "
                      f"7/8 · 4096 · 2 rows · 4096 · 2 bytes, plus the counts: {B(a / 32)}; × 32 "
                      f"layers = {B(a)}, {1e3 * _a2a()['a2a_s']:.1f} ms on NVLink 3 (α-β). Each "
                      f"rank then holds one expert per layer: {B(_a2a()['expert_memory'])} of expert "
                      "weights, gradients and Adam state.",
            source="minidist_course.planner.predict_ep (balanced routing, α-β); Lepikhin et al. "
                   "2020 (GShard): dispatch and combine all-to-alls"),
    # ------------------------------------------------------------------------------ 16
    Problem("16.1", "Llama 3's pre-training saw 419 interruptions in 54 days on 16,384 GPUs. A job "
            "on 131,072 such GPUs writes a checkpoint in 60 s. Young's interval between "
            "checkpoints?",
            lambda: cost.young_interval(60.0, MTBF_8X), "s",
            lambda a: f"One interruption every 54 days / 419 = {MTBF_LLAMA3 / HOUR:.2f} h on 16,384 "
                      f"GPUs; 8× the GPUs fail 8× as often: every {MTBF_8X:,.0f} s. "
                      f"sqrt(2 · 60 · {MTBF_8X:,.0f}) = {a:.0f} s (Daly: "
                      f"{cost.daly_interval(60.0, MTBF_8X):.0f} s).",
            source="Dubey et al. 2024 (Llama 3), §3.3.4, Table 5; Young 1974; Daly 2006"),
    Problem("16.2", "Back on the 16,384 GPUs, checkpointing at Young's interval for C = 60 s, with "
            "10 minutes to restart: how many GPU-hours does one interruption cost on average?",
            _lost_gpu_hours, "GPU-hours",
            lambda a: f"Half an interval of lost work, "
                      f"{cost.young_interval(60.0, MTBF_LLAMA3) / 2:.0f} s, plus the 600 s restart, "
                      f"× 16,384 GPUs = {a:,.0f} GPU-hours; × 419 interruptions = "
                      f"{419 * a:,.0f} GPU-hours over the 54 days, "
                      f"{419 * a / (16_384 * 54 * 24):.1%} of the machine's time.",
            source="Dubey et al. 2024, §3.3.4; Young 1974"),
    Problem("16.3", "Eight replicas of a 1.3B-parameter model in different data centres, each on "
            "an assumed 10 Gb/s (1.25 GB/s) link, take 0.5 s per step of compute. DDP all-reduces "
            "fp32 gradients every step; DiLoCo all-reduces the parameter change once every H "
            "steps. Smallest H whose communication, averaged per step, is at most 10 % of the "
            "compute?",
            _diloco_h, "steps",
            lambda a: f"One ring all-reduce: 2 · 7/8 · 5.2 GB = "
                      f"{B(ring_allreduce_bytes(int(1.3e9), 8))} / 1.25 GB/s = {_ddp_wan_s():.2f} s — "
                      f"DDP would spend {_ddp_wan_s() / 0.5:.0f}× the compute talking. "
                      f"{_ddp_wan_s():.2f} s / H ≤ 0.05 s gives H ≥ "
                      f"{_ddp_wan_s() / 0.05:.1f}: H = {a:.0f} (the paper uses 500).",
            rel_tol=0.0, source="Douillard et al. 2023, DiLoCo, Algorithm 1"),
)
