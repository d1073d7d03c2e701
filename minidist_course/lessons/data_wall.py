"""The efficiency wall of the input pipeline: a data-parallel loop whose data comes from image files.

CPU data-processing pipelines "have become a bottleneck, limiting the performance and scalability
of training and inference" (NVIDIA/DALI, README.rst). To see it, the course's digits are
written to disk as PNG files (:func:`write_digit_pngs`, upscaled to ``size`` x ``size`` pixels),
and :class:`PNGDigits` opens, decodes, augments and resizes one file per sample (a random
rotation and shift, then a resize to the model's ``out_size`` x ``out_size``, with PIL — the way a
``torchvision.transforms`` pipeline does it on PIL images), in whatever process the
``DataLoader`` gives it. :func:`train_input_pipeline` trains bucketed DDP on it and
records, per rank, three lanes of a :class:`minidist.trace.Timeline`:

=======  ================================================================================
lane     events
=======  ================================================================================
data     ``"data wait"``: the main thread blocked in ``next(loader)`` (plus, offline, the
         batched augmentation) — the time the accelerator would sit idle; ``"loader start"``:
         ``iter(loader)`` at each epoch, where the workers start
main     ``"forward"``, ``"backward"``, ``"wait"`` (DDP waiting for its last buckets),
         ``"optimizer"``
comm     ``"all-reduce bN"``: DDP's communication thread (overlaps backward)
=======  ================================================================================

The fixes practitioners reach for are the ``DataLoader``'s arguments — ``num_workers`` (decode in
other processes), ``prefetch_factor`` (batches each worker prepares ahead; needs workers),
``persistent_workers`` (keep the workers between epochs instead of starting them again),
``pin_memory`` (page-locked host buffers, so a copy to a GPU can be asynchronous: with no GPU
it has nothing to do) — and preprocessing offline (:func:`preprocess_offline`: decode every file
once into one uint8 tensor; online, only the random augmentation stays, done on the whole batch
at once with ``affine_grid``/``grid_sample``).
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..data import load_digits
from minidist.data_parallel import BucketedDDP
from minidist.data_parallel.sampler import DistributedSampler
from minidist.models import MLP
from minidist.trace import Timeline
from .scaling import recorded_step

__all__ = ["write_digit_pngs", "PNGDigits", "preprocess_offline", "OfflineDigits",
           "augment_batch", "train_input_pipeline", "LOADER_OPTIONS"]

MAX_DEGREES, MAX_SHIFT = 15.0, 2   # the augmentation: rotation in ±15°, shift in ±2 pixels

# loader options accepted by train_input_pipeline (DataLoader's names), plus "offline"
LOADER_OPTIONS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "offline")


def write_digit_pngs(folder: str | os.PathLike, size: int = 64, limit: int | None = None) -> int:
    """Write the training digits (:func:`minidist_course.data.load_digits`) as ``size`` x ``size``
    grayscale PNG files ``folder/00000.png``... (bicubic upscaling of the 8x8 originals) and their
    labels to ``folder/labels.txt``; returns the number written (``limit``: the first ones only)."""
    from PIL import Image

    if size < 8:
        raise ValueError(f"write_digit_pngs: size must be >= 8 pixels, got {size}")
    x, y = load_digits()[0].tensors
    n = len(x) if limit is None else min(limit, len(x))
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        pixels = (x[i].view(8, 8) * 255).round().to(torch.uint8).numpy()
        Image.fromarray(pixels, mode="L").resize((size, size), Image.BICUBIC).save(
            os.path.join(folder, f"{i:05d}.png"))
    with open(os.path.join(folder, "labels.txt"), "w") as f:
        f.write("\n".join(str(int(v)) for v in y[:n]))
    return n


def _labels(folder) -> torch.Tensor:
    path = os.path.join(folder, "labels.txt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {path}: write the images first with write_digit_pngs({folder!r})")
    with open(path) as f:
        return torch.tensor([int(v) for v in f.read().split()], dtype=torch.int64)


class PNGDigits(Dataset):
    """Item ``i``: ``(x float32 [1, out_size, out_size] in [0, 1], y int64)`` —
    ``folder/{i:05d}.png`` opened, decoded, (``augment``) rotated by a random angle in ±15° and
    shifted by up to ±2 pixels of the output (PIL, bilinear), and resized (bilinear), on every
    access. The random draws use torch's generator, which the ``DataLoader`` seeds differently in
    each worker."""

    def __init__(self, folder: str | os.PathLike, augment: bool = True, out_size: int = 32):
        self.folder, self.augment, self.out_size = os.fspath(folder), augment, out_size
        self.labels = _labels(self.folder)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(os.path.join(self.folder, f"{i:05d}.png")) as img:
            img = img.convert("L")
            if self.augment:
                angle = (torch.rand(()).item() * 2 - 1) * MAX_DEGREES
                dx, dy = (torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2,)) * img.width
                          // self.out_size).tolist()
                img = img.rotate(angle, resample=Image.BILINEAR, translate=(dx, dy))
            img = img.resize((self.out_size, self.out_size), Image.BILINEAR)
            x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
            x = x.view(1, img.height, img.width).to(torch.float32) / 255
        return x, self.labels[i]


def preprocess_offline(folder: str | os.PathLike, out_size: int = 32) -> str:
    """Decode and resize every PNG of ``folder`` once into ``folder/decoded.pt`` (uint8
    [N, 1, out_size, out_size] and the labels); returns its path. Done once, before training, by
    one process; the random augmentation stays online (:func:`augment_batch`)."""
    data = PNGDigits(folder, augment=False, out_size=out_size)
    images = torch.stack([(data[i][0] * 255).round().to(torch.uint8) for i in range(len(data))])
    path = os.path.join(os.fspath(folder), "decoded.pt")
    torch.save({"images": images, "labels": data.labels}, path)
    return path


class OfflineDigits(Dataset):
    """Items of :func:`preprocess_offline`'s file: ``(x uint8 [1, H, W], y)``, no decoding; the
    augmentation runs on the batch (:func:`augment_batch`)."""

    def __init__(self, path: str | os.PathLike):
        saved = torch.load(path)
        self.images, self.labels = saved["images"], saved["labels"]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]


def augment_batch(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The same augmentation as :class:`PNGDigits` on a whole uint8 batch [B, 1, H, W] at once:
    one rotation (±15°) and shift (±2 pixels) per image, bilinear, zeros outside; float32 in [0, 1]."""
    b, _, h, w = x.shape
    angle = (torch.rand(b, generator=generator) * 2 - 1) * math.radians(MAX_DEGREES)
    shift = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (b, 2), generator=generator).float()
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack([torch.stack([cos, -sin, -2 * shift[:, 0] / w], 1),
                         torch.stack([sin, cos, -2 * shift[:, 1] / h], 1)], 1)
    grid = F.affine_grid(theta, [b, 1, h, w], align_corners=False)
    return F.grid_sample(x.float() / 255, grid, mode="bilinear", align_corners=False)


