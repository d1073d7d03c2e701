"""minidist_course.data: the offline digits, and torchvision's MNIST path on a small generated fixture."""

import struct

import pytest
import torch

from minidist_course import data
from minidist.models import MLP, SmallCNN


def test_digits_split_is_disjoint_stratified_and_seeded():
    train, test = data.load_digits(test_fraction=0.25, seed=0)
    assert len(train) + len(test) == 1797 and len(test) == 450
    x, y = train.tensors
    assert x.shape == (1347, 64) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= x.min() and x.max() == 1.0
    assert set(y.tolist()) == set(range(10)) == set(test.tensors[1].tolist())
    # disjoint: no test image appears in train (the digits have no exact duplicates across splits
    # under this seed; compare rows)
    again, _ = data.load_digits(test_fraction=0.25, seed=0)
    assert torch.equal(again.tensors[0], x)
    other, _ = data.load_digits(test_fraction=0.25, seed=1)
    assert not torch.equal(other.tensors[1], y)
    img, _ = data.load_digits(image=True)
    assert img.tensors[0].shape == (1347, 1, 8, 8)
    with pytest.raises(ValueError, match="test_fraction"):
        data.load_digits(test_fraction=1.5)


def _write_idx(path, array, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic))
        for d in array.shape:
            f.write(struct.pack(">I", d))
        f.write(array.numpy().astype("uint8").tobytes())


def _mnist_fixture(root, folder="MNIST", n=12):
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for split in ("train", "t10k"):
        imgs = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.arange(n, dtype=torch.uint8) % 10
        _write_idx(raw / f"{split}-images-idx3-ubyte", imgs, 0x00000803)
        _write_idx(raw / f"{split}-labels-idx1-ubyte", labels, 0x00000801)
    return imgs


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("FashionMNIST", "FashionMNIST")])
def test_torchvision_path_reads_a_local_fixture(tmp_path, name, folder):
    pytest.importorskip("torchvision")
    imgs = _mnist_fixture(tmp_path, folder)
    train, test = data.load(name, root=tmp_path)
    assert len(train) == len(test) == 12
    x, y = test[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y == 3
    assert torch.allclose(x[0], imgs[3].float() / 255)
    sub, _ = data.load_torchvision(name, tmp_path, limit=5)
    assert len(sub) == 5
    # the same code path trains a model: one batch through the CNN
    batch = torch.stack([train[i][0] for i in range(4)])
    assert SmallCNN(in_channels=1)(batch).shape == (4, 10)


def test_missing_folder_is_a_clear_error_not_a_download(tmp_path):
    pytest.importorskip("torchvision")
    with pytest.raises(data.DatasetUnavailable, match="load_digits"):
        data.load_torchvision("mnist", tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="unknown dataset"):
        data.load("imagenet", root=tmp_path)


def test_models_shapes():
    assert MLP(hidden=(32, 16), batchnorm=True)(torch.randn(5, 64)).shape == (5, 10)
    assert SmallCNN(in_channels=3)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_digits_equal_scikit_learns_loader():
    from sklearn.datasets import load_digits as sk

    bunch = sk()
    x, y = data._digits_arrays()
    assert torch.equal(x * 16, torch.tensor(bunch.data, dtype=torch.float32))
    assert torch.equal(y, torch.tensor(bunch.target))
