"""minidist.env.detect: rank / local rank / world size from torchrun or Slurm, and refusals.

Failure cases L2 (localhost with several nodes), L3 (LOCAL_RANK, never RANK) and L4 (srun + torchrun).
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
    """L3: RANK=5, LOCAL_RANK=1, WORLD_SIZE=8 on a 4-device node -> device 1."""
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
    """L4: 4 tasks per node x torchrun with 4 processes each would start 16 per node."""
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
    """L2: a rendezvous on localhost cannot span two nodes."""
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
