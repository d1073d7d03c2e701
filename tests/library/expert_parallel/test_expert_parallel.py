"""The MoE layer and its expert-parallel dispatch against independent references.

* Unit checks (no processes): top-k tie-breaking, Megatron's capacity rounding, the vectorised
  drop rule against a Python loop, permute/un-permute restoring input and gradient bitwise
  (Megatron-LM's dispatcher test), hand-computed permutation tables (torchtitan's CPU test:
  2 ranks x 2 experts, counts [2, 3, 1, 4]).
* One launch per W = 1, 2, 3, 4 runs every (E, k, capacity, policy) configuration: the EP layer's
  outputs, input gradients, router gradients (summed over ranks) and expert gradients (on their
  owner) equal :func:`~minidist_course.references.expert_parallel.dense_moe` on the global batch, with the
  same tokens dropped, within 1e-6 absolute (fp32; only summation order differs). The same launch
  checks the dispatch against gloo's ``dist.all_to_all_single`` with uneven splits, the count
  exchange, the all-to-all bytes against the formula, the aux loss against the one-process value
  (and that dropping it from the loss changes the router gradient), and a rank whose experts get
  no token (zero gradients, no hang), a rank with an empty batch, and W = 3 where E = 2 or 4
  leaves the last rank without experts.
"""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.comm.p2p import LOCAL
from minidist.expert_parallel import MoE
from minidist.expert_parallel.dispatch import (
    all_to_all_rows,
    exchange_counts,
    experts_per_rank,
    local_experts,
)
from minidist.expert_parallel.permute import (
    permutation,
    permute,
    regroup_index,
    split_sizes,
    unpermute,
)
from minidist_course.references.expert_parallel import dense_moe, kept_by_loop
from minidist.expert_parallel.router import expert_capacity, keep_mask, route
from minidist.expert_parallel.stats import a2a_bytes_formula, imbalance
from minidist.models.gpt import GPTConfig

TOL = 1e-6
CFG = GPTConfig(n_embd=8)
B, S = 2, 5           # per rank: 10 tokens (not divisible by most E)
AUX, ZC = 0.05, 0.01
# (E, k, capacity_factor, policy, aux)
CONFIGS = [(2, 1, None, "position", 0.0), (4, 2, None, "position", AUX), (8, 1, None, "position", AUX),
           (4, 1, 1.0, "position", AUX), (4, 2, 1.0, "probs", AUX), (8, 2, 0.5, "position", 0.0),
           (2, 2, 0.75, "probs", AUX), (8, 2, 1.25, "position", AUX)]


# ----------------------------------------------------------------------------- unit, no processes
def test_route_breaks_ties_toward_the_lower_expert_and_checks_k():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [1.0, 0.0, 3.0, 3.0]])
    _, experts, w = route(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 1], [2, 3]]
    assert torch.allclose(w.sum(1), route(logits, 2)[0].gather(1, experts).sum(1))
    assert torch.allclose(route(logits, 2, normalize=True)[2].sum(1), torch.ones(3))
    with pytest.raises(ValueError, match="top_k must be an int in 1..4"):
        route(logits, 5)


@pytest.mark.parametrize("T,E,k,cf,expected", [
    (100, 2, 1, 1.1, 55),    # float (100 / 2) * 1.1 = 55.00000000000001: Megatron's float ceil gives 56
    (10, 1, 1, 1.1, 11),
    (10, 4, 1, 1.0, 3),      # 2.5 rounded up
    (8, 4, 2, 1.0, 4), (10, 4, 2, 1.25, 7), (10, 8, 1, 0.5, 1), (3, 8, 1, 1.0, 1), (0, 4, 1, 1.0, 0)])
def test_capacity_is_megatrons_ceil_rule(T, E, k, cf, expected):
    assert expert_capacity(T, E, k, cf) == expected
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        expert_capacity(T, E, k, 0)


