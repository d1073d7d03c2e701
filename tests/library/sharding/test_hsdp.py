"""HSDP (``fully_shard`` over a 2-D mesh) and replicated units (``replicate``) against one process
on the global batch and against torch's own FSDP2 HSDP, on gloo.

Tolerance ``REL`` = 1e-6, relative to each tensor's largest magnitude, fp32: the same sums in
another order (minidist's ring vs one process vs torch's reductions). Models
(tests/_hsdp_cases.py): ``TiedLM`` (tied weights, a frozen parameter, a buffer, no size divisible
by the shard size) and ``NormNet`` (LayerNorms replicated, linears and embedding sharded, a
parameter only one rank uses in a sharded and in a replicated unit).

One launch of 4 ranks runs the default tier's checks (and one of 2 ranks the edge meshes); the
sweep over more meshes and world sizes is in the integration tier.

Field reports turned into checks (each named where it is checked):

* pytorch/pytorch#155903 — FSDP2's gradient divide factor behaved differently under HSDP than
  under FSDP: the gradients must be one process's, neither summed over the replicas nor averaged
  twice (a unit that sums across replicas is run on purpose and must be caught);
* pytorch/pytorch#125484 — with accumulation, the micro-batches' gradients must be summed before
  the all-reduce across replicas, or earlier micro-batches never cross;
* VeOmni#184 / VeOmni#862, mindspore hyper-parallel#279, pytorch/pytorch#88955 — the global
  gradient norm under HSDP summed over every rank (each piece counted R times), and replicated
  (unsharded) gradients counted once per rank of the shard group;
* pytorch/pytorch#140183 — HSDP replicas never synced at initialisation train apart: here every
  rank starts from a different seed and must end on one process's numbers;
* pytorch/pytorch#158719 / pytorch/pytorch#98281 — a parameter used on some ranks only, and
  parameters left out of the sharded units (FSDP1's ignored modules), must still be averaged.
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  (forked ranks build optimizers, which import it)

import minidist
from _hsdp_cases import (STEPS, adamw, bad_inputs, make_norm_net, norm_batch, reduction_bytes,
                         rel, shard_norm_net, state, tied_batch, tied_batch24, tied_batch48,
                         torch_hsdp, traffic_of_a_step, train)
from minidist.sharding import fsdp, fsdp_state, fsdp_unit, hsdp_mesh
from minidist_course.references.sharding import Block, make_model

REL = 1e-6
TORCH_REL = 1e-6     # minidist's HSDP against torch's FSDP2 HSDP


def _single(make, batch, steps=STEPS, clip=None, accumulate=1):
    model = make()
    grads, norms = train(model, adamw(model), batch, 0, 1, steps, clip=clip, accumulate=accumulate)
    return grads, norms, state(model)


# ------------------------------------------------------------------ what each rank runs
def _hsdp_tied(rank, world, mesh, seed=None, batch=tied_batch, wrap=None, **kw):
    model = fsdp.fully_shard(make_model(seed=rank if seed is None else seed), auto_wrap=(Block,),
                             mesh=mesh, **(wrap or {}))
    grads, norms = train(model, adamw(model), batch, rank, world, STEPS, **kw)
    return grads, norms, state(model)


class _SumsReplicas(fsdp_unit.ShardUnit):
    """Broken on purpose: sums the pieces across replicas instead of averaging (the scaling bug
    kind of pytorch/pytorch#155903)."""

    def _reduce(self, comm, out, grad, got, agreed):
        super()._reduce(comm, out, grad, got, agreed)
        if self.rep is not None:
            self.ctx.rep_thread.all_reduce(out, "sum")   # on top of the average: R x too big


def _w4(rank, world):
    mesh = hsdp_mesh(2, 2)
    out = {"mesh": (dist_ranks(mesh.replicate), dist_ranks(mesh.shard))}
    out["hsdp"] = _hsdp_tied(rank, world, mesh)                   # every rank another seed
    out["torch"] = torch_hsdp(rank, world)
    out["accumulate"] = _hsdp_tied(rank, world, mesh, seed=0, batch=tied_batch24, accumulate=2)
    out["deferred"] = _hsdp_tied(rank, world, mesh, seed=0, batch=tied_batch24, accumulate=2,
                                 defer=True)
    out["clip"] = _hsdp_tied(rank, world, mesh, seed=0, clip=(0.05, 2.0))
    out["clip inf"] = _hsdp_tied(rank, world, mesh, seed=0, clip=(1e3, float("inf")))
    for name, where in (("norms fsdp", {}), ("norms hsdp", {"mesh": mesh, "algorithm": "ring"})):
        model = shard_norm_net(make_norm_net(seed=rank), **where)
        opt = adamw(model)
        res = train(model, opt, norm_batch, rank, world, STEPS, clip=(0.05, 2.0))
        sd, osd = state(model), fsdp_state.full_optim_state_dict(model, opt)
        train(model, opt, norm_batch, rank, world, 1, start=STEPS)
        again = shard_norm_net(make_norm_net(seed=7), **where)    # reload, take the same step
        opt2 = adamw(again)
        fsdp_state.load_full_state_dict(again, sd)
        fsdp_state.load_full_optim_state_dict(again, opt2, osd)
        train(again, opt2, norm_batch, rank, world, 1, start=STEPS)
        out[name] = res + (sd, state(model), state(again))
        out[name + " rank0_only"] = sorted(fsdp_state.full_state_dict(model, rank0_only=True))
    out["no sync"] = reduction_bytes(model, rank, world)       # the HSDP NormNet
    fsdp.ShardUnit = _SumsReplicas                               # this rank's copy only
    out["sums replicas"] = _hsdp_tied(rank, world, mesh, seed=0)
    fsdp.ShardUnit = fsdp_unit.ShardUnit
    out["traffic fsdp"] = traffic_of_a_step(rank, world, None)
    out["traffic hsdp"] = traffic_of_a_step(rank, world, mesh)
    out["errors"] = bad_inputs(rank, world, mesh)
    return out


def dist_ranks(group):
    import torch.distributed as dist
    return dist.get_process_group_ranks(group)


@pytest.fixture(scope="module")
def w4():
    return minidist.run(_w4, 4, timeout=240)


# ------------------------------------------------------------------ the checks
def test_the_mesh_is_torchs_rank_order(w4):
    assert [r["mesh"] for r in w4] == [([0, 2], [0, 1]), ([1, 3], [0, 1]),
                                       ([0, 2], [2, 3]), ([1, 3], [2, 3])]


def test_hsdp_2x2_equals_one_process_from_different_seeds(w4):
    """Gradients of step 1 and parameters after 2 AdamW steps; every rank built its model from
    another seed (pytorch/pytorch#140183: replicas must be synced at wrap), and each got another
    quarter of the batch (pytorch/pytorch#155903: one process's scale, not R or 1/R times)."""
    grads, _, sd = _single(make_model, tied_batch)
    for r, res in enumerate(w4):
        ours_g, _, ours_sd = res["hsdp"]
        assert rel(ours_g, grads) <= REL, (r, rel(ours_g, grads))
        assert rel(ours_sd, sd) <= REL, (r, rel(ours_sd, sd))
        assert rel(ours_sd, w4[0]["hsdp"][2]) == 0.0, f"rank {r} diverged from rank 0"
    moved = rel(sd, _single(make_model, tied_batch, steps=0)[2])
    assert moved > 1e-3


def test_hsdp_equals_torch_fsdp2_hsdp(w4):
    for r, res in enumerate(w4):
        t_grads, t_sd = res["torch"]
        ours_g, _, ours_sd = res["hsdp"]
        assert rel(ours_g, t_grads) <= TORCH_REL, (r, rel(ours_g, t_grads))
        assert rel(ours_sd, t_sd) <= TORCH_REL, (r, rel(ours_sd, t_sd))


def test_summing_across_replicas_is_caught(w4):
    grads, _, _ = _single(make_model, tied_batch)
    assert rel(w4[0]["sums replicas"][0], grads) > 0.5        # 2x: caught, as R is 2


def test_accumulation_skips_both_reductions_and_sums_before_crossing(w4):
    """2 micro-batches, the first with set_requires_gradient_sync(False) (no reduction), or with
    set_requires_all_reduce(False) (reduce-scattered, kept, not crossed): equal to one process
    (pytorch/pytorch#125484: the kept pieces must be added before the all-reduce, or the first
    micro-batch never crosses the replicas)."""
    grads, _, sd = _single(make_model, tied_batch24, accumulate=2)
    for res in w4:
        for how in ("accumulate", "deferred"):
            assert rel(res[how][0], grads) <= REL, how
            assert rel(res[how][2], sd) <= REL, how


def test_what_each_backward_sends_with_sync_off_deferred_and_on(w4):
    """HSDP NormNet (2 x 2, ring): every byte of the gradient reductions accounted for. Without
    sync nothing; deferring the all-reduce, the reduce-scatters and the shard group's flags (one
    float per parameter) only; synced, also the pieces and flags across the replicate group and
    the replicated units' all-reduces (gradients and flags, over the shard group then the
    replicate group). A ring over 2 ranks sends N elements for an N-element all-reduce."""
    for res in w4:
        b = res["no sync"]
        units, reps = b["units"], b["replicated"]
        flags = sum(4 * n for _, n in units)
        rs = sum(4 * s for s, _ in units)
        assert b["no sync"] == {"reduce_scatter": 0, "all_reduce": 0}
        assert b["deferred"] == {"reduce_scatter": rs, "all_reduce": flags}
        whole = sum(2 * 4 * (numel + n) for numel, n in reps)
        assert b["sync"] == {"reduce_scatter": rs, "all_reduce": 2 * flags + rs + whole}


@pytest.mark.parametrize("key,clip", [("clip", (0.05, 2.0)), ("clip inf", (1e3, float("inf")))])
def test_clip_grad_norm_under_hsdp_counts_each_piece_once(w4, key, clip):
    """The norm equals torch.nn.utils.clip_grad_norm_'s on one process (not sqrt(R) times it:
    VeOmni#184); with a binding max_norm the parameters follow one process's."""
    _, norms, sd = _single(make_model, tied_batch, clip=clip)
    for res in w4:
        _, ours, ours_sd = res[key]
        assert ours == pytest.approx(norms, rel=REL)
        assert rel(ours_sd, sd) <= REL
    assert norms[0] > clip[0] or clip[1] == float("inf")       # 2-norm: the clip binds


@pytest.mark.parametrize("name", ["norms fsdp", "norms hsdp"])
def test_sharded_linears_replicated_norms_equal_one_process(w4, name):
    """CS336 a2's FSDP: LayerNorms replicated, linears sharded — over the world (FSDP) and over
    the 2 x 2 mesh; the norm counts replicated gradients once (mindspore hyper-parallel#279,
    pytorch/pytorch#88955); ``bonus`` is used by rank 3 only, in a sharded and in a replicated
    unit (pytorch/pytorch#158719); the full state dict and optimizer state dict reload into a
    model built from another seed and take the same next step; ``rank0_only`` gives it to
    global rank 0 alone (not to rank 0 of each shard group)."""
    grads, norms, sd = _single(make_norm_net, norm_batch, clip=(0.05, 2.0))
    assert {"gate_s.bonus", "gate_r.bonus"} <= set(grads)
    for r, res in enumerate(w4):
        ours_g, ours_norms, ours_sd, after, reloaded = res[name]
        assert rel(ours_g, grads) <= REL, (r, rel(ours_g, grads))
        assert ours_norms == pytest.approx(norms, rel=REL)
        assert rel(ours_sd, sd) <= REL, (r, rel(ours_sd, sd))
        assert rel(reloaded, after) == 0.0, (r, "reload")
        assert res[name + " rank0_only"] == (sorted(after) if r == 0 else [])
    assert norms[0] > 0.05


def test_replicate_group_bytes_are_one_shard_of_the_gradient(w4):
    """Per step, ring algorithms, R = S = 2: across the replicate group a rank sends its [S_u]
    piece of each unit once (a ring all-reduce over 2 ranks sends N elements), 1/S of the
    gradient; FSDP over all 4 ranks reduce-scatters (W-1)/W of it. Flags (one float per
    parameter, the "used on any rank" all-reduces over both groups) are counted apart."""
    for res in w4:
        f, h = res["traffic fsdp"], res["traffic hsdp"]
        assert f["sent"].get("reduce_scatter/ring") == sum(3 * s * 4 for s in f["shard"])
        assert h["sent"].get("reduce_scatter/ring") == sum(s * 4 for s in h["shard"])
        flags = sum(2 * n * 4 for n in h["params"])
        across = h["sent"]["all_reduce/ring"] - flags
        assert across == sum(s * 4 for s in h["shard"]) == sum(p * 4 for p in h["padded"]) // 2


def test_bad_input_is_a_clear_error_on_every_rank(w4):
    for r, res in enumerate(w4):
        e = res["errors"]
        assert f"rank {r}" in e["product"] and "replicate=3 x shard=2" in e["product"] \
            and "world size 4" in e["product"]
        assert f"fully_shard (rank {r})" in e["overlap"] and "replicate_group" in e["overlap"] \
            and "overlaps the shard group" in e["overlap"] and "expected" in e["overlap"]
        assert f"fully_shard (rank {r})" in e["crossed"] and "(shard rank, shard group size)" \
            in e["crossed"] and "expected the same piece" in e["crossed"]
        assert "per_parameter=True" in e["flat"]
        assert "every unit under one root shares its replicate group" in e["mixed"]
        assert "already belongs to unit" in e["late replicate"]
        assert "are HSDP" in e["dcp"] and "full_state_dict" in e["dcp"]


# ------------------------------------------------------------------ edge meshes at W = 2
def _w2(rank, world):
    return {f"{r}x{s}": _hsdp_tied(rank, world, hsdp_mesh(r, s)) for r, s in ((1, 2), (2, 1))}


def test_edge_meshes_1x2_and_2x1_equal_one_process():
    """1 x 2 is FSDP (the replicate group of one rank is dropped); 2 x 1 is DDP (each rank's
    "shard" is the whole model)."""
    grads, _, sd = _single(make_model, tied_batch)
    for res in minidist.run(_w2, 2, timeout=120):
        for mesh in ("1x2", "2x1"):
            assert rel(res[mesh][0], grads) <= REL, mesh
            assert rel(res[mesh][2], sd) <= REL, mesh


# ------------------------------------------------------------------ the sweep (integration tier)
SWEEP = {4: [(1, 4), (4, 1), (2, 2)], 6: [(2, 3), (3, 2)], 8: [(2, 4), (4, 2)]}


def _sweep(rank, world):
    out = {}
    for R, S in SWEEP[world]:
        mesh = hsdp_mesh(R, S)
        for how in ("hand-built", "torch"):
            out[(R, S, how)] = _hsdp_tied(rank, world, mesh, seed=0, batch=tied_batch48,
                                          wrap={"collectives": how}, accumulate=2,
                                          clip=(0.05, 2.0))
        bf16 = {"mp_policy": fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
        out[(R, S, "bf16")] = _hsdp_tied(rank, world, mesh, seed=0, batch=tied_batch48, wrap=bf16)
        out[(R, S, "torch fsdp2")] = torch_hsdp(rank, world, R, S, batch=tied_batch48)
        out[(R, S, "torch fsdp2 bf16")] = torch_hsdp(rank, world, R, S, True, tied_batch48)
    return out


@pytest.mark.exhaustive      # 7 meshes at W = 4, 6, 8, each with both collectives, bf16 and torch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(SWEEP))
def test_every_mesh_equals_one_process_and_torch(world):
    grads, norms, sd = _single(make_model, tied_batch48, accumulate=2, clip=(0.05, 2.0))
    plain_g, _, plain_sd = _single(make_model, tied_batch48)
    for r, res in enumerate(minidist.run(_sweep, world, timeout=500)):
        for R, S in SWEEP[world]:
            for how in ("hand-built", "torch"):
                g, n, st = res[(R, S, how)]
                assert rel(g, grads) <= REL and rel(st, sd) <= REL, (r, R, S, how)
                assert n == pytest.approx(norms, rel=REL), (r, R, S, how)
            t_g, t_sd = res[(R, S, "torch fsdp2")]
            assert rel(t_g, plain_g) <= REL and rel(t_sd, plain_sd) <= REL, (r, R, S, "torch")
            b_g, _, b_sd = res[(R, S, "bf16")]
            tb_g, tb_sd = res[(R, S, "torch fsdp2 bf16")]
            assert rel(b_g, tb_g) <= REL and rel(b_sd, tb_sd) <= REL, (r, R, S, "bf16")
