"""The dimensions of the training step and a pairwise covering array over them.

A *configuration* picks one value per dimension of :func:`minidist.hybrid.train_step` — the
pipeline schedule, the data-parallel mode (flat, bucketed, ZeRO-1, ZeRO-2, ZeRO-3 per stage with
and without resharding after forward, HSDP per stage: sharded over CP, replicated over DP, as
torchtitan's ``("dp_replicate", "dp_shard_cp")`` mesh), recomputation, context parallelism (ring attention
with each of the three splits, or Ulysses), tensor parallelism
(with or without sequence parallelism), the loss reduction, the data-parallel size, the tied
embedding and the MLPs: dense, or mixture-of-experts blocks (top-2 of 4 experts, aux and z
losses) with the experts replicated (``ep1``), sharded over two EP ranks (``ep2``), or sharded
and dropping tokens over a capacity (``ep2/drop``), the precision of the forwards (fp32, or bf16
autocast: mixed precision) and gradient accumulation (4 or 6 micro-batches per replica, ragged
ones included: 7 samples per replica cut into 4 are 2, 2, 2, 1). Testing every configuration is a
product of all the value counts (6·7·3·5·3·3·2·2·4·2·2 = 362,880 here); testing every *pair* of values of every two dimensions
takes a few dozen (a covering array of strength 2: Cohen et al. 1997, "The AETG System", whose
greedy construction this is — each new configuration is the best of a few random candidates
at covering pairs not covered yet, per rank it launches: :func:`cost`). Most bugs of composition are pairs (the field reports of
this course's issues were), so every pair is run at least once.

Some pairs are not supported and must be *refused* by the library before any communication, with
a ``ValueError`` that names both features: :data:`REFUSED` lists them with the words each
refusal must contain. A refused pair is checked by one configuration that holds it; every other
pair is covered by configurations that hold no refused pair. Hard limits (the world size at most
:data:`MAX_WORLD`) are not pairs of the matrix: a pair they exclude (dp=2 × cp=2 × tp=2) is
still covered by other configurations; nor is ``ep2`` needing an even number of DP×CP ranks
(EP is folded over them).

Deterministic: the same ``seed`` gives the same array in every process (nothing depends on the
order of a set, which changes with Python's hash seed), so a failure can be run again.
"""

from __future__ import annotations

import itertools
import random

__all__ = ["DIMENSIONS", "EXPERTS", "REFUSED", "MAX_WORLD", "world_size", "cp_size", "ep_size",
           "feasible", "UNREACHABLE", "refusal", "reason", "pairs_of", "triples_of", "pair_refused", "covering_array",
           "covering_array_3", "strength_three", "strength_one", "cost"]

DIMENSIONS: dict[str, tuple] = {
    "schedule": ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "dualpipe-v"),
    "dp_mode": ("flat", "bucketed", "zero1", "zero2", "zero3", "zero3/keep", "hsdp"),
    "recompute": ("none", "minidist", "torch"),
    "cp": ("1", "ring/zigzag", "ring/contiguous", "ring/striped", "ulysses"),
    "tp": ("1", "2", "2+sp"),
    "loss": ("mean", "sum", "per_token"),
    "dp": (1, 2),
    "tie": (False, True),
    "moe": ("none", "ep1", "ep2", "ep2/drop"),
    "precision": ("fp32", "bf16"),
    "microbatches": (4, 6),
}
EXPERTS = ("ep1", "ep2", "ep2/drop")
PP = 2            # every configuration is a two-stage pipeline: the schedule is a dimension
MAX_WORLD = 8

# (dimension, value) -> a predicate on the other (dimension, value), and the words the library's
# ValueError must contain (both features named). None: the value is refused with anything.
REFUSED: list[tuple[tuple[str, object], tuple[str, object] | None, tuple[str, ...]]] = [
    (("dp_mode", "hsdp"), ("moe", moe), ("'hsdp'", "expert parallelism"))
    for moe in ("ep2", "ep2/drop")
]
# pairs no configuration within the hard limits can hold without a refused pair (none left)
UNREACHABLE: set = set()
# the value a dimension takes to leave a refused pair (the covering array's repair)
SAFE = {"moe": "none", "tp": "2", "cp": "1", "dp_mode": "flat", "schedule": "1f1b"}


