"""Plan a 3-D parallel run: every valid (dp, tp, pp, micro-batches, ZeRO, recomputation, v) with its
memory per device and predicted step time, best first.

Units: bytes, seconds, FLOP/s. A model is a GPT (``ModelSpec``: L layers, hidden h, a heads,
vocabulary V, sequence s); ranks are laid out as :mod:`minidist.grid` does (tp fastest, then pp,
then dp), so a TP group spans t devices, a pipeline t·p, the DP group all of them.

**Memory per device** (the worst pipeline stage: ceil(L/(p·v))·v layers plus the embedding or the
head): weights, gradients and optimizer state from the bytes per parameter of
:data:`~minidist_course.planner.published.PRECISIONS`, the state ZeRO shards divided by dp (Rajbhandari et
al. 2020, §5); activations per layer per micro-batch from Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4, Table 2 (16-bit, scaled by
``act_bytes``/2): sbh(10 + 24/t + 5as/(ht)); sbh(34/t + 5as/(ht)) with sequence parallelism;
selective recomputation drops the 5as/(ht) term; full recomputation keeps 2sbh (the layer input)
plus one layer's full set while it is recomputed. 1F1B holds min(m, p) micro-batches in flight on
the first stage (Narayanan et al. 2021, §2.2.1), times 1 + (p-1)/(p·v) when interleaved
(Korthikanti §4.2.3); the last stage adds the fp32 logits, 4sbV/t (§4.3).

**Step time** = compute + bubble + exposed communication. Compute: forward 24bsh² + 4bs²h per
layer and 2bshV for the logits (Narayanan §5.1), backward twice that, plus one more forward of the
layers with full recomputation (only the 4bs²h attention core with selective), divided by t and
the device's FLOP rate. Bubble: (p-1)/(v·m) of the compute (Narayanan §2.2). Communication, by
:func:`minidist_course.planner.calc.comm_time` (ring, alpha-beta) on the link the group spans:
TP — per layer and micro-batch 2 all-reduces of bsh forward, 2 backward, 2 more when recomputing,
plus the embedding's and the head's, and 3 small ones of vocab-parallel cross-entropy: all exposed;
PP — 2(v·m + p - 1) point-to-point messages of bsh, and the tied embedding's gradient all-reduce
between the first and last stage: exposed; DP — ZeRO-0 all-reduces the
gradients, ZeRO-1 reduce-scatters them and all-gathers the weights, ZeRO-2 reduce-scatters every
micro-batch, ZeRO-3 also all-gathers the weights twice per micro-batch. The gradient traffic
overlaps ``overlap`` × the backward of the last micro-batch (every micro-batch's for ZeRO-2/3,
whose gathers also hide behind the forward); the final weight all-gather of ZeRO-1/2 is exposed.

Context parallelism (the sequence split over ``cp`` ranks): activation memory per rank divided by
cp, the ring's K/V traffic and its overlap with the block compute, and the longest context that
fits a device — :func:`activation_bytes`, :func:`ring_time`, :func:`longest_context` from
:mod:`minidist_course.planner.context_parallel`, re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import calc
from .context_parallel import activation_bytes, longest_context, ring_time  # noqa: F401
from .published import LINKS, PRECISIONS

__all__ = ["ModelSpec", "Link", "Links", "Config", "Prediction", "predict", "plan", "format_table",
           "RECOMPUTE", "LEGEND",
           "activation_bytes", "ring_time", "longest_context"]

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: ``layers`` blocks of hidden size ``hidden`` with ``heads`` heads, a ``vocab``-entry
    embedding, sequences of ``seq_len`` tokens; ``tied``: the head reuses the embedding."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    tied: bool = True

    @classmethod
    def from_gpt_config(cls, cfg, seq_len: int | None = None) -> "ModelSpec":
        """From :class:`minidist.models.gpt.GPTConfig` (or anything with its field names)."""
        return cls(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, seq_len or cfg.block_size,
                   bool(getattr(cfg, "tie_embeddings", False)))

    @property
    def layer_params(self) -> int:  # qkv, proj, fc1, fc2 with biases, two LayerNorms: 12h² + 13h
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def params(self) -> int:
        h, v = self.hidden, self.vocab
        return self.layers * self.layer_params + v * h * (1 if self.tied else 2) + self.seq_len * h + 2 * h


@dataclass(frozen=True)
class Link:
    alpha: float  # s per message
    beta: float   # s per byte (1 / bandwidth)


@dataclass(frozen=True)
class Links:
    intra: Link = Link(*LINKS["nvlink3"])   # inside a node
    inter: Link = Link(*LINKS["ib-hdr"])    # between nodes


@dataclass(frozen=True, order=True)
class Config:
    dp: int
    tp: int
    pp: int
    microbatches: int
    zero: int = 0
    recompute: str = "none"
    v: int = 1


@dataclass
class Prediction:
    config: Config
    micro_batch: int                     # sequences per micro-batch
    memory: dict = field(default_factory=dict)   # weights, grads, optimizer, activations, total
    in_flight: float = 0.0               # micro-batches whose activations the first stage holds
    fits: bool = True
    time: dict = field(default_factory=dict)     # compute, bubble, tp, pp, dp, exposed, overlapped
    step_s: float = 0.0
    tokens_per_s: float = 0.0


def _collective(op, nbytes, w, link):
    return calc.comm_time(op, nbytes, w, link.alpha, link.beta) if w > 1 and nbytes > 0 else 0.0


def predict(model: ModelSpec, cfg: Config, global_batch: int, flop_rate: float, device_memory: float,
            links: Links = Links(), devices_per_node: int = 8, precision: str = "mixed",
            act_bytes: int = 2, sequence_parallel: bool = False, overlap: float = 1.0,
            layer_overhead: float = 0.0, zero1_all_reduce: bool = False) -> Prediction:
    """Memory per device and step time of one configuration (see the module docstring).
    ``layer_overhead``: fixed seconds per layer (and for the head) per forward, twice per backward,
    once more per recomputed forward — the dispatch cost that dominates tiny models on a CPU and
    that no FLOP count sees (:func:`calibrate_overhead` fits it to one measured step); 0 on GPUs.
    ``zero1_all_reduce``: ZeRO-1 all-reduces the gradients instead of reduce-scattering them
    (what :mod:`minidist.hybrid`'s ``"zero1"`` mode does), then all-gathers the weights.
    Does not check validity: :func:`plan` does."""
    L, h, a, V, s = model.layers, model.hidden, model.heads, model.vocab, model.seq_len
    d, t, p, m, v = cfg.dp, cfg.tp, cfg.pp, cfg.microbatches, cfg.v
    b = global_batch // (d * m)
    lp = math.ceil(L / (p * v)) * v                       # layers on the busiest device
    emb = V * h / t                                       # vocab-parallel embedding (or head) shard
    first = lp * model.layer_params / t + emb + s * h
    last = lp * model.layer_params / t + 2 * h + (emb if p > 1 or not model.tied else 0)
    n_par = first + last - lp * model.layer_params / t if p == 1 else max(first, last)
    if precision not in PRECISIONS:
        raise ValueError(f"plan: precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    wb, gb, ob = PRECISIONS[precision]
    z = cfg.zero
    mem = dict(weights=n_par * wb / (d if z >= 3 else 1) + (model.layer_params / t * wb if z >= 3 else 0),
               grads=n_par * gb / (d if z >= 2 else 1), optimizer=n_par * ob / (d if z >= 1 else 1))
    sbh, k = s * b * h, act_bytes / 2
    attn = 5 * a * s / h
    full_set = sbh * ((34 / t if sequence_parallel else 10 + 24 / t) + attn / t) * k
    per_layer = {"none": full_set, "full": 2 * sbh / (t if sequence_parallel else 1) * k,
                 "selective": sbh * (34 / t if sequence_parallel else 10 + 24 / t) * k}[cfg.recompute]
    in_flight = min(m, p) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    acts = lp * per_layer * in_flight + (full_set if cfg.recompute == "full" else 0)
    mem["activations"] = max(acts, 4 * s * b * V / t + lp * per_layer)   # last stage: 1 in flight + logits
    mem["total"] = sum(mem.values())
    # compute, per micro-batch, on the busiest (last) stage
    f_layer = 24 * b * s * h * h + 4 * b * s * s * h
    extra = {"none": 0, "selective": 4 * b * s * s * h, "full": f_layer}[cfg.recompute]
    fwd = (lp * f_layer + 2 * b * s * h * V) / t / flop_rate + (lp + 1) * layer_overhead
    bwd = ((lp * (2 * f_layer + extra) + 4 * b * s * h * V) / t / flop_rate
           + (2 * (lp + 1) + (lp if cfg.recompute == "full" else 0)) * layer_overhead)
    compute = m * (fwd + bwd)
    bubble = (p - 1) / (v * m) * compute
    intra_tp = t <= devices_per_node
    tp_link = links.intra if intra_tp else links.inter
    n_ar = lp * (4 + (2 if cfg.recompute == "full" else 0)) + 2
    tp_t = m * (n_ar * _collective("all_reduce", sbh * act_bytes, t, tp_link)
                + 3 * _collective("all_reduce", 4 * s * b, t, tp_link))
    pp_link = links.intra if t * p <= devices_per_node else links.inter
    pp_t = 2 * (v * m + p - 1) * (pp_link.alpha + sbh * act_bytes * pp_link.beta) if p > 1 else 0.0
    if p > 1 and model.tied:   # the tied embedding's gradient, summed by the first and last stage
        pp_t += _collective("all_reduce", emb * gb, 2, pp_link)
    dp_link = links.intra if d * t * p <= devices_per_node else links.inter
    g_bytes, w_bytes = n_par * gb, n_par * wb
    rs, ag = (_collective(op, nb, d, dp_link) for op, nb in (("reduce_scatter", g_bytes), ("all_gather", w_bytes)))
    hideable_z1 = _collective("all_reduce", g_bytes, d, dp_link) if zero1_all_reduce else rs
    hideable, exposed_dp, window = {0: (_collective("all_reduce", g_bytes, d, dp_link), 0.0, bwd),
                                    1: (hideable_z1, ag, bwd), 2: (m * rs, ag, m * bwd),
                                    3: (m * (rs + 2 * ag), 0.0, m * (fwd + bwd))}[z]
    exposed_dp += max(0.0, hideable - overlap * window)
    dp_total = hideable + (ag if z in (1, 2) else 0.0)
    exposed = tp_t + pp_t + exposed_dp
    step = compute + bubble + exposed
    time = dict(compute=compute, bubble=bubble, tp=tp_t, pp=pp_t, dp=dp_total, exposed=exposed,
                overlapped=dp_total - exposed_dp)
    return Prediction(cfg, b, mem, in_flight, mem["total"] <= device_memory, time, step,
                      global_batch * s / step)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan(model: ModelSpec, global_batch: int, n_devices: int, device_memory: float, flop_rate: float,
         links: Links = Links(), devices_per_node: int = 8, zero_stages=(0, 1, 2, 3),
         recompute=("none", "full"), interleave=(1,), only_fits: bool = False, **kw) -> list[Prediction]:
    """Every valid configuration on exactly ``n_devices`` devices, fitting ones first, then by
    predicted step time. Valid: tp divides heads and hidden and ``devices_per_node`` (TP stays in a
    node); pp·v <= layers; dp divides ``global_batch``; micro-batches divide the per-replica batch
    (and are a multiple of pp when v > 1, as Megatron-LM's interleaved schedule needs). ``kw``
    goes to :func:`predict` (precision, act_bytes, sequence_parallel, overlap, layer_overhead).

    Raises ValueError naming what to change: no devices, no tp that divides the heads, no valid
    configuration, or (``only_fits``) none that fits in ``device_memory``.
    """
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"plan: n_devices must be an int >= 1, got {n_devices!r}")
    if global_batch < 1 or device_memory <= 0 or flop_rate <= 0:
        raise ValueError(f"plan: global_batch ({global_batch}), device_memory ({device_memory}) and "
                         f"flop_rate ({flop_rate}) must be positive")
    modes = [("full" if r is True else "none" if r is False else r) for r in recompute]
    if bad := [r for r in modes if r not in RECOMPUTE]:
        raise ValueError(f"plan: recompute must be among {RECOMPUTE} (or True/False), got {bad}")
    tps = [t for t in _divisors(n_devices) if model.heads % t == 0 and model.hidden % t == 0
           and t <= devices_per_node and devices_per_node % t == 0]
    if not tps:
        raise ValueError(f"plan: no tensor-parallel size divides heads={model.heads}, hidden="
                         f"{model.hidden} and the {n_devices} devices ({devices_per_node} per node)")
    out = []
    for t in tps:
        for p in _divisors(n_devices // t):
            d = n_devices // (t * p)
            if global_batch % d:
                continue
            for m in _divisors(global_batch // d):
                for v in interleave:
                    if p * v > model.layers or (v > 1 and (p == 1 or m % p)) or (
                            kw.get("sequence_parallel") and model.seq_len % t):
                        continue
                    for z in (zero_stages if d > 1 else (0,)):
                        for r in modes:
                            out.append(predict(model, Config(d, t, p, m, z, r, v), global_batch,
                                               flop_rate, device_memory, links, devices_per_node, **kw))
    if not out:
        raise ValueError(f"plan: no (dp, tp, pp) with dp·tp·pp = {n_devices} has dp dividing the "
                         f"global batch {global_batch}, pp <= {model.layers} layers and tp in {tps} "
                         f"(the sizes dividing heads={model.heads}, hidden={model.hidden} and "
                         f"{devices_per_node} devices per node); change the global batch (a multiple "
                         f"of the data-parallel size), the device count or the heads")
    out.sort(key=lambda q: (not q.fits, q.step_s, q.config))
    if only_fits:
        if not out[0].fits:
            least = min(out, key=lambda q: q.memory["total"])
            raise ValueError(f"plan: no configuration fits in {calc.human_bytes(device_memory)} per "
                             f"device; the smallest needs {calc.human_bytes(least.memory['total'])} "
                             f"({least.config}); add devices or memory, or allow ZeRO-3 / recompute")
        out = [q for q in out if q.fits]
    return out


LEGEND = ("v = model chunks per pipeline rank (interleaving), m = micro-batches per step, b = "
          "micro-batch size (sequences), infl = micro-batches in flight on the first stage (1F1B); "
          "W+G+O = weights + gradients + optimizer state")


def format_table(preds: list[Prediction], top: int | None = 20) -> str:
    """A readable table: the configuration (m micro-batches of b sequences), memory per device
    (GB; ``infl``: micro-batches in flight on the first stage) and the step split (s): compute,
    bubble, exposed TP and PP communication, DP communication exposed and hidden behind backward.
    Its last line is :data:`LEGEND`, which says what the one-letter columns mean."""
    cols = [("dp", 3), ("tp", 3), ("pp", 3), ("v", 2), ("m", 4), ("b", 4), ("zero", 4),
            ("recomp", 9), ("W+G+O GB", 9), ("act GB", 8), ("infl", 5), ("total", 8), ("fits", 4),
            ("compute", 9), ("bubble", 8), ("TP", 8), ("PP", 8), ("DP exp", 8), ("DP hid", 8),
            ("step s", 9), ("tok/s", 9)]
    head = " ".join(f"{name:>{w}}" for name, w in cols)
    rows = [head, "-" * len(head)]
    for q in preds[:top]:
        c, mm, tt = q.config, q.memory, q.time
        vals = [c.dp, c.tp, c.pp, c.v, c.microbatches, q.micro_batch, c.zero, c.recompute,
                (mm["weights"] + mm["grads"] + mm["optimizer"]) / 1e9, mm["activations"] / 1e9,
                q.in_flight, mm["total"] / 1e9, "yes" if q.fits else "NO", tt["compute"],
                tt["bubble"], tt["tp"], tt["pp"], tt["exposed"] - tt["tp"] - tt["pp"],
                tt["overlapped"], q.step_s, q.tokens_per_s]
        rows.append(" ".join(f"{x:>{w}.3g}" if isinstance(x, float) else f"{x:>{w}}"
                             for x, (_, w) in zip(vals, cols)))
    return "\n".join(rows + [LEGEND])