def test_vectorised_drop_rule_equals_the_python_loop():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        T, E, k = 1 + trial % 13, (2, 4, 8)[trial % 3], 1 + trial % 2
        logits = torch.randn(T, E, generator=g).round()     # rounded: many ties in probability
        _, experts, w = route(logits, k)
        for cap in (None, 0, 1, 2, 3):
            for policy in ("position", "probs"):
                want = kept_by_loop(experts, w, cap, policy)
                assert keep_mask(experts, w, E, cap, policy).tolist() == want, (trial, cap, policy)
    with pytest.raises(ValueError, match="drop policy must be one of"):
        keep_mask(experts, w, E, 1, "random")


def test_permute_then_unpermute_restores_input_and_gradient_bitwise():
    g = torch.Generator().manual_seed(1)
    for k, weight in ((1, 1.0), (2, 0.5)):
        x = torch.randn(7, 3, generator=g, requires_grad=True)
        experts = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(7)])
        kept = torch.ones(7, k, dtype=torch.bool)
        idx, w, counts = permutation(experts, torch.full((7, k), weight), kept, 4)
        rows = permute(x, idx)
        assert counts.tolist() == torch.bincount(experts.reshape(-1), minlength=4).tolist()
        assert (torch.diff(experts.reshape(-1)[torch.sort(experts.reshape(-1), stable=True).indices])
                >= 0).all()
        back = unpermute(rows, idx, w, 7)
        assert torch.equal(back, x)
        cot = torch.randn(7, 3, generator=g)
        back.backward(cot)
        assert torch.equal(x.grad, cot)


def test_hand_computed_permutation_tables():
    # sender side: 5 tokens, top-1 choices -> rows in expert order, token order inside an expert
    experts = torch.tensor([[1], [0], [1], [3], [0]])
    idx, _, counts = permutation(experts, torch.ones(5, 1), torch.ones(5, 1, dtype=torch.bool), 4)
    assert idx.tolist() == [1, 4, 0, 2, 3] and counts.tolist() == [2, 2, 0, 1]
    # dropped assignments leave no row
    kept = torch.tensor([[True], [True], [False], [True], [False]])
    idx, _, counts = permutation(experts, torch.ones(5, 1), kept, 4)
    assert idx.tolist() == [1, 0, 3] and counts.tolist() == [1, 1, 0, 1]
    # 2 ranks x 2 experts each: counts [2, 3, 1, 4] for experts 0..3 -> 5 rows to each rank
    assert split_sizes(torch.tensor([2, 3, 1, 4]), 2, 2) == [5, 5]
    # receiver side (torchtitan's table): from rank 0, 2 rows for local expert 0 and 3 for expert 1;
    # from rank 1, 1 and 4. Arrival order [r0e0 r0e0 | r0e1 x3 | r1e0 | r1e1 x4] -> expert-major
    assert regroup_index(torch.tensor([[2, 3], [1, 4]])).tolist() == [0, 1, 5, 2, 3, 4, 6, 7, 8, 9]
    assert regroup_index(torch.tensor([[0, 2], [3, 0]])).tolist() == [2, 3, 4, 0, 1]
    assert regroup_index(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []
    # ownership: contiguous blocks, possibly empty
    assert [local_experts(2, 4, r) for r in range(4)] == [[0], [1], [], []]
    assert [local_experts(4, 3, r) for r in range(3)] == [[0, 1], [2, 3], []]
    assert experts_per_rank(8, 4) == 2 and imbalance([4, 4]) == 1.0 and imbalance([8, 0]) == 2.0


def test_the_router_stays_fp32_under_autocast(monkeypatch):
    """Regression (MoE x mixed precision): the router's linear ran in bf16 under ``torch.autocast``
    although the layer promises an fp32 router (Megatron-LM's ``moe_router_dtype``): routing
    decided on rounded logits."""
    from minidist.expert_parallel import layer
    seen = []
    monkeypatch.setattr(layer, "route", lambda logits, *a: seen.append(logits) or route(logits, *a))
    torch.manual_seed(0)
    moe = MoE(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8), 4, 2)
    x = torch.randn(2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert seen[0].dtype == torch.float32
    assert torch.equal(seen[0], x.reshape(8, 8) @ moe.router.weight.T)   # computed in fp32


def test_a_model_can_be_copied_after_its_forward():
    import copy

    from minidist.expert_parallel import MoEGPT
    model = MoEGPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8), 4, 2,
                   aux_loss_coeff=0.01)
    ids = torch.randint(0, 11, (2, 4))
    _, loss = model(ids, ids)
    twin = copy.deepcopy(model)                   # the aux loss's graph is not copied
    assert twin.aux_loss is None and twin.blocks[0].mlp.aux_loss is None
    assert model.aux_loss is not None and torch.equal(twin(ids, ids)[1], model(ids, ids)[1])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_k must be an int in 1..4"):
        MoE(CFG, 4, 0)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(CFG, 4, 1, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="expected x \\[batch, seq, width\\]"):
        MoE(CFG, 4, 1)(torch.randn(3, 8))
    uneven = MoE(CFG, 4, 1, capacity_factor=1.0,
                 drop_groups=lambda b, s: [torch.arange(3), torch.arange(3, b * s)])
    with pytest.raises(ValueError, match="groups of one size, got \\[3, 13\\]"):
        uneven(torch.randn(2, 8, CFG.n_embd))