def world_size(config: dict) -> int:
    tp = 1 if config["tp"] == "1" else 2
    return config["dp"] * PP * cp_size(config) * tp


def cp_size(config: dict) -> int:
    return 1 if config["cp"] == "1" else 2


def ep_size(config: dict) -> int:
    return 2 if config["moe"].startswith("ep2") else 1


def feasible(config: dict) -> bool:
    """Within the hard limits: at most :data:`MAX_WORLD` ranks, and EP dividing DP×CP."""
    return (world_size(config) <= MAX_WORLD
            and (config["dp"] * cp_size(config)) % ep_size(config) == 0)


def refusal(config: dict) -> tuple[str, ...] | None:
    """The words the library's refusal of ``config`` must contain, or None if it must run."""
    for (d1, v1), other, words in REFUSED:
        if config[d1] == v1 and (other is None or config[other[0]] == other[1]):
            return words
    return None


def pairs_of(config: dict) -> set:
    """Every pair ``((dim, value), (dim, value))`` the configuration holds (dimension order)."""
    items = [(d, config[d]) for d in DIMENSIONS]
    return set(itertools.combinations(items, 2))


def reason(pair) -> int | None:
    """The index in :data:`REFUSED` of the refusal a pair triggers, or None."""
    (a, b) = pair
    for i, (one, other, _) in enumerate(REFUSED):
        if one in (a, b) and (other is None or other in (a, b)):
            return i
    return None


def pair_refused(pair) -> bool:
    return reason(pair) is not None


def _all_pairs() -> list:
    dims = list(DIMENSIONS)
    return [((d1, v1), (d2, v2)) for i, d1 in enumerate(dims) for d2 in dims[i + 1:]
            for v1 in DIMENSIONS[d1] for v2 in DIMENSIONS[d2]]


def _candidate(rng: random.Random, seed_pair, want_refused: bool) -> dict | None:
    """A random configuration holding ``seed_pair``, within the hard limits, refused for the seed
    pair's reason only (``want_refused``) or for none at all; None if impossible."""
    config = {d: rng.choice(v) for d, v in DIMENSIONS.items()}
    for d, v in seed_pair:
        config[d] = v
    fixed = {d for d, _ in seed_pair}
    for d, small in (("dp", 1), ("cp", "1"), ("tp", "1")):   # shrink what the pair does not fix
        if world_size(config) > MAX_WORLD and d not in fixed:
            config[d] = small
    mine = reason(seed_pair) if want_refused else None
    for _ in range(len(DIMENSIONS)):   # leave every refusal but the seed's own, as SAFE says
        other = sorted((p for p in pairs_of(config) if reason(p) not in (None, mine)), key=repr)
        if not other:
            break
        for d, _ in other[0]:
            if d not in fixed and d in SAFE:
                config[d] = SAFE[d]
                break
        else:
            return None
    if ep_size(config) > 1 and config["dp"] * cp_size(config) % 2:   # EP folded over DP x CP
        if "dp" not in fixed:
            config["dp"] = 2
        elif "cp" not in fixed:
            config["cp"] = "ring/zigzag"
    if world_size(config) > MAX_WORLD and "tp" not in fixed:
        config["tp"] = "1"
    held = {reason(p) for p in pairs_of(config)} - {None}
    if not feasible(config) or held != ({mine} if want_refused else set()):
        return None
    return config


def cost(config: dict) -> int:
    """What a configuration costs to run, in ranks: on a machine with fewer cores than ranks a
    launch's time grows with its ranks (measured on 2 cores, one step of the tiny GPT: 0.27 s on
    2 ranks, 0.94 s on 4, 2.4 s on 8). The greedy arrays pick the candidate that covers the most
    new pairs (triples) per rank, so a pair that 4 ranks can hold is not left to one of 8 (the
    pairwise array's run, measured: 102 s -> 94 s; the 3-wise array's: 586 s -> 463 s)."""
    return world_size(config)


