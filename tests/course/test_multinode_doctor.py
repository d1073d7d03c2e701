"""minidist_course.doctor: environment checks that catch multi-node problems before a run (localhost with several nodes,
the device from LOCAL_RANK, srun x torchrun, missing interfaces, a busy port)."""

import socket

import pytest

from minidist_course import doctor as doc
from minidist.env import EnvError, detect


def rows_by_check(rows):
    return {check: (status, detail) for check, status, detail in rows}


def test_missing_gloo_interface_fails_naming_it_and_listing_existing():
    with pytest.raises(EnvError) as e:
        doc.check_socket_ifnames({"GLOO_SOCKET_IFNAME": "doesnotexist0"}, existing=["lo", "eth0"])
    msg = str(e.value)
    assert "GLOO_SOCKET_IFNAME=doesnotexist0" in msg and "eth0, lo" in msg


def test_gloo_list_checks_every_name():
    doc.check_socket_ifnames({"GLOO_SOCKET_IFNAME": "eth0,lo"}, existing=["lo", "eth0"])
    with pytest.raises(EnvError, match="'eth1'"):
        doc.check_socket_ifnames({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, existing=["lo", "eth0"])


def test_nccl_prefix_exact_and_exclusion_rules():
    existing = ["lo", "eth0", "ib0"]
    doc.check_socket_ifnames({"NCCL_SOCKET_IFNAME": "eth"}, existing=existing)  # prefix match
    doc.check_socket_ifnames({"NCCL_SOCKET_IFNAME": "^docker,lo"}, existing=existing)  # exclusion
    with pytest.raises(EnvError, match="NCCL_SOCKET_IFNAME==eth"):
        doc.check_socket_ifnames({"NCCL_SOCKET_IFNAME": "=eth"}, existing=existing)  # exact
    with pytest.raises(EnvError, match="starts with"):
        doc.check_socket_ifnames({"NCCL_SOCKET_IFNAME": "enp"}, existing=existing)


def test_this_machines_interfaces_include_loopback():
    names = doc.interfaces()
    assert "lo" in names and names["lo"] == "127.0.0.1"
    doc.check_socket_ifnames({"GLOO_SOCKET_IFNAME": "lo"})


def test_doctor_reports_ok_for_a_single_process():
    rows = rows_by_check(doc.doctor(environ={}))
    assert rows["backend gloo"][0] == "ok"
    assert rows["launch"] == ("ok", rows["launch"][1]) and "world_size=1" in rows["launch"][1]
    assert not [c for c, (s, _) in rows.items() if s == "fail"]


def test_doctor_warns_on_loopback_hostname_only_with_several_nodes(monkeypatch):
    monkeypatch.setattr(doc, "_resolve", lambda host: "127.0.1.1")
    assert rows_by_check(doc.doctor(1, environ={}))["hostname"][0] == "ok"
    status, detail = rows_by_check(doc.doctor(2, environ={}))["hostname"]
    assert status == "warn" and "127.0.1.1" in detail and "2 nodes" in detail
    # under Slurm the node count comes from SLURM_NNODES
    assert rows_by_check(doc.doctor(1, environ={"SLURM_NNODES": "2"}))["hostname"][0] == "warn"


def test_doctor_reports_the_rank_a_torchrun_environment_implies():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "j", "MASTER_ADDR": "node0",
           "MASTER_PORT": "29500"}
    status, detail = rows_by_check(doc.doctor(environ=env))["launch"]
    # the device index is LOCAL_RANK (1), never RANK (5) or RANK % devices
    assert status == "ok" and "rank=5 local_rank=1 world_size=8" in detail and "node_rank=1" in detail
    assert detect(env).local_rank == 1


def test_doctor_fails_on_srun_times_torchrun():
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4",
           "TORCHELASTIC_RUN_ID": "j", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    rows = doc.doctor(environ=env)
    status, detail = rows_by_check(rows)["launch"]
    assert status == "fail" and "--ntasks-per-node=1" in detail


def test_doctor_fails_on_localhost_master_with_several_nodes():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_LOCALID": "0",
           "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    rows = rows_by_check(doc.doctor(environ=env))
    assert rows["launch"][0] == "fail" and "MASTER_ADDR=localhost" in rows["launch"][1]
    assert rows["MASTER_ADDR"][0] == "fail"


def test_doctor_warns_when_master_port_is_taken():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        status, detail = rows_by_check(doc.doctor(environ={"MASTER_PORT": str(port)}))[f"port {port}"]
    assert status == "warn" and "already in use" in detail


def test_main_exit_status(monkeypatch, capsys):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "doesnotexist0")
    assert doc.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "doesnotexist0" in out
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    for var in doc.LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert doc.main(["--nodes", "1"]) == 0


def test_doctor_reports_nccls_version_and_variables():
    import torch
    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    env = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    rows = rows_by_check(doc.doctor(environ=env))
    assert rows["nccl version"][1] == ".".join(map(str, torch.cuda.nccl.version()))
    detail = rows["nccl variables"][1]
    assert "NCCL_DEBUG=INFO" in detail and "TORCH_NCCL_BLOCKING_WAIT=1" in detail
    for unset in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert unset in detail.split("unset:")[1]
    assert not torch.cuda.is_initialized(), "doctor must not initialise CUDA"