def test_drop_groups_apply_the_capacity_to_each_group_in_its_order():
    """Groups that are contiguous chunks drop what drop_chunks drops; reversed tokens in each
    group drop others (the rule follows the order a rank holds them)."""
    x = torch.randn(2, 8, CFG.n_embd)
    torch.manual_seed(0)
    chunks = MoE(CFG, 4, 2, capacity_factor=0.5, drop_chunks=2)
    torch.manual_seed(0)
    same = MoE(CFG, 4, 2, capacity_factor=0.5,
               drop_groups=lambda b, s: list(torch.arange(b * s).view(2, -1)))
    torch.manual_seed(0)
    backwards = MoE(CFG, 4, 2, capacity_factor=0.5,
                    drop_groups=lambda b, s: list(torch.arange(b * s).view(2, -1).flip(1)))
    a, b, c = (m(x) for m in (chunks, same, backwards))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert chunks.stats.dropped_fraction > 0


# ------------------------------------------------------------------------------ multi-process
def make_layer(E, k, cf, policy, aux, ep_group=LOCAL, stats_group=LOCAL, drop_chunks=1):
    torch.manual_seed(0)
    return MoE(CFG, E, k, capacity_factor=cf, drop_policy=policy, aux_loss_coeff=aux,
               z_loss_coeff=ZC if aux else 0.0, ep_group=ep_group, stats_group=stats_group,
               drop_chunks=drop_chunks)


def global_batch(world, salt):
    g = torch.Generator().manual_seed(10 + salt)
    return torch.randn(world * B, S, CFG.n_embd, generator=g), torch.randn(world * B, S, CFG.n_embd,
                                                                          generator=g)


