"""The ground floor: point-to-point transport (p2p), reduction rules (ops) and the algorithms
(ring, naive, tree, recursive_doubling; hierarchical over a two-level ``topology``) the public
collectives in ``minidist.collectives`` dispatch to. Nothing here knows about the public API above
it, DDP, TP or pipelines."""

from . import naive, ops, p2p, recursive_doubling, ring, tree
from .p2p import count_traffic, reset_traffic, traffic

__all__ = ["naive", "ops", "p2p", "recursive_doubling", "ring", "tree", "count_traffic",
           "reset_traffic", "traffic"]
