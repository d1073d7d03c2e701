"""The two rules of checkpoint generations, on a listing (no files): which generation a run
resumes from, and which ones a save retires. :mod:`minidist.checkpoint_io` applies them to the
folders it finds; course exercise 16 asks a learner to write them.

A listing is ``[(number, complete), ...]`` in any order: ``complete`` is whether the generation
has its manifest (a save that finished). Whether a complete generation's files still match the
manifest is asked lazily, through ``verifies(number) -> bool``, because checking means reading
every file of it.

Sources: the same commit-then-pick protocol as ``torch.distributed.checkpoint`` (a checkpoint
exists once its ``.metadata`` is written) and Megatron-LM (``latest_checkpointed_iteration.txt``
names the newest finished save); keeping the newest *good* ones, not the newest ones, is what
lets a corrupt save never push out the last good one.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["choose_generation", "generations_to_retire"]


def choose_generation(listing: Iterable[tuple[int, bool]], generation: int | None = None,
                      fallback: bool = False,
                      verifies: Callable[[int], bool] = lambda n: True) -> int:
    """The generation to resume from.

    * ``generation`` given: that one, if complete;
    * else the newest complete one (an unfinished newer save is skipped: it never finished);
    * with ``fallback``, the newest complete one that ``verifies`` (a corrupt one is skipped).

    Raises ``FileNotFoundError`` when the asked generation is not complete or when none is
    complete, ``ValueError`` when every complete one fails ``verifies`` (with ``fallback``)."""
    listing = list(listing)
    done = sorted(n for n, complete in listing if complete)
    if generation is not None:
        if generation not in done:
            raise FileNotFoundError(f"no complete generation {generation} (complete: {done})")
        return generation
    if not done:
        raise FileNotFoundError("no complete generation (every save is unfinished)"
                                if listing else "no generation at all")
    if not fallback:
        return done[-1]
    for n in reversed(done):
        if verifies(n):
            return n
    raise ValueError(f"every complete generation is corrupt ({done}); nothing to fall back to")


def generations_to_retire(listing: Iterable[tuple[int, bool]], new: int, keep: int,
                          verifies: Callable[[int], bool] = lambda n: True) -> list[int]:
    """The generations a save of ``new`` removes, oldest first: walking from the newest down,
    ``new`` and then the complete ones that verify count as good until ``keep`` are counted;
    everything older than the last one counted is removed. A corrupt or unfinished generation
    does not count (it would push out a good one); it goes once it is older than that."""
    good, out = 1, []
    for n, complete in sorted(listing, reverse=True):
        if n == new:
            continue
        if good >= keep:
            out.append(n)
            continue
        good += bool(complete and verifies(n))
    return sorted(out)
