"""The two rings of minidist.comm.ring — the base ring (one exchange per step) and the pre-posted
refinement — against torch.distributed.all_reduce.

W = 1..4, sizes 0, 1, 3, 10, 1001 (not divisible by W; fewer elements than ranks; empty). Float32
within 1e-5 relative to the magnitude (the ring adds in a different order than gloo); int64 exact.
The two variants must also agree with each other bit for bit and send the same bytes and messages:
they differ only in when the receives are posted.
"""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.comm import p2p, ring

SIZES = (0, 1, 3, 10, 1001)


def _rank(rank, world):
    rows = []
    for dtype in (torch.float32, torch.int64):
        for n in SIZES:
            g = torch.Generator().manual_seed(100 * rank + n)
            x = (torch.randn(n, generator=g) if dtype.is_floating_point
                 else torch.randint(-50, 50, (n,), generator=g)).to(dtype)
            ref = x.clone()
            if n:
                dist.all_reduce(ref)
            got = {}
            for name, fn in ring.VARIANTS.items():
                y = x.clone()
                with p2p.count_traffic() as t:
                    fn(y, "sum", rank, world)
                got[name] = (y, t.bytes_sent, t.msgs_sent)
            rows.append((dtype, n, ref, got))
    return rows


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_both_rings_equal_torch_all_reduce(world):
    assert set(ring.VARIANTS) == {"simple", "preposted"}
    results = minidist.run(_rank, world, timeout=120)
    for rank, rows in enumerate(results):
        for dtype, n, ref, got in rows:
            scale = max(1.0, ref.abs().max().item()) if n else 1.0
            tol = 1e-5 if dtype.is_floating_point else 0
            for name, (y, _, _) in got.items():
                assert y.dtype == dtype and y.shape == ref.shape, (rank, name, n)
                err = (y.double() - ref.double()).abs().max().item() / scale if n else 0.0
                assert err <= tol, (world, rank, name, dtype, n, err)
            (a, bytes_a, msgs_a), (b, bytes_b, msgs_b) = got["simple"], got["preposted"]
            assert torch.equal(a, b), (world, rank, dtype, n)
            assert (bytes_a, msgs_a) == (bytes_b, msgs_b), (world, rank, dtype, n)
            elem = torch.empty(0, dtype=dtype).element_size()
            # every rank sends all chunks but one in each phase: 2(W-1)/W · N when W divides N
            sizes = [c.numel() for c in torch.empty(n).tensor_split(world)]
            assert bytes_a == elem * (2 * n - sizes[(rank + 1) % world] - sizes[rank]), \
                (world, rank, n, bytes_a)
    # the results are the same on every rank
    for rows in results[1:]:
        for (_, _, _, got), (_, _, _, got0) in zip(rows, results[0]):
            assert torch.equal(got["simple"][0], got0["simple"][0])


def test_library_default_is_the_preposted_ring():
    assert ring.all_reduce is ring.all_reduce_preposted
    assert ring.reduce_scatter_chunks is ring.reduce_scatter_preposted
    assert ring.all_gather_chunks is ring.all_gather_preposted
