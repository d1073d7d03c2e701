"""The launcher: ``minidist.run(fn, world_size)`` starts the ranks and supervises them
(:mod:`.launcher`), what runs inside each (:mod:`.rank_process`), and the failure reports
(:mod:`.errors`)."""

from .errors import RankError, RankTimeoutError
from .launcher import run

__all__ = ["run", "RankError", "RankTimeoutError"]
