"""What the course and ``minidist demo`` need beside the strategies: demos, training loops,
references and checks. A strategy package (``data_parallel``, ``tensor_parallel``,
``pipeline_parallel``) holds only its strategy; this package drives and checks it.

======================  ====================================================================
module                  what it holds
======================  ====================================================================
``ddp_reference``       independent references for DDP: one process on the global batch,
                        torch's own DDP, the synthetic batches they share
``ddp_training``        the digits training loop of ch05 and of ``minidist demo``
``ddp_plots``           the bucket-layout picture of ch04
``ddp_demo``            the data-parallel rows of ``minidist demo``
``tp_checks``           "equal to the single-process model": rel_error, and the TP checks
                        the demo, the tests and ch06 share
``tp_demo``             the tensor-parallel rows of ``minidist demo``
``pp_demo``             the pipeline rows of ``minidist demo``
``sharding_demo``       the sharding rows of ``minidist demo`` (ZeRO-1/2/3, memory, traffic)
``sharding_reference``  the ZeRO tests' toy model (tied weights, a frozen parameter, a buffer,
                        sizes not divisible by W), its batches, one process on the global batch
``hybrid_demo``         the 3-D rows of ``minidist demo`` ((dp, tp, pp) = (2, 2, 2) vs one process)
``hybrid_timeline``     one 3-D step's per-rank timeline for ch12's Gantt chart
``ep_checks``           the expert-parallel checks the demo, ch15 and exercise 15 share: the
                        MoE layer and MoEGPT on a dp x ep grid against one process
``ep_demo``             the expert-parallel rows of ``minidist demo``
``gpu_check``           the checks of ``tools/gpu-check.sh`` (CUDA/NCCL paths against references)
======================  ====================================================================

Nothing is imported here eagerly: ``import minidist.lessons.ddp_demo`` loads only what it needs.
"""
