"""3-D parallelism: data x tensor x pipeline parallelism for the tiny GPT, on a ProcessGrid.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (§2-3); Shoeybi et al. 2019 (tensor parallelism). Built only from minidist's own
strategies: tensor_parallel (layers, vocab-parallel cross-entropy, sequence parallelism),
pipeline_parallel (schedules, engine), data_parallel (flat average, BucketedDDP) and sharding (ZeRO-1).

======================  =====================================================================
module                  what it holds
======================  =====================================================================
``stages``              HybridGPT: this rank's pipeline stages of the TP-split GPT (weights cut
                        from the full GPT), tied-embedding and sequence-parallel gradient duties;
                        check_grid (a grid that does not divide the model is a ValueError)
``dp``                  the three DP modes: flat, bucketed (PipelineBucketedDDP), zero1
                        (ZeRO1Optimizer: reduce-scatter, clip on slices, step, all-gather)
``dp_pipeline``         dp_pipeline_step: the pipeline engine composed with data parallelism
                        (the replicas' gradient average; loss and token count over replicas)
``clip``                global gradient norm and clipping across TP shards and stages
``step``                train_step: one step (pipeline, gradient duties, clip, optimizer)
``reshard``             layout-free checkpoints: full weights and optimizer state (AdamW moments,
                        ZeRO-1 slices consolidated), saved at one (dp, pp, tp), loaded at any
======================  =====================================================================

Usage (on every rank, inside ``minidist.run`` or after ``minidist.init()``)::

    grid = ProcessGrid(dp, pp, tp)
    model = HybridGPT(cfg, grid, chunks=v, sequence_parallel=sp, seed=0)
    modules = wrap_stages(model, "bucketed")
    opt = make_optimizer(model, "bucketed", torch.optim.AdamW, lr=1e-3)
    out = train_step(model, opt, modules, ids, targets, microbatches=4, dp_mode="bucketed")
"""

from . import clip, dp, dp_pipeline, reshard, stages, step  # noqa: F401
from .clip import clip_grad_norm_, global_grad_norm  # noqa: F401
from .dp import DP_MODES, PipelineBucketedDDP, ZeRO1Optimizer, make_optimizer  # noqa: F401
from .dp_pipeline import dp_pipeline_step, sync_gradients  # noqa: F401
from .reshard import load_layout_free, save_layout_free  # noqa: F401
from .stages import CPGPTStage, GPTStage, HybridGPT, check_grid, stage_bounds  # noqa: F401
from .dp_modes import wrap_stages  # noqa: F401
from .loss import make_loss_fn  # noqa: F401
from .step import StepOutput, train_step  # noqa: F401

__all__ = ["HybridGPT", "GPTStage", "CPGPTStage", "check_grid", "stage_bounds", "PipelineBucketedDDP", "ZeRO1Optimizer",
           "make_optimizer", "DP_MODES", "global_grad_norm", "clip_grad_norm_", "train_step",
           "wrap_stages", "make_loss_fn", "StepOutput", "dp_pipeline_step", "sync_gradients",
           "save_layout_free", "load_layout_free"]
