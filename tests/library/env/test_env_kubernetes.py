"""minidist.env.detect in a Kubernetes pod: exactly the variables the Kubeflow operators set.

No Kubernetes runs here. The variable sets below are those of the operators' source:

* PyTorchJob (kubeflow/training-operator, release 1.9, pkg/controller.v1/pytorch/envvar.go
  ``setPodEnv`` and master.go): in every pod PYTHONUNBUFFERED=1; with a Master replica
  MASTER_PORT = PET_MASTER_PORT = the port named ``pytorchjob-port``, MASTER_ADDR =
  PET_MASTER_ADDR = ``<job>-master-0``, WORLD_SIZE = pods × nprocPerNode (1 for "auto"), RANK =
  PET_NODE_RANK = the pod's index (workers count from 1); PET_NPROC_PER_NODE = nprocPerNode (the
  default is "auto"); PET_NNODES = pods, or with an elasticPolicy PET_RDZV_ENDPOINT
  (``<job>-worker-0:port``), PET_RDZV_BACKEND (c10d), PET_NNODES = "min:max", PET_MAX_RESTARTS.
* TrainJob (Kubeflow Trainer, pkg/runtime/framework/plugins/torch/torch.go): PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK (the Job completion index), PET_MASTER_ADDR
  (``<job>-trainer-node-0-0.<job>``), PET_MASTER_PORT (29500), and nothing else.

torchrun reads every PET_X as its --x argument; the test at the end starts real torchrun agents
with a pod's variables and no arguments, as course/multinode/pytorchjob.yaml does.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from minidist.env import EnvError, detect

ROOT = Path(__file__).resolve().parents[3]
MULTINODE = ROOT / "course" / "multinode"


def pytorchjob_env(job="minidist-train", rtype="master", index=0, masters=1, workers=1,
                   nproc="auto", port=23456):
    """One PyTorchJob pod's variables (no elasticPolicy), as setPodEnv builds them."""
    per_node = int(nproc) if nproc.isdigit() else 1           # getNprocPerNodeInt: "auto" -> 1
    rank = index + 1 if rtype == "worker" else index
    env = {"PYTHONUNBUFFERED": "1"}
    if masters:
        addr = f"{job}-master-0"
        env.update(MASTER_PORT=str(port), PET_MASTER_PORT=str(port), MASTER_ADDR=addr,
                   PET_MASTER_ADDR=addr, WORLD_SIZE=str((masters + workers) * per_node),
                   RANK=str(rank), PET_NODE_RANK=str(rank))
    env["PET_NPROC_PER_NODE"] = nproc
    env["PET_NNODES"] = str(masters + workers)
    return env


def elastic_env(job="minidist-train", port=23456, min_pods=1, max_pods=4, nproc="2"):
    """A worker pod of an elastic PyTorchJob (workers only, elasticPolicy with min/max replicas)."""
    return {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": nproc,
            "PET_RDZV_ENDPOINT": f"{job}-worker-0:{port}", "PET_RDZV_BACKEND": "c10d",
            "PET_NNODES": f"{min_pods}:{max_pods}", "PET_MAX_RESTARTS": "3"}


def trainjob_env(job="minidist-train", node_rank=0, nodes=2, nproc="2"):
    """A TrainJob pod's torch variables (the Trainer's torch plugin)."""
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": f"{job}-trainer-node-0-0.{job}", "PET_MASTER_PORT": "29500"}


