"""The per-message shortcuts of minidist.comm: each remembers something torch would be asked for
again on every message, and each must give the answer torch would give, also after what could
make a remembered answer stale (a new group, a re-initialised world, a forked rank, a changed
environment variable with the reset that rereads it). The tuner's remembered choices are
tested in ``tests/library/comm/test_tuner.py``."""

import weakref

import pytest
import torch
import torch.distributed as dist

import minidist
import minidist.collectives as C
from minidist.comm import p2p, staging


def _groups_rank(rank, world):
    out = [p2p.rank_and_size() == (dist.get_rank(), dist.get_world_size())]
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    for _ in range(2):   # asked twice: the remembered answer is the same
        out.append(p2p.rank_and_size(evens) == (dist.get_rank(evens), dist.get_world_size(evens)))
    # a message on a group this rank is not in is still refused, naming the group rule
    if rank % 2:
        try:
            p2p.isend(torch.ones(1), 0, evens)
            out.append(False)
        except ValueError as e:
            out.append("not a member of the group" in str(e))
    else:
        out.append(True)
    # no rank leaves before every rank has built the group: gloo connects a new group's full
    # mesh as it is made, and a peer that already exited closes the connection (seen in CI)
    dist.barrier()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 3])
def test_rank_and_size_is_torchs_answer_for_the_world_and_subgroups(world):
    assert all(all(r) for r in minidist.run(_groups_rank, world, timeout=45))


def test_a_reinitialised_world_is_asked_afresh(tmp_path):
    for i in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{i}", rank=0,
                                world_size=1)
        try:
            assert p2p.rank_and_size() == (0, 1)
            pg = dist.GroupMember.WORLD
            assert p2p._groups[id(pg)][0]() is pg    # the entry is the live world's (weakly)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("peer, message", [
    (True, None),                                # a bool is an int to torch too: rank 1
    (2, "is not a rank of the group"), (-1, "is not a rank of the group"),
    ("1", "is not a rank of the group"), (0, "is this rank itself")])
def test_the_fast_check_and_the_full_one_agree(tmp_path, peer, message):
    """Not only valid messages take the fast path's answer: whatever it passes on, the full
    check decides with the message it always gave."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        p2p._groups.clear()
        world = weakref.ref(dist.GroupMember.WORLD)
        p2p._groups[id(dist.GroupMember.WORLD)] = (world, 0, 2)  # pretend W=2
        if message is None:
            p2p._check(torch.ones(2), "isend", peer, None)
        else:
            with pytest.raises(ValueError, match=message):
                p2p._check(torch.ones(2), "isend", peer, None)
        with pytest.raises(ValueError, match="must be contiguous"):
            p2p._check(torch.ones(2, 2).t(), "isend", 1, None)
        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            p2p._check([1.0], "isend", 1, None)
    finally:
        p2p._groups.clear()
        dist.destroy_process_group()


def test_force_staging_variable_is_read_once_per_process_and_again_after_reset(monkeypatch):
    x = torch.zeros(3)
    monkeypatch.setenv("MINIDIST_FORCE_STAGING", "1")
    staging.reset()
    assert staging.needs_staging(x)
    monkeypatch.setenv("MINIDIST_FORCE_STAGING", "0")
    assert staging.needs_staging(x)          # remembered: not reread per message ...
    staging.reset()
    assert not staging.needs_staging(x)      # ... until reset()
    with staging.forced():
        assert staging.needs_staging(x)      # a forced() block still wins
    assert not staging.needs_staging(x)


def _forked_rank(rank, world):
    return staging.needs_staging(torch.zeros(1)), C.all_reduce(torch.ones(3)).tolist()


def test_a_forked_rank_reads_the_variable_it_was_started_with(monkeypatch):
    staging.reset()
    monkeypatch.delenv("MINIDIST_FORCE_STAGING", raising=False)
    assert not staging.needs_staging(torch.zeros(1))   # the parent has read "off"
    monkeypatch.setenv("MINIDIST_FORCE_STAGING", "1")
    try:
        for forced, reduced in minidist.run(_forked_rank, 2, timeout=45, start_method="fork"):
            assert forced and reduced == [2.0, 2.0, 2.0]
    finally:
        staging.reset()


def _both_send_first(rank, world, numel):
    # every rank posts its send before its receive (p2p.exchange's order) with a message far
    # larger than a loopback socket's buffer: a send that blocked until the peer received, or
    # that waited behind this rank's own receive, would hang here
    right, left = (rank + 1) % world, (rank - 1) % world
    out = torch.empty(numel)
    p2p.exchange(torch.full((numel,), float(rank)), right, out, left)
    return bool(out.eq(left).all()) if numel else True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_send_first_exchange_of_large_messages_completes(world):
    """Field reports of the kind: torchcomms#2992 (gloo isend then irecv from one rank deadlocked
    when the send ran on a work thread ahead of the receive), autoscriptlabs/nccl-mesh-plugin#14
    (two ranks sending large tensors at once hung in a blocking isend)."""
    for numel in (0, 1, 1 << 20, 4 << 20):   # up to 16 MiB per message
        assert all(minidist.run(_both_send_first, world, numel, timeout=90)), numel


def test_traffic_counters_are_safe_to_read_while_another_thread_sends():
    """Regression (CI, 2026-12-03): a DDP comm thread recorded a send under a new collective name
    while the main thread's TP region snapshotted the counters: "dictionary changed size during
    iteration" on one rank of a (dp, pp, tp) = (2, 2, 2) run. Recording and reading share one lock."""
    import threading

    from minidist.comm import p2p

    p2p.reset_traffic()
    t = torch.zeros(4)

    def sender():
        for i in range(5_000):
            with p2p.collective(f"op{i}"):
                p2p._record("send", t, peer=1)

    th = threading.Thread(target=sender)
    th.start()
    try:
        while th.is_alive():
            with p2p.count_traffic():
                pass
    finally:
        th.join()
    rows = p2p.traffic()
    assert len(rows) == 5_000 and all(r.bytes_sent == 16 and r.msgs_sent == 1 for r in rows.values())
    p2p.reset_traffic()
