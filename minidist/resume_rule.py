"""The two rules of checkpoint generations, on a listing (no files): which generation a run
resumes from, and which ones a save retires (:mod:`minidist.checkpoint_io` applies them; course
exercise 16 asks a learner to write them). A listing is ``[(number, complete), ...]``;
``verifies(number) -> bool`` is asked lazily (it reads every file). Keeping the newest good
generations, not the newest, means a corrupt save never pushes out the last good one.

Design notes: docs/design/ground.md"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["choose_generation", "generations_to_retire"]


def choose_generation(listing: Iterable[tuple[int, bool]], generation: int | None = None,
                      fallback: bool = False,
                      verifies: Callable[[int], bool] = lambda n: True) -> int:
    """The generation to resume from: ``generation`` if given and complete, else the newest complete
    one; with ``fallback`` the newest complete one that ``verifies``. FileNotFoundError: the asked one
    or every one incomplete; ValueError: none verifies (with ``fallback``)."""
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
    """The generations a save of ``new`` removes, oldest first: everything older than the ``keep``-th
    good one counting down from ``new`` (corrupt or unfinished ones do not count)."""
    good, out = 1, []
    for n, complete in sorted(listing, reverse=True):
        if n == new:
            continue
        if good >= keep:
            out.append(n)
            continue
        good += bool(complete and verifies(n))
    return sorted(out)
