"""minidist_course: the course kit that drives and checks the library in :mod:`minidist`.

The library (``minidist``) is the from-scratch part: collectives on send/recv, the launcher and the
strategies. This package is everything that teaches, measures and grades them, and it imports the
library the way a user would (``from minidist import ...``); the library never imports it.

======================  =====================================================================
module                  what it holds
======================  =====================================================================
``references``          one-process oracles the library is checked against (DDP, TP, ZeRO,
                        the dense MoE, fault tolerance, the 3-D grid)
``planner``             cost models and the configuration search (``minidist plan``)
``bench``               side-by-side benchmarks against torch (``minidist bench``)
``lessons``             the tour's sections (``minidist demo``) and the chapters' helpers
``grading``             the exercises' graders
``diagrams``            the chapters' pictures
``cli``, ``doctor``     the ``minidist`` command and its environment check
``exercises``           builds ``exercises/`` from ``solutions/``
``data``, ``text``      offline data sets: the bundled digits, a text corpus
======================  =====================================================================

Every subpackage is imported on first use (``minidist_course.planner``), so
``import minidist_course`` stays light.
"""

import importlib
import importlib.util

_LAZY = ("references", "planner", "bench", "lessons", "grading", "diagrams", "cli", "doctor",
         "exercises", "data", "text")

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f"{__name__}.{name}")  # errors inside it propagate
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
