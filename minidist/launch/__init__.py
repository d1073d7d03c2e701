"""The launcher: ``minidist.run(fn, world_size)`` starts the ranks and supervises them.

* :mod:`~minidist.launch.launcher` — :func:`run`: fork (or spawn) the ranks, drain their output
  and results, stop everyone on the first failure or timeout, leave no orphans
* :mod:`~minidist.launch.rank_process` — what runs inside each rank: environment, process group,
  device, the published current op, the stack dump on SIGUSR1, the result or the error
* :mod:`~minidist.launch.errors` — :class:`RankError` / :class:`RankTimeoutError`: the root
  cause first, the op and peer a rank was stuck in, start-up failures retried
"""

from .errors import RankError, RankTimeoutError
from .launcher import run

__all__ = ["run", "RankError", "RankTimeoutError"]