@pytest.mark.parametrize("rtype,index,rank", [("master", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_pytorchjob_one_process_per_pod_reads_the_operators_rank(rtype, index, rank):
    """nprocPerNode "auto" (the default) and the script as the container's command: one process
    per pod, RANK = the pod's index, WORLD_SIZE = pods."""
    info = detect(pytorchjob_env(rtype=rtype, index=index, workers=2))
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank,
            info.launcher) == (rank, 0, 3, 1, rank, "pytorchjob")
    assert (info.master_addr, info.master_port) == ("minidist-train-master-0", 23456)


@pytest.mark.parametrize("rtype,index", [("master", 0), ("worker", 0)])
def test_pytorchjob_with_several_processes_per_pod_needs_torchrun(rtype, index):
    """nprocPerNode 2 without torchrun: WORLD_SIZE=4 counts processes nobody started and RANK is
    the pod's index: the job would hang waiting for ranks 2 and 3. Refused, saying why."""
    env = pytorchjob_env(rtype=rtype, index=index, nproc="2")
    assert env["WORLD_SIZE"] == "4"
    with pytest.raises(EnvError, match=r"PET_NPROC_PER_NODE=2 but this process was not started by "
                                       r"torchrun[\s\S]*WORLD_SIZE=4[\s\S]*torch.distributed.run"):
        detect(env)


@pytest.mark.parametrize("env", [trainjob_env(node_rank=0), trainjob_env(node_rank=1),
                                 trainjob_env(nodes=1, nproc="2"), elastic_env()],
                         ids=["trainjob-node0", "trainjob-node1", "trainjob-1x2", "elastic"])
def test_only_torchruns_arguments_without_torchrun_is_refused(env):
    """TrainJob and elastic pods carry torchrun's arguments only: run directly, each pod would be
    a world of one and train alone — the silent failure. Refused."""
    with pytest.raises(EnvError, match=r"RANK and WORLD_SIZE are not[\s\S]*every pod would train "
                                       r"alone[\s\S]*torch.distributed.run"):
        detect(env)


def test_one_pod_one_process_is_a_single_process():
    assert detect(trainjob_env(nodes=1, nproc="1")).launcher == "single"


def test_exported_local_rank_is_read_as_given():
    env = {**pytorchjob_env(nproc="2"), "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    info = detect(env)
    assert (info.rank, info.local_rank, info.local_world_size, info.launcher) == (1, 1, 2, "env")


def _load(name):
    return list(yaml.safe_load_all((MULTINODE / name).read_text()))


def _runs_the_course_script(container):
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"], cmd     # torchrun reads PET_*
    script = next(a for a in cmd[3:] if a.endswith(".py"))
    assert container["workingDir"] == "/course"                         # the image's WORKDIR
    assert (ROOT / script).is_file() and script == "course/multinode/train.py"
    assert "WORKDIR /course" in (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert container["image"] == "minidist:cpu"


def test_pytorchjob_manifest_runs_the_course_script():
    (doc,) = _load("pytorchjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and doc["spec"]["nprocPerNode"] == "2"
    for rtype, spec in specs.items():
        (c,) = spec["template"]["spec"]["containers"]
        assert c["name"] == "pytorch"          # PyTorchJobDefaultContainerName: where env goes
        _runs_the_course_script(c)
    ports = specs["Master"]["template"]["spec"]["containers"][0]["ports"]
    assert ports == [{"name": "pytorchjob-port", "containerPort": 23456}]  # MASTER_PORT's source
    pods = sum(s["replicas"] for s in specs.values())
    assert pytorchjob_env(masters=1, workers=pods - 1, nproc="2")["WORLD_SIZE"] == "4"


def test_jobset_manifest_sets_exactly_the_trainers_variables():
    (doc,) = _load("jobset.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    (rjob,) = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 2
    (c,) = job["template"]["spec"]["containers"]
    _runs_the_course_script(c)
    env = {e["name"]: e for e in c["env"]}
    assert {k for k in env if k.startswith("PET_")} == set(trainjob_env())
    name = doc["metadata"]["name"]
    assert env["PET_MASTER_ADDR"]["value"] == f"{name}-{rjob['name']}-0-0.{name}"
    assert env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["PET_NNODES"]["value"] == "2" and env["PET_MASTER_PORT"]["value"] == "29500"


PROBE = """import json, os, sys
sys.path.insert(0, sys.argv[2])
from minidist.env import detect
d = detect()
with open(os.path.join(sys.argv[1], f"rank{d.rank}.json"), "w") as f:
    json.dump(d.__dict__, f)
"""


@pytest.mark.timeout(180)
def test_torchrun_in_two_pods_reads_the_pytorchjob_variables(tmp_path):
    """Two torchrun agents, each given one PyTorchJob pod's variables (nprocPerNode 2) and no
    arguments, on loopback (the master's name: this machine's hostname, as a pod's service
    name would be): torchrun takes --nnodes/--nproc_per_node/--node_rank/--master_* from PET_*,
    and detect() in each of the 4 processes reads a consistent torchrun environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host = socket.gethostname()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    procs = []
    for rtype, index in (("master", 0), ("worker", 0)):
        pod = pytorchjob_env(rtype=rtype, index=index, nproc="2", port=port)
        pod.update(MASTER_ADDR=host, PET_MASTER_ADDR=host)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "RANK", "WORLD"))}
        env.update(pod, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", str(probe),
                                       str(tmp_path), str(ROOT)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    ranks = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")),
                   key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in ranks] == \
        [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert {(r["world_size"], r["local_world_size"], r["launcher"], r["master_addr"],
             r["master_port"]) for r in ranks} == {(4, 2, "torchrun", host, port)}
