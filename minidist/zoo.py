"""The bug zoo: bugs that real distributed-training projects shipped, each reproduced as a
one-line mutation of minidist's own code behind a switch that is off unless a test or a lesson
turns it on (:func:`inject`). They are what :mod:`minidist.hybrid.bisect` is tested on: for each,
the bisector must name the first tensor that leaves the one-process run, its rank and the pattern.

Every switch is read where the bug lives (``if zoo.on("name")``), so the mutation is next to the
correct line it replaces. Nothing here changes a run unless :func:`inject` is active in that
process (inside :func:`minidist.run`'s rank function: each rank is its own process).
"""

from __future__ import annotations

import contextlib

__all__ = ["BUGS", "on", "inject"]

# name -> (what the mutation does, where it comes from)
BUGS: dict[str, tuple[str, str]] = {
    "dp-sum-not-average": (
        "the data-parallel all-reduce sums the gradients and never divides by the replicas",
        "picotron's first DP hook; DeepSpeed #8729 (gradients averaged over the wrong count)"),
    "dp-divide-twice": (
        "the gradients are divided by the data-parallel size before and after the average",
        "DeepSpeed #8668 (pre- and post-divide both applied)"),
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
        "causal-mask offsets of ring attention's zigzag blocks (ring-flash-attention's issues)"),
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


def on(name: str) -> bool:
    """True when the zoo's bug ``name`` is switched on in this process."""
    return name in _active


@contextlib.contextmanager
def inject(name: str):
    """Switch the bug ``name`` on inside the block (this process only).

    Raises ``ValueError`` for a name not in :data:`BUGS` (naming the known ones)."""
    if name not in BUGS:
        raise ValueError(f"zoo.inject: unknown bug {name!r}; known: {sorted(BUGS)}")
    _active.add(name)
    try:
        yield
    finally:
        _active.discard(name)