def _layer_rank(rank, world, configs):
    wg = dist.group.WORLD
    out = []
    for i, (E, k, cf, policy, aux) in enumerate(configs):
        layer = make_layer(E, k, cf, policy, aux, wg, wg)
        xg, cot = global_batch(world, i)
        x = xg[rank * B:(rank + 1) * B].clone().requires_grad_()
        y = layer(x)
        ((y * cot[rank * B:(rank + 1) * B]).sum() + layer.aux_loss).backward()
        st = layer.stats
        formula = a2a_bytes_formula(st.send_splits, st.recv_splits, rank, E, len(st.expert_ids),
                                    CFG.n_embd, 4)
        out.append(dict(y=y.detach(), xgrad=x.grad, router=layer.router.weight.grad,
                        experts={e: [p.grad for p in m.parameters()]
                                 for e, m in zip(layer.expert_ids, layer.experts)},
                        aux=float(layer.aux_loss.detach()), capacity=st.capacity, bytes=st.a2a_bytes_sent,
                        formula=formula, kept=st.kept, routed=st.routed, received=st.received))
    # the dispatch and the count exchange against gloo's all_to_all_single with uneven splits
    g = torch.Generator().manual_seed(rank)
    for E in (2, 4, 8):
        counts = torch.randint(0, 4, (E,), generator=g)
        if rank == 0:
            counts[:] = 0                                   # a rank that sends nothing
        c = experts_per_rank(E, world)
        owner = [len(local_experts(E, world, j)) for j in range(world)]
        mine = len(local_experts(E, world, rank))
        ref_counts = torch.empty(world * mine, dtype=torch.int64)
        dist.all_to_all_single(ref_counts, counts, [mine] * world, owner)
        recv_counts = exchange_counts(counts, world, rank, wg)
        assert torch.equal(recv_counts.reshape(-1), ref_counts), (rank, E)
        send, recv = split_sizes(counts, c, world), recv_counts.sum(1).tolist()
        rows = torch.randn(sum(send), 3, generator=g)
        ref = torch.empty(sum(recv), 3)
        dist.all_to_all_single(ref, rows, recv, send)
        got = all_to_all_rows(rows, send, recv, wg)
        assert torch.equal(got, ref), (rank, E)
    # a layer whose router sends every token to expert 0: the other experts get no token
    layer = make_layer(4, 1, None, "position", 0.0, wg, wg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(B, S, CFG.n_embd) + 0.1                  # positive: expert 0 wins everywhere
    layer(x).sum().backward()
    zero = {e: [p.grad for p in m.parameters()] for e, m in zip(layer.expert_ids, layer.experts)}
    # a rank with an empty batch still joins every collective; the others are unaffected
    layer = make_layer(4, 2, 1.0, "position", AUX, wg, wg)
    xe = torch.randn(0 if rank == world - 1 else B, S, CFG.n_embd, requires_grad=True)
    ye = layer(xe)
    (ye.sum() + layer.aux_loss).backward()
    assert ye.shape == xe.shape and xe.grad.shape == xe.shape
    # ranks with different token counts apply one capacity: the MAX over the EP group
    layer = make_layer(4, 2, 1.0, "position", 0.0, wg, wg)
    layer(torch.randn(1 + rank, S, CFG.n_embd)).sum().backward()
    assert layer.stats.capacity == expert_capacity(world * S, 4, 2, 1.0), layer.stats.capacity
    return out, zero


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ep_layer_equals_the_dense_one_process_moe(world):
    results = minidist.run(_layer_rank, world, CONFIGS, timeout=200)
    for i, (E, k, cf, policy, aux) in enumerate(CONFIGS):
        per_rank = [r[0][i] for r in results]
        caps = {r["capacity"] for r in per_rank}
        assert len(caps) == 1, caps                          # synced over the EP group
        cap = caps.pop()
        assert cap == (None if cf is None else expert_capacity(B * S, E, k, cf))
        layer = make_layer(E, k, cf, policy, aux)
        xg, cot = global_batch(world, i)
        x = xg.reshape(-1, CFG.n_embd).clone().requires_grad_()
        y, aux_ref, kept = dense_moe(x, layer.router.weight, list(layer.experts), k, cap, world,
                                     policy, aux_loss_coeff=aux, z_loss_coeff=ZC if aux else 0.0)
        # the one-process loss whose gradient the W ranks' losses add up to: W copies of the aux
        ((y * cot.reshape(-1, CFG.n_embd)).sum() + world * aux_ref).backward()
        where = f"W={world} E={E} k={k} cf={cf} {policy} aux={aux}"
        got_y = torch.cat([r["y"] for r in per_rank]).reshape(-1, CFG.n_embd)
        assert (got_y - y).abs().max() <= TOL, where
        got_xg = torch.cat([r["xgrad"] for r in per_rank]).reshape(-1, CFG.n_embd)
        assert (got_xg - x.grad).abs().max() <= TOL, where
        router = sum(r["router"] for r in per_rank)
        assert (router - layer.router.weight.grad).abs().max() <= TOL, where
        owned = {}
        for r in per_rank:
            owned.update(r["experts"])
        assert sorted(owned) == list(range(E)), where        # every expert on exactly one rank
        for e, grads in owned.items():
            for a, b in zip(grads, layer.experts[e].parameters()):
                assert (a - b.grad).abs().max() <= TOL, (where, e)
        # the same tokens were dropped, and the stats add up
        assert sum(int(r["kept"].sum()) for r in per_rank) == int(kept.sum()), where
        assert sum(int(r["received"].sum()) for r in per_rank) == int(kept.sum()), where
        assert sum(int(r["routed"].sum()) for r in per_rank) == world * B * S * k, where
        for rank, r in enumerate(per_rank):
            assert r["bytes"] == r["formula"], (where, rank)
        # the aux loss: the ranks' mean is the one-process value on the global batch
        assert abs(sum(r["aux"] for r in per_rank) / world - float(aux_ref.detach())) <= TOL, where
    # dropping the aux loss from the loss is caught: the router gradient moves by far more than TOL
    E, k, cf, policy, aux = CONFIGS[1]
    layer = make_layer(E, k, cf, policy, 0.0)
    xg, cot = global_batch(world, 1)
    x = xg.reshape(-1, CFG.n_embd)
    y, _, _ = dense_moe(x, layer.router.weight, list(layer.experts), k, None, world, policy)
    (y * cot.reshape(-1, CFG.n_embd)).sum().backward()
    router = sum(r[0][1]["router"] for r in results)
    assert (router - layer.router.weight.grad).abs().max() > 100 * TOL
    # experts that got no token: zero gradients (not None, not stale), and nobody hung
    for _, zero in results:
        for e, grads in zero.items():
            assert all(g is not None for g in grads)
            if e != 0:
                assert all(torch.equal(g, torch.zeros_like(g)) for g in grads), e
            else:
                assert any(g.abs().sum() > 0 for g in grads)


def _local_stats_and_mismatch_rank(rank, world):
    wg = dist.group.WORLD
    layer = make_layer(4, 2, None, "position", AUX, wg, stats_group=LOCAL)   # per-rank statistics
    xg, _ = global_batch(world, 0)
    layer(xg[rank * B:(rank + 1) * B]).sum()
    local_aux = float(layer.aux_loss.detach())
    bad = None
    try:   # the ranks disagree on the number of experts: an error naming the exchange, no hang
        make_layer(4 if rank == 0 else 2, 1, None, "position", 0.0, wg, wg)(
            torch.randn(B, S, CFG.n_embd))
    except Exception as e:  # noqa: BLE001
        bad = f"{type(e).__name__}: {e}"
    # group=None is the world here as everywhere; the default LOCAL is this process alone
    places = [(m.ep_rank, m.ep_size, m.expert_ids)
              for m in (MoE(CFG, 4, 2), MoE(CFG, 4, 2, ep_group=None, stats_group=None))]
    return local_aux, bad, places


@pytest.mark.timeout(90)
def test_per_rank_aux_statistics_match_one_process_per_micro_batch_only():
    world = 2
    results = minidist.run(_local_stats_and_mismatch_rank, world, timeout=80)
    layer = make_layer(4, 2, None, "position", AUX)
    xg, _ = global_batch(world, 0)
    x = xg.reshape(-1, CFG.n_embd)
    per_chunk = [float(dense_moe(x[r * B * S:(r + 1) * B * S], layer.router.weight, list(layer.experts),
                                 2, aux_loss_coeff=AUX, z_loss_coeff=ZC)[1].detach())
                 for r in range(world)]
    global_aux = float(dense_moe(x, layer.router.weight, list(layer.experts), 2, aux_loss_coeff=AUX,
                                 z_loss_coeff=ZC)[1].detach())
    for r, (local_aux, _, _) in enumerate(results):
        assert abs(local_aux - per_chunk[r]) <= TOL          # each rank: its own micro-batch's value
    mean_local = sum(a for a, _, _ in results) / world
    assert abs(mean_local - global_aux) > 10 * TOL           # ... which is not the global batch's
    for r, (_, bad, places) in enumerate(results):
        assert bad is not None and "all_to_all" in bad and "disagree" in bad, bad
        assert places == [(0, 1, [0, 1, 2, 3]), (r, 2, [2 * r, 2 * r + 1])], places