def _loader(data, sampler, batch_size, num_workers=0, pin_memory=False, prefetch_factor=None,
            persistent_workers=False):
    return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, prefetch_factor=prefetch_factor if num_workers else None,
                      persistent_workers=persistent_workers and num_workers > 0, drop_last=True)


def train_input_pipeline(rank: int, world_size: int, folder: str, epochs: int = 3,
                         batch_size: int = 32, limit: int | None = None, hidden: int = 128,
                         seed: int = 0, **loader) -> dict:
    """Train an MLP (32² → ``hidden`` → ``hidden`` → 10) with bucketed DDP for ``epochs``
    epochs on the PNG digits of ``folder``, timing where each rank's time goes.

    Args:
        loader: ``DataLoader`` options (``num_workers``, ``pin_memory``, ``prefetch_factor``,
            ``persistent_workers``), and ``offline=True`` to read ``folder/decoded.pt``
            (:func:`preprocess_offline`, which must have run) and augment on the batch.
        limit: use only the first ``limit`` images (shorter epochs).

    Returns:
        ``{"events", "t0", "wall_s", "samples_per_s", "data_s", "compute_s", "comm_s",
        "exposed_comm_s", "steps", "pinned", "loss", "warnings", "worker_pids"}``: ``events`` the
        Timeline's (with this ``rank``; lanes in the module docstring; ``t0`` its origin on ``perf_counter``), ``data_s`` the lane ``data``
        summed, ``compute_s`` forward + backward + optimizer less DDP's wait, ``comm_s`` the summed
        all-reduces (mostly hidden behind backward), ``exposed_comm_s`` DDP's ``"wait"``,
        ``pinned``: whether the batches arrived in pinned memory, ``warnings``: what the
        ``DataLoader`` warned (e.g. that ``pin_memory`` found no accelerator), ``worker_pids``: per
        epoch, the process ids of the loader's workers (``()`` without workers; the same ids in
        every epoch when they are persistent).
    """
    if unknown := set(loader) - set(LOADER_OPTIONS):
        raise ValueError(f"train_input_pipeline (rank {rank}): unknown loader option(s) "
                         f"{sorted(unknown)}; expected some of {LOADER_OPTIONS}")
    offline = loader.pop("offline", False)
    data = OfflineDigits(os.path.join(folder, "decoded.pt")) if offline else PNGDigits(folder)
    if limit is not None:
        data = torch.utils.data.Subset(data, range(min(limit, len(data))))
    sampler = DistributedSampler(len(data), world_size, rank, shuffle=True, seed=seed, drop_last=True)
    batches = _loader(data, sampler, batch_size, **loader)
    size = data[0][0].shape[-1]
    torch.manual_seed(seed)
    tl = Timeline()
    ddp = BucketedDDP(MLP(size * size, (hidden, hidden), 10), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05 * world_size, momentum=0.9)
    g = torch.Generator().manual_seed(seed + rank)
    pinned, warned, steps, loss, worker_pids = [], [], 0, torch.zeros(()), []
    if dist.is_initialized():
        dist.barrier()
    tl.clear()
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        with tl.record("loader start", lane="data"), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")     # e.g. pin_memory without an accelerator
            it = iter(batches)                  # workers start here (unless persistent)
        warned += w
        worker_pids.append(tuple(p.pid for p in getattr(it, "_workers", ())))
        while True:
            with tl.record("data wait", lane="data"):
                batch = next(it, None)
                if batch is not None and offline:
                    batch = (augment_batch(batch[0], g), batch[1])
            if batch is None:
                break
            x, y = batch
            pinned.append(x.is_pinned())
            recorded_step(ddp, opt, x.flatten(1), y, tl)
            steps += 1
    wall = time.perf_counter() - start
    ddp.close()
    exposed = tl.total("wait", lane="main")   # DDP waits inside backward (autograd's callback)
    compute = sum(tl.total(k) for k in ("forward", "backward", "optimizer")) - exposed
    return {"events": [e._replace(rank=rank) for e in tl.events], "t0": tl.origin, "wall_s": wall,
            "samples_per_s": steps * batch_size / wall, "data_s": tl.total(lane="data"),
            "compute_s": compute, "comm_s": tl.total("all-reduce", lane="comm"),
            "exposed_comm_s": exposed, "steps": steps,
            "pinned": bool(pinned) and all(pinned), "loss": float(loss.detach()),
            "worker_pids": worker_pids,
            "warnings": sorted({str(w.message) for w in warned})}
