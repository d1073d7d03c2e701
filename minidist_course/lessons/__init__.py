"""What the course and ``minidist demo`` need beside the strategies: demos, training loops and
plots. A strategy package (``data_parallel``, ``tensor_parallel``, ``pipeline_parallel``) holds
only its strategy; this package drives it and shows it. The oracles the demos compare with live
in :mod:`minidist_course.references` (grading, bench and the tests use them too).

==========================  ==============================================================================
module                      what it holds
==========================  ==============================================================================
``collectives_demo``        the collectives rows of ``minidist demo`` (every hand-built algorithm against
                            torch's, empty to large sizes)
``data_parallel_training``  the digits training loop of ch05 and of ``minidist demo``
``data_parallel_plots``     the bucket-layout picture of ch04
``large_batch``             ch04's batch sweep: steps and examples to a target loss from B = 32 to 2048
                            (linear scaling + warm-up), the noise scale along the way, the critical-batch
                            fit, DDP's gradient against one process on the batch
``data_parallel_demo``      the data-parallel rows of ``minidist demo``
``data_wall``               ch05's input pipeline: PNG digits decoded per sample, the DataLoader's fixes
                            and preprocessing offline, a ``data`` lane in the timeline
``scaling``                 ch05's strong and weak scaling of DDP measured on this machine
``tensor_parallel_demo``    the tensor-parallel rows of ``minidist demo``
``pipeline_parallel_demo``  the pipeline rows of ``minidist demo``
``sharding_demo``           the sharding rows of ``minidist demo`` (ZeRO-1/2/3, memory, traffic)
``hybrid_demo``             the 3-D rows of ``minidist demo`` ((dp, tp, pp) = (2, 2, 2) vs one process)
``hybrid_timeline``         one 3-D step's per-rank timeline for ch12's Gantt chart
``expert_parallel_checks``  the expert-parallel checks the demo, ch15 and exercise 15 share: the MoE layer
                            and MoEGPT on a dp x ep grid against one process
``expert_parallel_demo``    the expert-parallel rows of ``minidist demo``
``context_parallel_demo``   the context-parallel rows of ``minidist demo`` (ring attention and Ulysses
                            against full attention on one process; the ring's traffic)
``gpu_check``               the checks of ``tools/gpu-check.sh`` (CUDA/NCCL paths against references)
``fault_tolerant_demo``     ch16's rank functions: ``async_save`` overlap and its two traps, the kill-a-
                            rank lab, PowerSGD / DiLoCo loss and bytes against DDP
==========================  ==============================================================================

Nothing is imported here eagerly: ``import minidist_course.lessons.data_parallel_demo`` loads only
what it needs.
"""

__all__ = ["collectives_demo", "data_parallel_training", "data_parallel_plots", "large_batch",
           "data_parallel_demo", "data_wall", "scaling", "tensor_parallel_demo",
           "pipeline_parallel_demo", "sharding_demo", "hybrid_demo", "hybrid_timeline",
           "expert_parallel_checks", "expert_parallel_demo", "context_parallel_demo", "gpu_check",
           "fault_tolerant_demo"]  # modules, imported on use
