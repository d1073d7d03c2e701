"""PowerSGD from scratch against torch's powerSGD_hook on torch DDP: same parameters, fewer bytes."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tph

import minidist
from minidist.comm import p2p
from minidist.data_parallel import BucketedDDP, PowerSGD, assert_replicas_identical, orthogonalize_
from minidist.data_parallel.compression import ring_allreduce_bytes
from minidist.models import MLP
from minidist_course.references.data_parallel import max_abs_diff, torch_ddp

STEPS, START = 5, 2
CONFIGS = [  # (rank, error_feedback, warm_start, min_compression_rate, epsilon)
    (1, True, True, 2.0, 0.0),
    (2, True, False, 2.0, 1e-8),
    (2, False, True, 2.0, 0.0),
    (32, True, True, 0.0, 0.0),   # full rank (12 and 5 here; torch then uses QR): exactly DDP
]


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    # regression: a cross-entropy output gradient has rank <= 4 of 5 (rows sum to zero), and
    # orthogonalising a rank-deficient P at full rank divides by ~0 in torch and here alike
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _mlp():
    return MLP(12, (32,), 5)


def _repeated_shapes():
    """Weights 6x12, 6x6, 8x6, 6x8, 6x6, 5x6: two 6x6 apart (torch draws the random Qs per shape
    group in first-seen order, not in bucket order; so must we)."""
    dims = [12, 6, 6, 8, 6, 6, 5]
    layers: list = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _run(rank, world):
    out = {}
    for cfg in CONFIGS + [("shapes", 1, True, False, 1.0, 0.0)]:
        make = _repeated_shapes if cfg[0] == "shapes" else _mlp
        r, ef, warm, rate, eps = cfg[-5:]
        torch.manual_seed(0)
        ref_model, our_model, ddp_model = make(), make(), make()
        our_model.load_state_dict(ref_model.state_dict())
        ddp_model.load_state_dict(ref_model.state_dict())
        ref = torch_ddp(ref_model)
        ref.register_comm_hook(tph.PowerSGDState(
            None, matrix_approximation_rank=r, start_powerSGD_iter=START,
            min_compression_rate=rate, use_error_feedback=ef, warm_start=warm,
            orthogonalization_epsilon=eps, random_seed=0), tph.powerSGD_hook)
        ours, plain = BucketedDDP(our_model), BucketedDDP(ddp_model)
        state = PowerSGD(rank=r, start_iter=START, min_compression_rate=rate, error_feedback=ef,
                         warm_start=warm, epsilon=eps, seed=0)
        ours.register_comm_hook(state, PowerSGD.hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_model, our_model, ddp_model)]
        errs, dist_to_ddp, sent, sent_plain = [], [], [], []
        for step in range(STEPS):
            x, y = _data(rank, step)
            for m, opt in zip((ref, ours, plain), opts):
                opt.zero_grad()
                with p2p.count_traffic() as t:
                    F.mse_loss(m(x), y).backward()
                if m is ours:
                    sent.append(t.bytes_sent)
                    g_ours = [p.grad.clone() for p in our_model.parameters()]
                elif m is plain:
                    sent_plain.append(t.bytes_sent)
                else:
                    g_ref = [p.grad.clone() for p in ref_model.parameters()]
                opt.step()
            errs.append((max_abs_diff(g_ours, g_ref),
                         max_abs_diff(list(our_model.parameters()), list(ref_model.parameters()))))
            dist_to_ddp.append(max_abs_diff(list(our_model.parameters()),
                                            list(ddp_model.parameters())))
        assert_replicas_identical(ours)
        out[cfg] = dict(errs=errs, to_ddp=dist_to_ddp, sent=sent, plain=sent_plain,
                        formula=state.bytes_per_step(ours.buckets[0], world),
                        numel=state.numel_per_step(ours.buckets[0]), residual=state.residual())
        ours.close()
        plain.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_matches_torch_hook_and_sends_fewer_bytes(world):
    results = minidist.run(_run, world, timeout=100)
    n_params = sum(p.numel() for p in MLP(12, (32,), 5).parameters())
    for res in results:  # the repeated-shapes model, fresh random Qs every step (no warm start)
        for ge, pe in res[("shapes", 1, True, False, 1.0, 0.0)]["errs"]:
            assert ge <= 1e-5 and pe <= 1e-5, (world, ge, pe)
    total = lambda cfg, key: [sum(res[cfg][key][s] for res in results) for s in range(STEPS)]
    for cfg in CONFIGS:
        r, ef, rate = cfg[0], cfg[1], cfg[3]
        for res in results:
            d = res[cfg]
            for step, (ge, pe) in enumerate(d["errs"]):
                assert ge <= 1e-5 and pe <= 1e-5, (world, cfg, step, ge, pe)
            if rate == 0.0:  # full rank: no saving, but exactly DDP (the power step is exact)
                assert max(d["to_ddp"]) <= 1e-5, d["to_ddp"]
            elif r == 1:
                assert max(d["to_ddp"][START:]) > 1e-4  # rank 1 really is lossy here
            if ef and rate == 2.0:
                assert d["residual"] > 0
        # bytes, summed over ranks (a ring's chunks are uneven when W does not divide the size:
        # ranks differ, the sum is exactly W times the per-rank formula): steps before START are
        # plain DDP, later ones the compressed formula
        d, ours, plain = results[0][cfg], total(cfg, "sent"), total(cfg, "plain")
        assert ours[:START] == plain[:START]
        assert plain == [round(world * ring_allreduce_bytes(n_params, world))] * STEPS
        assert ours[START:] == [round(world * d["formula"])] * (STEPS - START), (ours, d["formula"])
        if rate == 2.0:  # compressed: r(n+m) per matrix instead of n*m, biases as they are
            assert d["numel"] == min(r, 12) * (32 + 12) + min(r, 5) * (5 + 32) + 32 + 5
            assert ours[-1] < plain[-1]
        print(f"W={world} {cfg}: max |ours - torch| grad {max(e[0] for e in d['errs']):.1e} "
              f"param {max(e[1] for e in d['errs']):.1e}; bytes/step (all ranks) {ours[-1]} vs "
              f"DDP {plain[-1]}")

def test_orthogonalize_and_bad_arguments():
    m = torch.randn(7, 3, dtype=torch.float64)
    q = orthogonalize_(m.clone())
    assert torch.allclose(q.t() @ q, torch.eye(3, dtype=torch.float64), atol=1e-12)
    ref, _ = torch.linalg.qr(m)
    assert torch.allclose(q @ q.t(), ref @ ref.t(), atol=1e-12)  # same span as QR
    z = torch.zeros(4, 2)
    assert torch.isfinite(orthogonalize_(z, epsilon=1e-8)).all()
    with pytest.raises(ValueError, match="n x r"):
        orthogonalize_(torch.zeros(2, 3))
    for kw, msg in [(dict(rank=0), "rank"), (dict(start_iter=-1), "start_iter"),
                    (dict(min_compression_rate=-1.0), "min_compression_rate")]:
        with pytest.raises(ValueError, match=msg):
            PowerSGD(**kw)
