"""minidist.env.detect: rank / local rank / world size from torchrun or Slurm, and refusals.

Refusals: localhost as MASTER_ADDR with several nodes; the device from LOCAL_RANK, never RANK;
srun starting several tasks per node with torchrun starting several processes in each.
detect() is pure (it reads the dict it is given), so these need no processes.
"""

import pytest
import torch

from minidist import env
from minidist.env import EnvError, detect

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "1", "MASTER_ADDR": "node1",
            "MASTER_PORT": "29500"}


def test_no_launcher_is_a_single_process():
    assert detect({}) == env.DistEnv(0, 0, 1, 1, 0, "single")


def test_local_rank_not_rank_picks_the_device():
    """RANK=5, LOCAL_RANK=1, WORLD_SIZE=8 on a 4-device node -> device 1."""
    info = detect({**TORCHRUN, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                   "LOCAL_WORLD_SIZE": "4"})
    assert (info.rank, info.local_rank, info.world_size, info.node_rank) == (5, 1, 8, 1)
    assert env.device_for("nccl", info.local_rank) == torch.device("cuda", 1)
    assert env.device_for("gloo", info.local_rank) == torch.device("cpu")


def test_missing_local_rank_falls_back_to_slurm_localid_or_fails():
    base = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
            "MASTER_PORT": "1"}
    assert detect({**base, "SLURM_LOCALID": "1"}).local_rank == 1
    with pytest.raises(EnvError, match="RANK is set but LOCAL_RANK is not"):
        detect(base)


def test_srun_tasks_times_torchrun_processes_is_refused():
    """4 tasks per node x torchrun with 4 processes each would start 16 per node."""
    bad = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2", "SLURM_PROCID": "5"}
    with pytest.raises(EnvError, match=r"srun started 4 tasks per node and torchrun started 4 "
                                       r"processes in each: 32 processes instead of 8[\s\S]*"
                                       r"--ntasks-per-node=1"):
        detect(bad)
    ok = {**bad, "SLURM_NTASKS_PER_NODE": "1"}
    assert detect(ok).world_size == 8


def test_slurm_without_torchrun_maps_procid_localid_nodeid():
    """srun starts one task per rank: SLURM_PROCID is the global rank, SLURM_NODEID the node."""
    info = detect({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                   "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)",
                   "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank,
            info.launcher) == (5, 1, 8, 4, 1, "slurm")


def test_localhost_master_with_several_nodes_is_refused():
    """A rendezvous on localhost cannot span two nodes."""
    with pytest.raises(EnvError, match="MASTER_ADDR=localhost but the job spans 2 nodes"):
        detect({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                "SLURM_NNODES": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"})


def test_inconsistent_values_are_refused():
    with pytest.raises(EnvError, match="inconsistent launch environment: rank=4, world_size=4"):
        detect({"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(EnvError, match="WORLD_SIZE='four' is not an integer"):
        detect({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "four"})


def test_backend_choice():
    assert env.choose_backend("gloo", 4) == "gloo"
    with pytest.raises(ValueError, match="backend must be"):
        env.choose_backend("mpi")
    if torch.cuda.device_count() < 2:
        assert env.choose_backend("auto", 2) == "gloo"
        with pytest.raises(ValueError, match="one GPU per local rank"):
            env.choose_backend("nccl", 2)


@pytest.mark.parametrize("value,counts", [
    ("4", [4]), ("2,1", [2, 1]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2),3(x2)", [1, 1, 3, 3]),
    ("16(x4)", [16] * 4), (" 2 , 1 ", [2, 1])])
def test_tasks_per_node_in_slurms_compressed_form(value, counts):
    """srun(1): counts are comma-separated in node-list order; N(xM) repeats N on M nodes."""
    assert env.parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("bad", ["", "2(x)", "x2", "2(3)", "2,,1", "-1"])
def test_malformed_tasks_per_node_is_refused(bad):
    with pytest.raises(EnvError, match="SLURM_TASKS_PER_NODE"):
        env.parse_tasks_per_node(bad)


UNEVEN = {"SLURM_NTASKS": "3", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2,1",
          "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("procid,node,localid,local_world", [(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 1)])
def test_uneven_srun_gets_each_nodes_own_local_world_size(procid, node, localid, local_world):
    """`srun -n 3 -N 2`: node 0 runs 2 tasks, node 1 runs 1 (SLURM_TASKS_PER_NODE=2,1)."""
    info = detect({**UNEVEN, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(node),
                   "SLURM_LOCALID": str(localid)})
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank) == \
        (procid, localid, 3, local_world, node)


def test_compressed_tasks_per_node_picks_this_nodes_count():
    base = {"SLURM_NTASKS": "7", "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "2(x3),1",
            "MASTER_ADDR": "node1", "MASTER_PORT": "1"}
    assert detect({**base, "SLURM_PROCID": "6", "SLURM_NODEID": "3", "SLURM_LOCALID": "0"}
                  ).local_world_size == 1
    assert detect({**base, "SLURM_PROCID": "5", "SLURM_NODEID": "2", "SLURM_LOCALID": "1"}
                  ).local_world_size == 2
    with pytest.raises(EnvError, match="SLURM_NODEID=4 but SLURM_TASKS_PER_NODE='2\\(x3\\),1' lists 4"):
        detect({**base, "SLURM_PROCID": "6", "SLURM_NODEID": "4", "SLURM_LOCALID": "0"})


def test_env_and_doctor_do_not_import_each_other():
    """env.py holds the checks init() needs; doctor.py only reads them (no import cycle)."""
    import ast
    import inspect

    from minidist_course import doctor
    tree = ast.parse(inspect.getsource(env))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("doctor" in name for name in imported), imported
    assert doctor.check_socket_ifnames is env.check_socket_ifnames
