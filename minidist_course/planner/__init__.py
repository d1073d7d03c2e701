"""The planner and its calculators: what a run needs (memory, FLOPs, time, money) before it runs.

* :mod:`~minidist_course.planner.calc` — memory and time on the back of an envelope (bytes per parameter,
  ZeRO memory, 6·N·D FLOPs, ring communication time)
* :mod:`~minidist_course.planner.cost` — FLOPs to GPU-hours to money, MFU
* :mod:`~minidist_course.planner.energy` — the electricity a run draws (GPU and node watts, PUE, price per kWh)
* :mod:`~minidist_course.planner.search` — every dp×tp×pp (+ZeRO, recomputation, interleaving)
  configuration of a GPT with its memory per device and predicted step time (``minidist plan``)
* :mod:`~minidist_course.planner.machine` — the same on this machine: CPU ranks sharing cores
  (``minidist plan --this-machine``), measured links, calibration
* :mod:`~minidist_course.planner.published` — link and precision presets and the published runs the
  planner is checked on (Megatron-LM Table 1, BLOOM)
* :mod:`~minidist_course.planner.scaling` — data parallelism's strong and weak scaling efficiency and its
  communication/computation ratio, predicted (``dp_scaling``; chapter 05)
* :mod:`~minidist_course.planner.two_level` — two link classes (inside a node, between nodes):
  the bytes each rank sends over each class, exactly, and the alpha-beta time of ring,
  hierarchical and all-to-all collectives and of FSDP/HSDP, DDP/PowerSGD/DiLoCo, TP and EP steps
  (``minidist bench two-level`` checks it)
* :mod:`~minidist_course.planner.expert_parallel` — expert parallelism: an MoE model's expert memory
  per rank and the all-to-all time of a step (``MoESpec``, ``predict_ep``; chapter 15)
* context parallelism's formulas (activations / cp, the ring's K/V traffic, the longest context in
  a device): :func:`activation_bytes`, :func:`ring_time`, :func:`longest_context` from
  :mod:`minidist_course.planner.context_parallel`, re-exported by :mod:`~minidist_course.planner.search`

The face::

    from minidist_course import planner as P
    P.plan(P.ModelSpec(...), global_batch, n_devices, device_memory, flop_rate)
"""

from . import calc, cost, energy
from .expert_parallel import MoESpec, predict_ep
from .machine import (busy_ranks, calibrate_overhead, load_link, optimizer_fraction,
                      predict_step_seconds, spearman, this_machine)
from .published import BLOOM, BLOOM_MEMORY_PER_GPU, LINKS, MEGATRON_TABLE1, PRECISIONS
from .search import LEGEND, RECOMPUTE, Config, Link, Links, ModelSpec, Prediction, format_table, plan, predict
from .search import activation_bytes, longest_context, ring_time  # context parallelism

__all__ = ["calc", "cost", "energy",
           "ModelSpec", "Link", "Links", "Config", "Prediction", "predict", "plan", "format_table",
           "RECOMPUTE", "LEGEND", "this_machine", "predict_step_seconds", "calibrate_overhead", "load_link",
           "spearman", "busy_ranks", "optimizer_fraction",
           "LINKS", "PRECISIONS", "MEGATRON_TABLE1", "BLOOM", "BLOOM_MEMORY_PER_GPU",
           "MoESpec", "predict_ep", "activation_bytes", "ring_time", "longest_context"]
