"""Datasets for the lessons: real handwritten digits offline, torchvision's sets from a local folder.

* :func:`load_digits` — scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes,
  Alpaydin & Kaynak 1998, UCI "Optical Recognition of Handwritten Digits"). The file ships inside
  scikit-learn, so it works with no network: the course's default.
* :func:`load_torchvision` — MNIST, FashionMNIST or CIFAR-10 through torchvision, read from a local
  ``root`` folder with ``download=False`` unless the caller allows a download. A missing folder is
  a clear error that says what to do, never a silent network access.
* :func:`load` — one entry point for both (``name="digits"`` or a torchvision name).

Every loader returns ``(train, test)`` datasets whose items are ``(x, y)``: ``x`` float32 in
[0, 1], ``y`` an int64 class index. Scaling is the same for both splits (no statistics are fitted
on the test set).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os

import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = ["load_digits", "load_torchvision", "load", "DatasetUnavailable", "TORCHVISION_SETS"]

TORCHVISION_SETS = {"mnist": "MNIST", "fashionmnist": "FashionMNIST", "cifar10": "CIFAR10"}


class DatasetUnavailable(RuntimeError):
    """The dataset is neither on disk nor allowed to be downloaded; the message says how to fix it."""


def load_digits(test_fraction: float = 0.25, seed: int = 0, image: bool = False
                ) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 handwritten digits, split into train and test (stratified, seeded).

    Args:
        test_fraction: share of the 1797 samples held out for testing (0.25 → 1347 train, 450 test).
        seed: seed of the split (the same seed gives the same split on every rank and every run).
        image: False → ``x`` of shape [N, 64]; True → [N, 1, 8, 8] for a CNN.

    Returns:
        ``(train, test)`` TensorDatasets of ``(x float32 in [0, 1], y int64 in 0..9)``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_digits: test_fraction must be in (0, 1), got {test_fraction}")
    x, y = _digits_arrays()
    # stratified split without sklearn's model_selection: per class, a seeded permutation
    g = torch.Generator().manual_seed(seed)
    train_idx, test_idx = [], []
    for c in range(10):
        idx = (y == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_test = int(round(len(idx) * test_fraction))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    train, test = torch.cat(train_idx).sort().values, torch.cat(test_idx).sort().values
    if image:
        x = x.view(-1, 1, 8, 8)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits: x [1797, 64] float32 in [0, 1], y [1797] int64 (cached per process).

    Reads the CSV that ships inside scikit-learn directly: importing sklearn takes 2+ s per
    process (scipy), which every forked rank would pay. Falls back to sklearn's loader."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DatasetUnavailable("load_digits needs scikit-learn (pip install scikit-learn), which "
                                 "ships the 8x8 digits file")
    path = os.path.join(list(spec.submodule_search_locations or [""])[0], "datasets", "data",
                        "digits.csv.gz")
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            rows = [[int(v) for v in line.split(",")] for line in f if line.strip()]
        table = torch.tensor(rows, dtype=torch.int64)
        data, target = table[:, :64], table[:, 64]
    else:  # a future scikit-learn may move the file
        from sklearn.datasets import load_digits as _sk_digits
        bunch = _sk_digits()
        data, target = torch.tensor(bunch.data), torch.tensor(bunch.target)
    return data.to(torch.float32) / 16.0, target.to(torch.int64)  # pixel values are 0..16


def load_torchvision(name: str, root: str | os.PathLike, download: bool = False,
                     limit: int | None = None) -> tuple[Dataset, Dataset]:
    """MNIST, FashionMNIST or CIFAR-10 from ``root`` (torchvision's folder layout).

    Args:
        name: ``"mnist"``, ``"fashionmnist"`` or ``"cifar10"`` (case-insensitive).
        root: the data folder (e.g. ``root/MNIST/raw/train-images-idx3-ubyte``).
        download: allow torchvision to download into ``root`` when the files are missing.
        limit: keep only the first ``limit`` samples of each split (quick lessons).

    Returns:
        ``(train, test)``: items ``(x float32 [C, H, W] in [0, 1], y int)``.

    Raises:
        DatasetUnavailable: the files are not in ``root`` and ``download`` is False (or the
            download failed: no network), with the folder it looked in.
    """
    key = name.lower().replace("-", "").replace("_", "")
    if key not in TORCHVISION_SETS:
        raise ValueError(f"load_torchvision: unknown dataset {name!r}; expected one of "
                         f"{sorted(TORCHVISION_SETS)} (or use load_digits for the offline digits)")
    import torchvision
    from torchvision import transforms

    cls = getattr(torchvision.datasets, TORCHVISION_SETS[key])
    tf = transforms.ToTensor()
    root = os.fspath(root)
    try:
        train = cls(root, train=True, download=download, transform=tf)
        test = cls(root, train=False, download=download, transform=tf)
    except RuntimeError as e:  # torchvision: "Dataset not found. You can use download=True ..."
        raise DatasetUnavailable(
            f"{TORCHVISION_SETS[key]} is not in {root!r} ({e}). Put the files there "
            f"(torchvision layout), pass download=True where the network allows, or use "
            f"minidist_course.data.load_digits() which works offline.") from None
    except OSError as e:  # URLError and friends: the download itself failed
        raise DatasetUnavailable(f"downloading {TORCHVISION_SETS[key]} into {root!r} failed "
                                 f"({e}); no network? Use minidist_course.data.load_digits().") from None
    if limit is not None:
        train = torch.utils.data.Subset(train, range(min(limit, len(train))))
        test = torch.utils.data.Subset(test, range(min(limit, len(test))))
    return train, test


def load(name: str = "digits", root: str | os.PathLike | None = None, download: bool = False,
         **kwargs) -> tuple[Dataset, Dataset]:
    """``load("digits")`` (offline, the default) or ``load("mnist", root=...)``: ``(train, test)``."""
    if name.lower() == "digits":
        return load_digits(**kwargs)
    if root is None:
        root = os.environ.get("MINIDIST_DATA", os.path.join(os.path.expanduser("~"), ".minidist",
                                                            "data"))
    return load_torchvision(name, root, download=download, **kwargs)
