"""DiLoCo and local SGD from scratch against one process simulating the same W workers in turn."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)
import torch.nn.functional as F

import minidist
from minidist.comm import p2p
from minidist.data_parallel import BucketedDDP, DiLoCo
from minidist.data_parallel.compression import ring_allreduce_bytes
from minidist.models import MLP

H, ROUNDS = 3, 3
CONFIGS = {"diloco": dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True),
           "local_sgd": dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False)}


def _data(worker, step):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _inner(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _run(rank, world):
    out = {}
    for name, kw in CONFIGS.items():
        torch.manual_seed(0)
        model = MLP(12, (32,), 5)
        opt, dl = _inner(model), DiLoCo(model, sync_every=H, **kw)
        sent, synced = [], []
        for step in range(H * ROUNDS):
            x, y = _data(rank, step)
            with p2p.count_traffic() as t:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
                synced.append(dl.step())
            sent.append(t.bytes_sent)
        out[name] = dict(params=[p.detach().clone() for p in model.parameters()], sent=sent,
                         synced=synced, per_step=dl.bytes_per_step(), numel=dl.numel())
    # H = 1, outer lr 1, no momentum, inner SGD: every step is a DDP step
    torch.manual_seed(0)
    a, b = MLP(12, (32,), 5), MLP(12, (32,), 5)
    b.load_state_dict(a.state_dict())
    ddp, dl = BucketedDDP(b), DiLoCo(a, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    for step in range(3):
        x, y = _data(rank, step)
        for m, opt in zip((a, ddp), opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
        dl.step()
    out["ddp_diff"] = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    ddp.close()
    return out


def _simulate(world, outer_lr, outer_momentum, nesterov):
    """One process, the W workers one after another; the outer Nesterov SGD written out."""
    torch.manual_seed(0)
    theta = [p.detach().clone() for p in MLP(12, (32,), 5).parameters()]
    workers = [MLP(12, (32,), 5) for _ in range(world)]
    opts = [_inner(m) for m in workers]
    v = [torch.zeros_like(t) for t in theta]
    for rnd in range(ROUNDS):
        deltas = []
        for w, (m, opt) in enumerate(zip(workers, opts)):
            with torch.no_grad():
                for p, t in zip(m.parameters(), theta):
                    p.copy_(t)
            for h in range(H):
                x, y = _data(w, rnd * H + h)
                opt.zero_grad()
                F.mse_loss(m(x), y).backward()
                opt.step()
            deltas.append([t - p.detach() for t, p in zip(theta, m.parameters())])
        for i, t in enumerate(theta):
            d = sum(dw[i] for dw in deltas) / world
            if outer_momentum:
                v[i] = outer_momentum * v[i] + d
                step = d + outer_momentum * v[i] if nesterov else v[i]
            else:
                step = d
            theta[i] = t - outer_lr * step
    return theta


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_diloco_matches_sequential_simulation_and_sends_once_per_round(world):
    results = minidist.run(_run, world, timeout=100)
    for name, kw in CONFIGS.items():
        ref = _simulate(world, **kw)
        first = results[0][name]
        for res in results:
            d = res[name]
            err = max((a - b).abs().max().item() for a, b in zip(d["params"], ref))
            # the ring sums in another order than the simulation: fp32 rounding only
            assert err <= 1e-6, (world, name, err)
            assert all(torch.equal(a, b) for a, b in zip(d["params"], first["params"]))
            assert d["synced"] == [(s + 1) % H == 0 for s in range(H * ROUNDS)]
            assert all(b == 0 for b, s in zip(d["sent"], d["synced"]) if not s)  # inner: silent
        # per round, summed over ranks: one ring all-reduce of the model (uneven chunks when W
        # does not divide N make ranks differ; the sum is exact)
        for s in range(H * ROUNDS):
            if first["synced"][s]:
                assert sum(r[name]["sent"][s] for r in results) == round(
                    world * ring_allreduce_bytes(first["numel"], world))
        assert first["per_step"] == ring_allreduce_bytes(first["numel"], world) / H
        print(f"W={world} {name}: max |ours - simulation| {err:.1e}; bytes/step/rank "
              f"{first['per_step']:.0f} vs DDP {ring_allreduce_bytes(first['numel'], world):.0f}")
    for res in results:  # H = 1 local SGD with inner SGD is DDP (averaging params = averaging grads)
        assert res["ddp_diff"] <= 1e-6, res["ddp_diff"]
    print(f"W={world} H=1 local SGD vs BucketedDDP: {max(r['ddp_diff'] for r in results):.1e}")


def test_bad_arguments_name_the_argument():
    def bad(rank, world):
        for kw, msg in [(dict(sync_every=0), "sync_every"), (dict(outer_lr=0.0), "outer_lr")]:
            with pytest.raises(ValueError, match=f"rank {rank}.*{msg}"):
                DiLoCo(MLP(2, (2,), 2), **kw)
    minidist.run(bad, 1, timeout=30)
