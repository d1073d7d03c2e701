"""minidist: distributed deep-learning training built from scratch on torch.distributed.

The few names a notebook needs::

    import minidist
    results = minidist.run(fn, world_size=4)        # fn(rank, world_size, *args) on 4 ranks
    minidist.collectives.all_reduce(t, op="sum")     # hand-built ring all-reduce (inside a rank)
    info = minidist.init()                           # in a script under torchrun or srun
"""

from . import collectives, comm, env  # noqa: F401
from .env import init  # noqa: F401
from .launch import RankError, RankTimeoutError, run  # noqa: F401

__version__ = "0.1.0"
__all__ = ["run", "init", "RankError", "RankTimeoutError", "collectives", "comm", "env"]
