"""The reader's core: each idea of the course in one short file, plain ``torch.distributed``.

Read these first. The rest of :mod:`minidist` is the same ideas with what a library adds around
them (argument checks at the public boundary, timelines, counters, timeouts, checkpoints); each
core file is tested bit-identical to the library on drawn inputs (``tests/library/core``), and
where the library's own code is already that short, the table names it.

==============================  ====================================================
``minidist.comm.ring``          the ring: reduce-scatter, all-gather, all-reduce (the base ring)
``core.ddp``                    bucketed data parallelism: gradient hooks, buckets, overlap
``core.zero``                   ZeRO-1/2: the optimizer state and gradients sharded
``core.fsdp``                   ZeRO-3: parameters gathered per unit, gradients reduce-scattered
``core.tensor_parallel``        column- and row-parallel linear layers (the f and g operators)
``core.pipeline``               the 1F1B schedule and the engine that runs it
``core.zero_bubble``            the backward split into its input (B) and weight (W) passes
``core.ring_attention``         context parallelism: blockwise attention merged by LSE
``core.moe``                    expert parallelism: top-k routing and the all-to-all dispatch
``core.grid``                   the process grid: one rank's coordinates and its groups
``minidist.hybrid.step``        the hybrid step: the pieces above in one training step
==============================  ====================================================
"""
