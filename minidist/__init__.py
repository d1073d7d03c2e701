"""minidist: distributed deep-learning training built from scratch on torch.distributed.

    import minidist
    results = minidist.run(fn, world_size=4)        # fn(rank, world_size, *args) on 4 ranks
    minidist.collectives.all_reduce(t, op="sum")     # hand-built ring all-reduce (inside a rank)
    info = minidist.init()                           # in a script under torchrun or srun

The strategies (``data_parallel``, ``hybrid``, ...) load on first use."""

import importlib
import importlib.util

from . import env  # noqa: F401
from .env import init  # noqa: F401
from .launch import RankError, RankTimeoutError, run  # noqa: F401

__version__ = "0.1.0"

# subpackages and modules reachable as minidist.<name>, imported when first touched (PEP 562)
_LAZY = ("collectives", "communicator", "comm", "data_parallel", "tensor_parallel",
         "pipeline_parallel", "sharding", "grid", "models", "trace", "hybrid", "expert_parallel",
         "context_parallel", "checkpoint_io")

__all__ = ["run", "init", "RankError", "RankTimeoutError", "env", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f"{__name__}.{name}")  # errors inside it propagate
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
