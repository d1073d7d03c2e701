"""The course's training script under torchrun: two process trees with --nnodes=2 over loopback.

Two ``torch.distributed.run`` agents on one machine play two nodes: they meet through c10d
rendezvous on 127.0.0.1, torchrun assigns global ranks, each rank writes ``rank{r}.json``. The test
reads those files (not the interleaved logs): world size 4, node ranks {0, 1} each with local ranks
{0, 1}, bit-identical parameters on every rank after training, and a model that learned.

The integration tier (tests/integration/): each test starts two or three process trees (15-40 s
each). Chapter 08 runs the same launches, in the integration tier too; the default tier keeps
torchrun through test_launch_isolation.py (two standalone jobs at once), test_env_kubernetes.py
(two pods' torchrun agents) and chapter 12 (the 3-D script under torchrun).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "course" / "multinode" / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def read_ranks(out: Path):
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


def run_all(cmds, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True) for c in cmds]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return [p.returncode for p in procs], outs


@pytest.mark.slow  # two torchrun launches: ~25-35 s on 2 busy cores
def test_two_torchrun_trees_over_loopback(tmp_path):
    port = free_port()
    common = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
              f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=pytest{port}",
              # the address other nodes reach this one at: the hostname, not "localhost"
              # (minidist.init refuses localhost as MASTER_ADDR when the job spans 2 nodes)
              f"--local_addr={socket.gethostname()}"]
    script = [str(TRAIN), "--epochs=1", f"--out={tmp_path}", "--no-host-check"]
    codes, outs = run_all([torchrun(*common, *script), torchrun(*common, *script)])
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    ranks = read_ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["world_size"] for r in ranks} == {4}
    assert sorted((r["node_rank"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["launcher"] for r in ranks} == {"torchrun"}
    assert len({r["params_sha256"] for r in ranks}) == 1, "replicas differ after training"
    assert ranks[0]["accuracy"] > 0.3  # one epoch, 10 steps of 4x32 samples: 0.62 measured (chance: 0.1)
    assert len({r["pid"] for r in ranks}) == 4


@pytest.mark.slow
def test_two_trees_on_one_host_are_refused_without_no_host_check(tmp_path):
    """Two trees on one host share (hostname, local rank): minidist.init's host check must say so."""
    port = free_port()
    common = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
              f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=pytest{port}",
              f"--local_addr={socket.gethostname()}"]
    script = [str(TRAIN), "--epochs=0", f"--out={tmp_path}"]
    codes, outs = run_all([torchrun(*common, *script), torchrun(*common, *script)])
    assert codes != [0, 0]
    assert "appear more than once" in "".join(outs)
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.slow
def test_course_script_minidist_ddp_equals_torch_ddp_under_torchrun(tmp_path):
    """The same script with torch's DDP (the reference) and minidist's BucketedDDP: at 2 ranks the
    average (g0 + g1) / 2 is computed exactly alike, so the parameters are bit-identical (measured)."""
    digests = {}
    for ddp in ("torch", "minidist"):
        out = tmp_path / ddp
        codes, outs = run_all([torchrun("--standalone", "--nproc_per_node=2", str(TRAIN), "--epochs=1",
                                        f"--ddp={ddp}", f"--out={out}")])
        assert codes == [0], outs[0][-3000:]
        ranks = read_ranks(out)
        assert len(ranks) == 2 and len({r["params_sha256"] for r in ranks}) == 1
        digests[ranks[0]["ddp"]] = ranks[0]["params_sha256"]
    assert set(digests) == {"torch DDP", "minidist.BucketedDDP"}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.slow  # three torchrun launches (one restarts): ~30-45 s on 2 busy cores
@pytest.mark.timeout(660)
def test_max_restarts_resumes_from_the_newest_complete_checkpoint_to_the_same_parameters(tmp_path):
    """``torchrun --max-restarts=1`` after rank 1 dies in epoch 1: the restarted workers load the
    newest complete checkpoint generation (epoch 0) and finish with the parameters of a run that
    never stopped (the sampler's order is a function of the epoch; SGD without momentum has no
    state). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is the recipe's other half (see train.py)."""
    env_restart = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    script = [str(TRAIN), "--epochs=3"]
    straight = [*torchrun("--standalone", "--nproc_per_node=2"), *script,
                f"--out={tmp_path / 'straight'}"]
    restarted = [*torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1"), *script,
                 "--crash-rank=1", "--crash-epoch=1", f"--ckpt={tmp_path / 'ckpt'}",
                 f"--out={tmp_path / 'restarted'}"]
    old = {k: os.environ.get(k) for k in env_restart}
    os.environ.update(env_restart)
    try:
        codes, outs = run_all([straight], timeout=300)   # ~15 s alone; minutes beside other
        assert codes == [0], outs[0][-3000:]              # process trees on 2 cores
        codes, outs = run_all([restarted], timeout=300)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert codes == [0], outs[0][-3000:]
    assert "injected crash in epoch 1" in outs[0] and "resumed from" in outs[0], outs[0][-3000:]
    a, b = read_ranks(tmp_path / "straight"), read_ranks(tmp_path / "restarted")
    assert {r["attempt"] for r in b} == {1}
    assert {r["params_sha256"] for r in a} == {r["params_sha256"] for r in b}, (a, b)
    from minidist.checkpoint_io import generations
    assert [(n, done) for n, _, done in generations(tmp_path / "ckpt" / "checkpoint.pt")] == \
        [(3, True)]   # epoch 0 before the crash, epochs 1 and 2 after it; only the newest is kept


@pytest.mark.slow  # two torchrun launches of 4 ranks (one restarts): ~40-80 s on 2 cores
@pytest.mark.timeout(660)
def test_a_rank_killed_mid_step_on_a_tp_pp_grid_resumes_bit_for_bit(tmp_path):
    """The multi-axis script (tp = pp = 2) under ``torchrun --max-restarts=1``: rank 1 SIGKILLs
    itself at the start of step 3 while the others wait in the step; torchrun restarts every
    worker, they load the newest complete generation (saved after step 2: shards, AdamW, every
    generator) and finish. The losses rank 0 prints equal the uninterrupted run's, digit for
    digit (8 decimals of the same float32 numbers)."""
    script = ROOT / "course" / "scripts" / "train_3d.py"
    args = [str(script), "--tp", "2", "--pp", "2", "--steps", "5"]
    env_restart = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    old = {k: os.environ.get(k) for k in env_restart}
    os.environ.update(env_restart)
    try:
        codes, outs = run_all([[*torchrun("--standalone", "--nproc_per_node=4"), *args]],
                              timeout=300)
        assert codes == [0], outs[0][-3000:]
        straight = [line for line in outs[0].splitlines() if line.startswith("step ")]
        codes, outs = run_all([[*torchrun("--standalone", "--nproc_per_node=4",
                                          "--max-restarts=1"), *args,
                                "--checkpoint", str(tmp_path / "ckpt"), "--kill-rank", "1",
                                "--kill-step", "3"]], timeout=300)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert codes == [0], outs[0][-3000:]
    assert "resumed from gen-000003 at step 3" in outs[0], outs[0][-3000:]
    resumed = [line for line in outs[0].splitlines() if line.startswith("step ")]
    assert len(straight) == 5 and resumed == straight, (straight, resumed)   # 0-2, then 3-4
