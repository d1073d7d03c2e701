"""torchft on CPU: replica groups that fail and rejoin while the others keep training.

The production counterpart of restart-everything (``torchrun --max-restarts``): with torchft
(pytorch/torchft, ``torchft-nightly`` on PyPI) each *replica group* is its own job with its own
process group; a **lighthouse** (one small server) forms a *quorum* of the live groups before
every step, the gradient all-reduce runs over the quorum only, and a group that joins late
*heals* by downloading a live group's state dict (HTTP) before it takes part. A dead group is
dropped from the quorum once its heartbeat is older than ``heartbeat_timeout_ms``; the others
never stop. What it costs: one quorum round trip to the lighthouse per step, a step thrown away
(``should_commit`` is False everywhere) when a group dies inside it, and fewer samples per step
while a group is missing.

:func:`run_replicas` starts the lighthouse here and one process per replica group (this file run
as a script; ``world_size`` 1 in each group), optionally SIGKILLs one group inside step ``k`` (after
its forward, before its all-reduce) and starts it again, and returns every group's per-step log
and final parameters. Two algorithms, on the same model (:class:`~minidist.models.MLP` 12-32-5)
and data (:func:`batch`: a group's batch depends on its id and the step):

- ``"ddp"``: the quorum's mean gradient, SGD (the manager's ``start_quorum`` / ``allreduce`` /
  ``should_commit`` protocol written out, as ``torchft.optim.OptimizerWrapper`` does it);
- ``"diloco"``: ``torchft.local_sgd.DiLoCo`` (inner AdamW, outer Nesterov SGD over the averaged
  parameter change every ``sync_every`` steps) — the reference for
  :class:`minidist.data_parallel.DiLoCo`.

Source read: torchft ``manager.py`` (quorum, heal, commit), ``local_sgd.py`` (DiLoCo),
``src/lighthouse.rs`` (``quorum_compute``: heartbeats, ``join_timeout_ms``, the split-brain rule
"more than half of the heartbeating groups").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

from minidist.models import MLP

__all__ = ["batch", "model", "run_replicas", "DILOCO", "SIZES"]

SIZES = (12, (32,), 5)
DILOCO = dict(inner_lr=1e-2, weight_decay=0.1, outer_lr=0.7, outer_momentum=0.9)


def model() -> torch.nn.Module:
    """The shared initial model (seed 0): every group and the from-scratch runs start equal."""
    torch.manual_seed(0)
    return MLP(*SIZES)


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group``'s batch at ``step``: 8 rows, (8, 12) inputs and (8, 5) targets."""
    g = torch.Generator().manual_seed(1000 * group + step)
    x = torch.randn(8, SIZES[0], generator=g)
    return x, torch.tanh(x[:, :SIZES[2]] * 1.5) + 0.1 * torch.randn(8, SIZES[2], generator=g)


def _log(f, **rec) -> None:
    f.write(json.dumps(rec) + "\n")
    f.flush()