def covering_array(seed: int = 0, candidates: int = 30) -> list[dict]:
    """Configurations that cover every pair of values (strength 2): every allowed pair by a
    configuration that must run, every refused pair by one that must be refused. Raises
    ``RuntimeError`` if a pair cannot be covered within the limits (a bad :data:`REFUSED`)."""
    rng = random.Random(seed)
    pairs = _all_pairs()
    refused = [p for p in pairs if pair_refused(p)]
    uncovered = {p for p in pairs if not pair_refused(p)} - UNREACHABLE
    array: list[dict] = []
    while uncovered:
        seed_pair = min(uncovered, key=lambda p: (repr(p)))   # deterministic start
        best, gain = None, -1
        for _ in range(candidates):
            c = _candidate(rng, seed_pair, want_refused=False)
            if c is not None and len(pairs_of(c) & uncovered) / cost(c) > gain:
                best, gain = c, len(pairs_of(c) & uncovered) / cost(c)
        if best is None or seed_pair not in pairs_of(best):
            raise RuntimeError(f"covering_array: no configuration within the limits holds {seed_pair}")
        array.append(best)
        uncovered -= pairs_of(best)
    checked = set()
    for pair in refused:   # one configuration per refused pair that no earlier one checks
        if pair in checked:
            continue
        c = next((c for c in (_candidate(rng, pair, want_refused=True) for _ in range(candidates))
                  if c is not None), None)
        if c is None:
            raise RuntimeError(f"covering_array: no configuration within the limits holds {pair}")
        array.append(c)
        checked |= {p for p in pairs_of(c) if pair_refused(p)}
    return array


def triples_of(config: dict) -> set:
    """Every triple of ``(dim, value)`` the configuration holds (dimension order)."""
    items = [(d, config[d]) for d in DIMENSIONS]
    return set(itertools.combinations(items, 3))


def covering_array_3(seed: int = 0, candidates: int = 30) -> tuple[list[dict], list]:
    """``(configurations, unreachable)``: configurations that must run and together hold every
    triple of values (strength 3) that holds no refused pair, and the triples no configuration
    within the hard limits holds (dp=2 with CP and TP is 16 ranks). The refused pairs are the
    pairwise array's to check. Greedy as :func:`covering_array`; deterministic."""
    rng = random.Random(seed)
    dims = list(DIMENSIONS)
    todo = sorted((t for d in itertools.combinations(dims, 3)
                   for t in itertools.product(*[[(x, v) for v in DIMENSIONS[x]] for x in d])
                   if not any(pair_refused(p) for p in itertools.combinations(t, 2))), key=repr)
    uncovered, array, unreachable = set(todo), [], []
    for seed_triple in todo:
        if seed_triple not in uncovered:
            continue
        best, gain = None, -1
        for _ in range(candidates):
            c = _candidate(rng, seed_triple, want_refused=False)
            if c is not None and seed_triple in triples_of(c) and \
                    len(triples_of(c) & uncovered) / cost(c) > gain:
                best, gain = c, len(triples_of(c) & uncovered) / cost(c)
        if best is None:
            unreachable.append(seed_triple)
            uncovered.discard(seed_triple)
            continue
        array.append(best)
        uncovered -= triples_of(best)
    return array, unreachable


def strength_three(seed: int = 0) -> list[dict]:
    """Every triple of values that holds no refused pair (:func:`covering_array_3`), and the
    pairwise array's refused configurations: each refused pair checked as well."""
    return covering_array_3(seed)[0] + [c for c in covering_array(seed) if refusal(c) is not None]


def strength_one(array: list[dict]) -> list[dict]:
    """A subset of ``array`` in which every value of every dimension appears at least once,
    runnable and refused ones both (the default test tier's budget): greedy, the most new values
    per rank first (a configuration of 8 ranks costs about four of 2)."""
    chosen: list[dict] = []
    seen: set = set()
    rest = list(array)
    def gain(c: dict) -> float:
        return len({(d, c[d]) for d in DIMENSIONS} - seen) / world_size(c)

    while True:
        best = max(rest, key=gain, default=None)
        if best is None or gain(best) == 0:
            return chosen
        chosen.append(best)
        seen |= {(d, best[d]) for d in DIMENSIONS}
        rest.remove(best)
