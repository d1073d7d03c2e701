"""The ``wait`` rule of the collective graders: every isend/irecv is waited before its buffer is
read or the learner's function returns.

Inside each rank, :func:`watch_waits` wraps ``minidist.comm.p2p``'s ``isend`` and ``irecv`` (which
``exchange``, ``send`` and ``recv`` call too), so every Work is recorded and knows whether it was
waited; and it fills each floating receive buffer with NaN before its irecv is posted, so code that
adds a buffer before its receive completed computes NaN instead of a plausible wrong number (which
the sum decoder would blame on the wrong chunk). :func:`wait_problem` turns both into the rule's
message. Correct code never sees the NaN: a completed receive overwrites it.
"""

from __future__ import annotations

import torch

from minidist.comm import p2p

__all__ = ["watch_waits", "wait_problem"]


class _Watched:
    """A p2p Work that remembers whether it was waited."""

    def __init__(self, work, what: str):
        self.work, self.what, self.waited = work, what, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def watch_waits(posted: list, poison: bool = True):
    """Patch p2p.isend/irecv (what exchange, send and recv call too) so every Work is recorded in
    ``posted``, and every floating receive buffer is filled with NaN before its irecv is posted:
    code that reads a buffer before its receive completed then computes NaN, never a plausible
    number (``poison``; off for an all-gather, whose unreceived slots already start as NaN and whose
received chunks are forwarded, not added). Returns a function that undoes the patch."""
    isend, irecv = p2p.isend, p2p.irecv

    def watched_isend(tensor, dst, group=None, tag=0, **kw):
        w = _Watched(isend(tensor, dst, group, tag, **kw), f"isend to rank {dst}")
        posted.append(w)
        return w

    def watched_irecv(tensor, src, group=None, tag=0, **kw):
        if poison and torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.numel():
            tensor.fill_(float("nan"))
        w = _Watched(irecv(tensor, src, group, tag, **kw), f"irecv from rank {src}")
        posted.append(w)
        return w

    p2p.isend, p2p.irecv = watched_isend, watched_irecv

    def undo():
        p2p.isend, p2p.irecv = isend, irecv
    return undo



def wait_problem(outs, reference: str, name: str) -> str | None:
    """A Work never waited, or (a reduction) NaN in a result: a buffer read before its receive."""
    lines = [f"rank {r}: {', '.join(unwaited)} never waited before {name} returned (an unwaited "
             f"receive may not have arrived yet; wait for every Work, e.g. p2p.wait_all(works))"
             for r, (_, _, _, unwaited) in enumerate(outs) if unwaited]
    if not lines and reference != "all_gather":
        lines = [f"rank {r}: the result holds NaN. The grader fills every receive buffer with NaN "
                 "when its irecv is posted, so a NaN means a buffer was read (added) before its "
                 "irecv completed: wait for the receive first, then add"
                 for r, (got, _, _, _) in enumerate(outs)
                 if torch.is_tensor(got) and got.is_floating_point() and bool(got.isnan().any())]
    return "\n".join(lines) or None
