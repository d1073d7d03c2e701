"""Benchmarks: numbers measured in the same run as their reference, never asserted in tests.

======================  ====================================================================
module                  what it measures
======================  ====================================================================
``collectives``         nccl-tests-style measurement of the hand-built collectives against
                        torch's and a control (torch timed again: the run's noise floor);
                        ``collectives_report``: the table, alpha-beta fit, plots
``data_parallel``       step time of the bucketed DDP against torch's DDP (``minidist bench ddp``)
``pipeline_parallel``   measured pipeline bubble against the simulator's prediction, and
                        activation memory per stage (``minidist bench pp``)
``sharding``            DDP, ZeRO-1/2/3 (hand-built and torch collectives) and torch's FSDP2:
                        step time and accounted memory per rank beside ZeRO's formula
                        (``minidist bench zero``)
``alpha_beta``          the collective's alpha-beta model fitted to medians of size-scaled
                        repetitions, with bootstrap spreads (``alpha_beta_bench``:
                        ``minidist bench alpha-beta``); what ``minidist plan`` reads
``flops``               fp32 matmul GFLOP/s (2 n³ FLOPs), median of repetitions, threads stated
                        (``minidist bench flops``)
``context_parallel``    ring attention against one process and Ulysses: step time, the
                        communication hidden behind the block compute (``minidist bench cp``)
``two_level``           2 nodes x 2 ranks under the software topology: ring vs hierarchical
                        all-reduce at three beta ratios, FSDP vs HSDP, DDP vs PowerSGD vs
                        DiLoCo, TP and EP inside a node vs across (``placement``), inter-node
                        bytes and step time; ``two_level_report``: the planner's prediction per
                        link class beside each row (``minidist bench two-level``)
======================  ====================================================================

``from minidist_course import bench`` gives the collectives benchmark's functions directly
(``bench.run_bench``, ``bench.busbw_factor``, ...), as before it became a package.
"""

from .collectives import ALGORITHMS, CONTROL, OPS, busbw_factor, parse_size, run_bench  # noqa: F401
from .collectives_report import fit_alpha_beta, format_table, noise_floor, plot_busbw  # noqa: F401

__all__ = ["run_bench", "busbw_factor", "fit_alpha_beta", "plot_busbw", "format_table",
           "noise_floor", "ALGORITHMS", "CONTROL", "OPS", "parse_size"]
