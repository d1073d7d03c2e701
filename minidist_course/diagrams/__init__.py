"""Matplotlib drawings for the course, drawn by functions the chapters call (small figures).

* ``collectives.py`` (chapters 02-03): what each collective does (:func:`draw_collective`), a ring
  all-reduce step by step (:func:`ring_schedule`, :func:`draw_ring_steps`);
* ``launch.py`` (chapters 01 and 08): nodes × local ranks → global ranks for torchrun and Slurm
  (:func:`rank_layout`, :func:`draw_rank_grid`), and the launcher tree with the rendezvous store
  (:func:`draw_launcher_tree`);
* ``tensor_parallel.py`` (chapter 06): a weight split by columns and by rows with per-rank shapes
  (:func:`draw_weight_split`), the transformer block with f and g (:func:`draw_megatron_block`),
  the sequence-parallel regions along the sequence axis (:func:`draw_sequence_parallel`);
* ``memory.py`` (chapter 09): which parallelism when — model states per device against model size
  for DP, ZeRO-1/2/3, TP and PP (:func:`parallelism_memory`, :func:`largest_fitting`,
  :func:`draw_parallelism_memory`);
* ``bisect.py`` (chapter 12): a bisector's report as tensors × steps coloured by error over budget
  (:func:`draw_divergence`).
* ``step_timeline.py`` (chapter 12): one 3-D step recorded on every rank, by kind
  (``record_step``, ``plot_step_timeline``; imported as ``minidist_course.diagrams.step_timeline``).

Every function returns the ``matplotlib.figure.Figure`` it drew.
"""

from .bisect import draw_divergence  # noqa: F401
from .roofline import draw_roofline  # noqa: F401
from .collectives import (COLLECTIVES, collective_layout, draw_collective,  # noqa: F401
                          draw_ring_steps, ring_schedule)
from .launch import draw_launcher_tree, draw_rank_grid, rank_layout  # noqa: F401
from .memory import (K_MIXED_ADAM, draw_parallelism_memory, largest_fitting,  # noqa: F401
                     parallelism_memory)
from .tensor_parallel import (draw_megatron_block, draw_sequence_parallel,  # noqa: F401
                              draw_weight_split, split_shapes)

__all__ = ["COLLECTIVES", "collective_layout", "draw_collective", "ring_schedule",
           "draw_ring_steps", "rank_layout", "draw_rank_grid", "draw_launcher_tree",
           "split_shapes", "draw_weight_split", "draw_megatron_block", "draw_sequence_parallel",
           "K_MIXED_ADAM", "parallelism_memory", "largest_fitting", "draw_parallelism_memory",
           "draw_divergence", "draw_roofline"]
