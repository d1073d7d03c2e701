"""Clear errors, never hangs: mismatched replicas, unused parameters, no_sync misuse."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it: 5-10 s each)
import torch.nn.functional as F
from torch import nn

import minidist
from minidist.data_parallel import VERSIONS, assert_replicas_identical
from minidist.models import MLP

ALL = ["naive", "flat", "bucketed"]


def _full(e) -> str:
    """The whole error text of every failed rank (RankError's own message is shortened)."""
    return "\n".join(f"{summary}\n{details}" for _, summary, details in e.value.failures)


def _wrap(version, module, **kw):
    if version == "bucketed":
        kw.setdefault("bucket_cap_mb", 0.0005)
    return VERSIONS[version](module, **kw)


def _different_shapes(rank, world, version):
    _wrap(version, MLP(12, (16 + rank,), 5))


@pytest.mark.parametrize("version", ALL)
def test_different_shapes_fail_at_construction_naming_ranks(version):
    with pytest.raises(minidist.RankError) as e:
        minidist.run(_different_shapes, 2, version, timeout=30)
    msg = _full(e)
    assert "ReplicaMismatchError" in msg and "ranks hold different models" in msg
    assert "rank 0: 4 parameters, 293 elements" in msg
    assert "rank 1: 4 parameters, 311 elements" in msg
    assert "net.0.weight [16, 12]" in msg and "net.0.weight [17, 12]" in msg


def _frozen_on_one_rank(rank, world):
    m = MLP(12, (16,), 5)
    if rank == 2:
        m.net[0].bias.requires_grad_(False)
    _wrap("bucketed", m)


def test_frozen_parameter_on_one_rank_is_named():
    with pytest.raises(minidist.RankError) as e:
        minidist.run(_frozen_on_one_rank, 3, timeout=30)
    assert "rank 0 vs rank 2: param net.0.bias [16] torch.float32  vs  param net.0.bias [16] " \
        "torch.float32 frozen" in _full(e)


def _different_values_are_broadcast(rank, world, version):
    torch.manual_seed(rank)
    m = MLP(12, (16,), 5)
    ddp = _wrap(version, m)
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        F.cross_entropy(ddp(x), torch.arange(4) % 5).backward()
        ddp.sync_gradients()
        opt.step()
    assert_replicas_identical(ddp)  # different data per rank, identical parameters
    return before


@pytest.mark.parametrize("version", ALL)
def test_rank0_values_broadcast_and_replicas_stay_identical(version):
    res = minidist.run(_different_values_are_broadcast, 3, version, timeout=30)
    for r in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(res[0], res[r]))


def _replica_check_catches_a_drift(rank, world):
    m = MLP(12, (16,), 5)
    ddp = _wrap("naive", m)
    if rank == 1:
        with torch.no_grad():
            m.net[0].weight[0, 0] += 0.25
    assert_replicas_identical(ddp)


def test_replica_check_fails_when_replicas_drift():
    with pytest.raises(minidist.RankError, match=r"replicas differ from rank 0 by up to 0.25"):
        minidist.run(_replica_check_catches_a_drift, 2, timeout=30)


