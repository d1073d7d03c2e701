"""Worked problems with answers computed by the course's own planner, and predictions against
measurements (:mod:`.core`); the problems themselves in :mod:`.bank`."""

from . import bank, bank_early, bank_late  # noqa: F401  (register the problems)
from .core import REGISTRY, Problem, check, compare, ledger_summary, predict, render, show

__all__ = ["REGISTRY", "Problem", "check", "compare", "ledger_summary", "predict", "render", "show"]
