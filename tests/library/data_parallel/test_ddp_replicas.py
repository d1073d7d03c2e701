"""broadcast_module packs every tensor's bytes into one message: rank 0's values arrive exactly,
whatever the dtypes, shapes (0-dim, empty, non-contiguous) and world size."""

import pytest
import torch
from torch import nn

import minidist
from minidist.data_parallel import broadcast_module

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.uint8, torch.bool, torch.complex64]


class Mixed(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(2, 3, generator=g))
            self.lin.bias.copy_(torch.randn(2, generator=g))
        for i, dt in enumerate(DTYPES):
            values = torch.randn(5, generator=g) * 100
            self.register_buffer(f"b{i}", (values > 0) if dt == torch.bool else values.to(dt))
        self.register_buffer("scalar", torch.tensor(float(seed)))           # 0-dim
        self.register_buffer("empty", torch.empty(0, 4))
        self.register_buffer("transposed", torch.randn(3, 4, generator=g).t())  # non-contiguous


def _broadcast(rank, world, collectives, buffers_only):
    m = Mixed(seed=rank)
    broadcast_module(m, collectives, buffers_only=buffers_only)
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("collectives", ["hand-built", "torch"])
def test_every_dtype_arrives_exactly(world, collectives):
    ref = Mixed(seed=0).state_dict()
    for buffers_only in (True, False):
        for rank, got in enumerate(minidist.run(_broadcast, world, collectives, buffers_only,
                                                timeout=60)):
            own = Mixed(seed=rank).state_dict()
            for k, v in got.items():
                # buffers_only: parameters keep this rank's values
                want = own[k] if buffers_only and k.startswith("lin.") else ref[k]
                assert v.dtype == want.dtype and v.shape == want.shape, k
                assert torch.equal(v, want), (rank, k)
