"""Published numbers the planner (:mod:`minidist_course.planner`) is checked against, and its hardware defaults.

Every figure carries its source; nothing here is measured on this machine.

**Links.** Per-direction bandwidth of one GPU's link, as ``beta = 1 / bandwidth`` (s/byte), the
quantity :func:`minidist_course.planner.calc.comm_time` takes. Spec sheets give bandwidth, never a latency: the
``alpha`` values are an assumption of the order of one NCCL ring step (a few microseconds inside a
node, ~10 µs across InfiniBand), not a published figure. Sources (vendor spec sheets, dated by
their edition):

* NVLink 3 (A100 SXM): 600 GB/s per GPU, both directions together -> 300 GB/s each way
  (NVIDIA A100 Tensor Core GPU datasheet, 2021);
* NVLink 4 (H100 SXM): 900 GB/s per GPU both ways -> 450 GB/s (NVIDIA H100 datasheet, 2023);
* InfiniBand HDR: one 200 Gb/s ConnectX-6 port per GPU = 25 GB/s (NVIDIA DGX A100 datasheet,
  2020: 8 single-port HDR adapters for 8 GPUs); NDR: 400 Gb/s = 50 GB/s per GPU (DGX H100, 2023).

**Runs.** ``MEGATRON_TABLE1``: Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473), Table 1 (weak scaling on
Selene: DGX A100 80 GB nodes, 8 GPUs each, vocabulary 51,200, sequence 2,048, mixed precision,
activation recomputation, no optimizer sharding). Columns: billions of parameters, heads, hidden
size, layers, t, p, GPUs, batch size, achieved teraFLOP/s per GPU. The paper reports no memory
per GPU.

``BLOOM``: BLOOM-176B (BigScience, 2022). Shape, parallelism and batch from the training script
``train/tr11-176B-ml/tr11-176B-ml.slurm`` and its README in github.com/bigscience-workshop/bigscience:
70 layers, hidden 14,336, 112 heads, sequence 2,048, vocabulary padded to 250,880, TP=4, PP=12,
DP=8 on 384 A100 80 GB (48 nodes of 8), micro-batch 2, global batch 2,048, bf16,
``--checkpoint-activations`` (full recomputation), DeepSpeed's BF16_Optimizer = its own ZeRO-1
whose fp32 gradient buffer (4 bytes/parameter) is *not* sharded (README, "Deepspeed config").
Memory: "one copy of the model takes 48 GPUs (using 60 GB of memory on each GPU)" (BigScience,
"BigScience 176B Model" training page, bigscience.notion.site, 2022) — a measured figure, which
includes what no formula here counts (allocator caching and fragmentation, communication
buffers, the CUDA context).

**Bytes per parameter.** ``PRECISIONS`` maps a name to (weights, gradients, optimizer state)
bytes per parameter. ZeRO stage 1 shards the third, stage 2 also the second, stage 3 all three.
``"mixed"``: ZeRO's 2 + 2 + 12 (Rajbhandari et al. 2020, §3.1). ``"megatron-bf16"``: bf16 weights,
fp32 gradients, fp32 master + Adam moments: 18 bytes, 6 + 12/d with the distributed optimizer
(Megatron-LM README, "Distributed Optimizer" table) — also what BLOOM's BF16_Optimizer keeps.
``"megatron-fp16"``: 20 bytes, 4 + 16/d there (fp32 main gradients live with the optimizer).
``"deepspeed-bf16"``: DeepSpeed's BF16_Optimizer as the BLOOM README describes it: bf16 weights
and gradients plus an fp32 gradient buffer "of additional memory" that ZeRO-1 does not shard:
2 + (2 + 4) + 12/d. ``"fp32"``: 4 + 4 + 8 (AdamW in fp32, this machine's CPU ranks).
"""

from __future__ import annotations

__all__ = ["LINKS", "PRECISIONS", "MEGATRON_TABLE1", "BLOOM", "BLOOM_MEMORY_PER_GPU"]

# name -> (alpha s, beta s/byte); see the module docstring for the sources and the alpha caveat
LINKS = {
    "nvlink3": (5e-6, 1 / 300e9),
    "nvlink4": (5e-6, 1 / 450e9),
    "ib-hdr": (1e-5, 1 / 25e9),
    "ib-ndr": (1e-5, 1 / 50e9),
}

# name -> (weight bytes, gradient bytes, optimizer-state bytes) per parameter
PRECISIONS = {
    "mixed": (2, 2, 12),
    "megatron-bf16": (2, 4, 12),
    "megatron-fp16": (2, 2, 16),
    "deepspeed-bf16": (2, 6, 12),
    "fp32": (4, 4, 8),
}

# (params 1e9, heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU): Table 1
MEGATRON_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

BLOOM = dict(layers=70, hidden=14336, heads=112, vocab=250880, seq_len=2048, global_batch=2048,
             n_devices=384, tp=4, pp=12, dp=8, micro_batch=2, zero=1, recompute="full",
             precision="deepspeed-bf16", device_memory=80e9, devices_per_node=8)
BLOOM_MEMORY_PER_GPU = 60e9  # bytes, "using 60 GB of memory on each GPU" (measured)