def _replica(cfg: dict) -> None:
    """One replica group (a process): train ``cfg['steps']`` committed steps, log each one."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    rid, algo, secs = cfg["group"], cfg["algo"], timedelta(seconds=cfg["timeout_s"])
    net = model()
    if algo == "ddp":
        opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=DILOCO["inner_lr"],
                                weight_decay=DILOCO["weight_decay"])

    def state_dict():
        return {"model": net.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd):
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=secs), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      use_async_quorum=False, replica_id=f"group{rid}", store_addr="localhost",
                      store_port=store.port, rank=0, world_size=1, timeout=secs,
                      quorum_timeout=secs, connect_timeout=secs,
                      lighthouse_addr=cfg["lighthouse"], init_sync=algo == "ddp")
    log = open(cfg["log"], "a")
    _log(log, event="start", incarnation=cfg["incarnation"], t=time.time())
    if cfg["incarnation"] == 0:             # both groups heartbeat before the first quorum
        open(os.path.join(cfg["dir"], f"ready{rid}"), "w").close()
        while not all(os.path.exists(os.path.join(cfg["dir"], f"ready{r}"))
                      for r in range(cfg["groups"])):
            time.sleep(0.02)
    try:
        if algo == "ddp":
            joint = 0                       # consecutive committed steps with every group
            while manager.current_step() < cfg["steps"] or joint < 2:
                manager.start_quorum()      # heals here (sync quorum) if this group is behind
                step = manager.current_step()
                x, y = batch(rid, step)
                opt.zero_grad()
                loss = F.mse_loss(net(x), y)
                if cfg["kill"] == [rid, step] and cfg["incarnation"] == 0:
                    _log(log, event="kill", step=step, t=time.time())
                    os.kill(os.getpid(), signal.SIGKILL)      # mid-step: before the all-reduce
                loss.backward()
                works = [manager.allreduce(p.grad) for p in net.parameters()]
                for w in works:
                    w.wait()
                n = manager.num_participants()
                committed = manager.should_commit()
                if committed:
                    opt.step()
                joint = joint + 1 if committed and n == cfg["groups"] else 0
                time.sleep(cfg["step_s"])       # the compute a real step would take
                _log(log, event="step", step=step, participants=n, committed=committed,
                     loss=loss.item(), t=time.time())
        else:
            from torchft.local_sgd import DiLoCo
            outer = torch.optim.SGD(net.parameters(), lr=DILOCO["outer_lr"],
                                    momentum=DILOCO["outer_momentum"], nesterov=True)
            with DiLoCo(manager, [net], opt, outer, sync_every=cfg["sync_every"]):
                for i in range(cfg["steps"]):
                    x, y = batch(rid, i)
                    opt.zero_grad()
                    loss = F.mse_loss(net(x), y)
                    loss.backward()
                    opt.step()              # every sync_every-th step: the outer step
                    _log(log, event="step", step=i, outer_steps=manager.current_step(),
                         loss=loss.item(), t=time.time())
        _log(log, event="final", t=time.time(), step=manager.current_step(),
             params=[p.detach().reshape(-1).tolist() for p in net.parameters()])
    finally:
        log.close()
        manager.shutdown(wait=False)


def _start(cfg: dict, group: int, incarnation: int) -> subprocess.Popen:
    c = dict(cfg, group=group, incarnation=incarnation, log=os.path.join(cfg["dir"], f"g{group}.jsonl"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "minidist_course.references.fault_tolerant",
                             json.dumps(c)], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(cfg["dir"], f"g{group}.{incarnation}.err"), "w"))


def run_replicas(algo: str = "ddp", groups: int = 2, steps: int = 12, kill: tuple | None = None,
                 sync_every: int = 3, lr: float = 0.1, step_s: float = 0.02,
                 heartbeat_timeout_ms: int = 1000,
                 timeout_s: float = 20.0, deadline_s: float = 150.0) -> dict:
    """Train ``groups`` torchft replica groups (one process each) with a lighthouse here.

    Args:
        algo: ``"ddp"`` (the quorum's mean gradient, SGD ``lr``) or ``"diloco"`` (torchft's
            DiLoCo, :data:`DILOCO` settings, outer step every ``sync_every`` steps).
        steps: committed steps to reach (``"ddp"``; a group then also waits for two committed
            steps with every group in the quorum, so the survivor trains on alone until the
            killed group is back) or inner steps to take (``"diloco"``).
        step_s: seconds each ``"ddp"`` step sleeps (the compute a real step would take).
        kill: ``(group, step)``: that group SIGKILLs itself in ``step`` after its forward pass
            (first incarnation only); it is then started again, and heals from a live group.
        heartbeat_timeout_ms: the lighthouse drops a group whose heartbeat is older than this.
        timeout_s: the managers' collective / quorum / connect timeouts.
        deadline_s: the whole run; past it every process is killed and ``TimeoutError`` raised.

    Returns ``{"logs": {group: [records]}, "final": {group: [flat params per tensor]},
    "killed_at": t or None, "restarted_at": t or None}`` (times from ``time.time()``).
    Raises ``RuntimeError`` with the group's stderr tail when a group fails otherwise.
    """
    # torchft's Rust side logs every quorum at info; read when torchft is first imported
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer
    if algo not in ("ddp", "diloco"):
        raise ValueError(f"run_replicas: algo must be 'ddp' or 'diloco', got {algo!r}")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1 if kill else groups,
                                  join_timeout_ms=2000, heartbeat_timeout_ms=heartbeat_timeout_ms)
    with tempfile.TemporaryDirectory(prefix="minidist-torchft-") as d:
        cfg = dict(algo=algo, groups=groups, steps=steps, kill=list(kill) if kill else None,
                   sync_every=sync_every, lr=lr, step_s=step_s, timeout_s=timeout_s, dir=d,
                   lighthouse=lighthouse.address())
        procs = {g: _start(cfg, g, 0) for g in range(groups)}
        killed_at = restarted_at = None
        t_end = time.monotonic() + deadline_s
        try:
            while any(p.poll() is None for p in procs.values()):
                if time.monotonic() > t_end:
                    raise TimeoutError(f"run_replicas({algo!r}): not done after {deadline_s} s")
                for g, p in procs.items():
                    rc = p.poll()
                    if rc == -signal.SIGKILL and kill and g == kill[0] and restarted_at is None:
                        killed_at = time.time()
                        procs[g] = _start(cfg, g, 1)
                        restarted_at = time.time()
                    elif rc not in (None, 0):
                        raise RuntimeError(f"replica group {g} exited with {rc}:\n"
                                           + _tail(os.path.join(d, f"g{g}.{int(restarted_at is not None)}.err")))
                time.sleep(0.05)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            lighthouse.shutdown()
        logs = {g: [json.loads(line) for line in open(os.path.join(d, f"g{g}.jsonl"))]
                for g in range(groups)}
    final = {g: next(r["params"] for r in logs[g] if r["event"] == "final") for g in logs}
    return dict(logs=logs, final=final, killed_at=killed_at, restarted_at=restarted_at)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return "(no stderr)"


if __name__ == "__main__":
    _replica(json.loads(sys.argv[1]))
    # The group's results are logged and flushed. torchft's manager and its gloo process group
    # keep C++ threads that shutdown(wait=False) does not join; tearing the interpreter down
    # around them aborts now and then ("terminate called without an active exception", exit -6,
    # seen in 1 of a few CI runs after the "final" record was written): leave without teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