class TwoHeads(nn.Module):
    """Head a on even steps, head b on odd steps (a parameter unused in some steps)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 6)
        self.head_a = nn.Linear(6, 3)
        self.head_b = nn.Linear(6, 3)

    def forward(self, x, use_b):
        return (self.head_b if use_b else self.head_a)(torch.relu(self.body(x)))


def _alternating_heads(rank, world, version):
    ddp = _wrap(version, TwoHeads())
    for step in range(2):
        ddp(torch.ones(2, 6), use_b=step % 2 == 1).sum().backward()
        ddp.sync_gradients()


@pytest.mark.parametrize("version", ALL)
def test_unused_parameters_are_named(version):
    with pytest.raises(minidist.RankError) as e:
        minidist.run(_alternating_heads, 2, version, timeout=30)
    msg = _full(e)
    assert "UnusedParametersError" in msg and "2 parameter(s) received no gradient" in msg
    assert "head_b.weight" in msg and "head_b.bias" in msg and "head_a" not in msg.split("gradient")[1].split(".")[0]
    assert "find_unused_parameters=True" in msg


def _unused_on_rank_1_then_go_on(rank, world, version):
    # what a user loop that catches the error sees: every rank raises the same error (a rank that
    # raised alone left the others in the gradient collective it skipped: a hang, or gloo's
    # "Connection closed by peer"), and the ranks still agree on the next collective
    ddp = _wrap(version, TwoHeads())
    try:
        ddp(torch.ones(2, 6), use_b=rank == 1).sum().backward()
        ddp.sync_gradients()
        msg = None
    except minidist.data_parallel.UnusedParametersError as e:
        msg = str(e)
    total = torch.tensor([float(rank)])
    torch.distributed.all_reduce(total)
    return msg, float(total)


@pytest.mark.parametrize("version", ALL)
def test_a_gradient_missing_on_one_rank_is_refused_on_every_rank(version):
    for msg, total in minidist.run(_unused_on_rank_1_then_go_on, 3, version, timeout=60):
        assert msg is not None and "head_b.weight (gradient on rank(s) [1] of 3)" in msg, msg
        assert "head_a.weight (gradient on rank(s) [0, 2] of 3)" in msg, msg
        assert total == 3.0


def _used_on_some_ranks(rank, world, version):
    # rank 0 uses head b, the others head a; head b's grad must be (g + 0 + ...)/W everywhere
    # and a parameter no rank uses keeps grad None. Compared with torch's DDP(find_unused=True).
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
    ours = _wrap(version, TwoHeads(), find_unused_parameters=True)
    ours(x, use_b=rank == 0).pow(2).sum().backward()
    ours.sync_gradients()
    ref = torch.nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    ref(x, use_b=rank == 0).pow(2).sum().backward()
    got = {n: p.grad for n, p in ours.module.named_parameters()}
    want = {n: p.grad for n, p in ref.module.named_parameters()}
    # a second model where head b is unused on every rank
    ours2 = _wrap(version, TwoHeads(), find_unused_parameters=True)
    ours2(x, use_b=False).sum().backward()
    ours2.sync_gradients()
    return got, want, ours2.module.head_b.weight.grad


@pytest.mark.parametrize("version", ALL)
def test_find_unused_parameters_matches_torch(version):
    for got, want, unused_everywhere in minidist.run(_used_on_some_ranks, 3, version, timeout=30):
        assert set(got) == set(want)
        for n in got:
            assert (got[n] is None) == (want[n] is None), n
            if got[n] is not None:
                assert torch.allclose(got[n], want[n], atol=1e-6), n
        assert got["head_b.weight"].abs().sum() > 0
        assert unused_everywhere is None


def _no_sync_changed_between_forward_and_backward(rank, world, version):
    ddp = _wrap(version, MLP(12, (16,), 5))
    with ddp.no_sync():
        loss = ddp(torch.randn(3, 12)).sum()
    loss.backward()
    ddp.sync_gradients()


@pytest.mark.parametrize("version", ALL)
def test_no_sync_change_between_forward_and_backward_is_rejected(version):
    with pytest.raises(minidist.RankError) as e:
        minidist.run(_no_sync_changed_between_forward_and_backward, 2, version, timeout=30)
    msg = _full(e)
    assert "SyncDecisionError" in msg and "forward ran inside no_sync()" in msg
    assert "taken in forward" in msg


def _no_forward_through_wrapper(rank, world):
    m = MLP(12, (16,), 5)
    ddp = _wrap("naive", m)
    m(torch.randn(3, 12)).sum().backward()
    ddp.sync_gradients()


def test_backward_without_forward_through_wrapper_is_rejected():
    with pytest.raises(minidist.RankError, match="call model\\(x\\), not model.module\\(x\\)"):
        minidist.run(_no_forward_through_wrapper, 1, timeout=30)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        VERSIONS["naive"](MLP())
