"""The oracles: what every check of a strategy compares with — one process on the global batch,
torch's own implementation, the toy models and batches the checks share.

Grading, ``minidist bench``, ``minidist demo``, the tests and the chapters all import from here,
and this package imports only the strategies and the ground below them, so none of those users
imports another to reach a reference.

======================  ====================================================================
module                  what it holds
======================  ====================================================================
``data_parallel``       DDP: one process on the global batch, torch's own DDP, the synthetic
                        batches they share, the shared training harness ``train_ddp``
``tensor_parallel``     "equal to the single-process model": rel_error, and the TP checks
                        (f/g MLP, vocab-parallel cross-entropy, the TP GPT) the demo, tests and
                        ch06 share
``sharding``            the ZeRO tests' toy model (tied weights, a frozen parameter, a buffer,
                        sizes not divisible by W), its batches, one process on the global batch
``hybrid``              the 3-D oracle: the tiny tied GPT, its batch with ignored targets, one
                        process on it (clipped by the global norm), and ``compare``
``fault_tolerant``      torchft on CPU (the production counterpart of restarts): a lighthouse,
                        replica groups as processes, one killed and healed; torchft's DiLoCo
``expert_parallel``     the dense one-process MoE (every expert on every token, the drop rule
                        as a Python loop), sharing no code with the expert-parallel path
``bisect``              the first tensor where a parallel step leaves one process on the same
                        seed and batch (``diagnose``: what its error's pattern means)
======================  ====================================================================

Nothing is imported here eagerly: ``import minidist_course.references.data_parallel`` loads only
what it needs.
"""

__all__ = ["data_parallel", "tensor_parallel", "sharding", "hybrid", "fault_tolerant", "bisect", "diagnose",
           "expert_parallel"]
