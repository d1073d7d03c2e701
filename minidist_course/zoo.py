"""The bug zoo: bugs that real distributed-training projects shipped, each reproduced as a patch of
one small library function (or method) by its mutated version, applied from outside with
:func:`inject`. The library holds only the correct code. They are what
:func:`minidist_course.references.bisect.bisect` is tested on: for each, the bisector must name the first
tensor that leaves the one-process run, its rank and the pattern.

A patch acts in the process that enters :func:`inject`: enter it inside :func:`minidist.run`'s rank
function (each rank is its own process), e.g. ``bisect(..., context=functools.partial(inject,
name))``. A function imported by name elsewhere (``from .x import f``) is patched there too.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

__all__ = ["BUGS", "on", "inject"]

# name -> (what the mutation does, where it comes from)
BUGS: dict[str, tuple[str, str]] = {
    "dp-sum-not-average": (
        "the data-parallel all-reduce sums the gradients and never divides by the replicas",
        "picotron's first DP hook; the correct one: picotron's DataParallelNaive._allreduce_grads "
        "(a SUM all-reduce, then grad /= cp_dp_world_size)"),
    "dp-divide-twice": (
        "the gradients are divided by the data-parallel size before and after the average",
        "a pre-divide and a post-divide each by the full size W; PyTorch FSDP's default comm hooks "
        "split 1/W in two (gradient_predivide_factor × gradient_postdivide_factor = W, "
        "torch/distributed/algorithms/_comm_hooks/default_hooks.py)"),
    "tied-embedding-not-summed": (
        "the tied embedding's gradient is not summed across the first and last stage",
        "Megatron-LM's embedding group (each stage's copy keeps half the gradient)"),
    "sp-grads-not-summed": (
        "the LayerNorm gradients of sequence-parallel regions are not summed over the TP group",
        "Korthikanti et al. 2022 §4.2.2; Megatron-LM's allreduce_layernorm_grads"),
    "cp-contiguous-positions": (
        "the first stage embeds its tokens at contiguous positions where the split is zigzag",
        "a position-id/sequence-split mismatch (torchtitan's CP position ids)"),
    "ring-diagonal-unmasked": (
        "ring attention computes the blocks on the diagonal without the causal mask",
        "a general failure mode of blockwise causal attention: the diagonal block needs the causal "
        "mask, the blocks below it none (zhuzilin/ring-flash-attention: the issue on verifying causal masking)"),
    "microbatch-mean-of-means": (
        "every micro-batch's mean loss is weighted 1/M, also when micro-batches differ in size",
        "the gradient-accumulation loss bug of transformers (2024); torchgpipe's microbatch weights"),
    "experts-averaged-over-dp": (
        "expert gradients are averaged over every data-parallel rank, which hold other experts, "
        "instead of over the replicas of the same expert",
        "Megatron-core's expert-data-parallel group; DeepSpeed-MoE's expert gradient reduction"),
    "per-token-local-count": (
        "the per-token loss divides each replica's sum by its own token count, not the global one",
        "Megatron-Core's calculate_per_token_loss; transformers' gradient-accumulation loss fix"),
}
_active: set[str] = set()


# ---------------------------------------------------------------- the mutations
# each: original function -> its mutated version (the same signature)

def _average_times(factor):
    def mutate(average_flat):
        def mutated(tensors, comm, dtype=None):
            return [t * factor(comm.world_size) for t in average_flat(tensors, comm, dtype)]
        return mutated
    return mutate


def _skipped(method):
    return lambda self: None


def _contiguous_positions(method):
    from minidist.hybrid import stages

    def positions(self, s, device):   # the bug: "contiguous" in place of self.split
        cp_rank, cp = stages.group_rank_world(self.cp_group)
        return s * cp, stages.cp_positions("contiguous", s * cp, cp, cp_rank).to(device)
    return positions


def _diagonal_unmasked(block_kind):
    def mutated(q_pos, k_pos, causal=True):
        kind = block_kind(q_pos, k_pos, causal)
        return "full" if kind == "diagonal" else kind
    return mutated


def _mean_of_means(loss_weights):
    return lambda batch_size, M: [1 / M] * M


def _all_dp_ranks(expert_replicas):
    return lambda grid: grid.dp_cp_group


def _local_count(sum_over):
    import torch.distributed as dist

    def mutated(group, loss, count, device):
        loss_sum, _ = sum_over(group, loss, count, device)
        return [loss_sum, dist.get_world_size(group) * count]   # times D for the average
    return mutated


# name -> (module, attribute path there, modules that import it by name, mutation)
_PATCHES = {
    "dp-sum-not-average": ("minidist.hybrid.dp_pipeline", "average_flat", (),
                           _average_times(lambda W: W)),
    "dp-divide-twice": ("minidist.hybrid.dp_pipeline", "average_flat", (),
                        _average_times(lambda W: 1 / W)),
    "tied-embedding-not-summed": ("minidist.hybrid.stages", "HybridGPT.allreduce_tied_grads", (),
                                  _skipped),
    "sp-grads-not-summed": ("minidist.hybrid.stages", "HybridGPT.finish_sequence_parallel_grads",
                            (), _skipped),
    "cp-contiguous-positions": ("minidist.hybrid.stages", "CPGPTStage.positions", (),
                                _contiguous_positions),
    "ring-diagonal-unmasked": ("minidist.context_parallel.sharding", "block_kind",
                               ("minidist.context_parallel.ring", "minidist.context_parallel"),
                               _diagonal_unmasked),
    "microbatch-mean-of-means": ("minidist.pipeline_parallel.microbatch", "loss_weights", (),
                                 _mean_of_means),
    "experts-averaged-over-dp": ("minidist.hybrid.moe", "_expert_replicas", (), _all_dp_ranks),
    "per-token-local-count": ("minidist.hybrid.dp_pipeline", "_sum_over", (), _local_count),
}


def on(name: str) -> bool:
    """True while the zoo's bug ``name`` is injected in this process."""
    return name in _active


@contextlib.contextmanager
def inject(name: str):
    """Replace the library function of the bug ``name`` by its mutation inside the block (this
    process only); restored on exit.

    Raises ``ValueError`` for a name not in :data:`BUGS` (naming the known ones)."""
    if name not in BUGS:
        raise ValueError(f"zoo.inject: unknown bug {name!r}; known: {sorted(BUGS)}")
    module, path, users, mutate = _PATCHES[name]
    sites = _sites(module, path, users)
    originals = [getattr(site, attr) for site, attr in sites]
    mutated = mutate(originals[0])
    for site, attr in sites:
        setattr(site, attr, mutated)
    _active.add(name)
    try:
        yield
    finally:
        _active.discard(name)
        for (site, attr), original in zip(sites, originals):
            setattr(site, attr, original)


def _sites(module: str, path: str, users: tuple) -> list:
    """``[(object, attribute)]`` to patch: ``path`` in ``module``; for a function defined there,
    also every loaded module of either house that imported it by name (``users`` loaded first,
    so that none imports the mutation during the block and keeps it)."""
    owner = importlib.import_module(module)
    *outer, attr = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    fn = getattr(owner, attr)
    if outer or getattr(fn, "__module__", None) != module:
        return [(owner, attr)]   # a method, or a function looked up here but defined elsewhere
    for name in users:
        importlib.import_module(name)
    return [(owner, attr)] + [(m, attr) for n, m in list(sys.modules.items())
                              if n.split(".")[0] in ("minidist", "minidist_course")
                              and m is not owner and getattr(m, attr, None) is fn]
