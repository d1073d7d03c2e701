"""Launch the job in each framework and compare it with minidist's DDP (the chapter's table).

Runs in the project's venv; each framework runs in its own venv (tools/framework-envs.sh), started
by its own launcher, every one of them told to use the loopback interface (some servers bind every
interface regardless: ``Framework.wildcard_ports``, checked by the tests)::

    python frameworks/compare.py                       # every framework whose env is built
    python frameworks/compare.py --build --save        # build missing envs; rewrite results.json
    python frameworks/compare.py torch_ddp deepspeed_zero2 --variant long

Each launch writes rank 0's ``result.npz`` (losses per step, final weights, seconds per step);
:func:`compare` gives the largest difference to the reference for losses and weights.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import job  # noqa: E402

ENV_SCRIPT = os.path.join(ROOT, "tools", "framework-envs.sh")
RESULTS = os.path.join(HERE, "results.json")
TOLERANCE = 1e-5


class EnvMissing(RuntimeError):
    """The framework's venv is not built (tools/framework-envs.sh NAME builds it)."""


@dataclass(frozen=True)
class Framework:
    name: str
    env: str | None          # venv of tools/framework-envs.sh; None: the project's venv
    script: str              # file under frameworks/
    launcher: str            # torchrun | tf_config | single | paddle | horovodrun | accelerate[_cpu]
    args: tuple = ()
    note: str = ""
    wildcard_ports: int = 0  # servers it binds on every interface whatever it is told (measured)
    zero_stage: int = 0      # minidist's matching reference besides DDP: ZeRO stage (0: DDP only)


FRAMEWORKS = {f.name: f for f in [
    # torchrun's agent (c10d rendezvous) binds 2 stores on [::] whatever --rdzv-endpoint and
    # --local-addr say (torch 2.13 and 2.14 alike, measured); the workers' gloo stays on lo
    Framework("torch_ddp", None, "torch_ddp.py", "torchrun", note="DistributedDataParallel",
              wildcard_ports=2),
    Framework("torch_fsdp2", None, "torch_fsdp2.py", "torchrun", note="fully_shard (ZeRO-3)",
              zero_stage=3, wildcard_ports=2),
    *[Framework(f"deepspeed_zero{s}", "deepspeed", "deepspeed_zero.py", "torchrun",
                ("--stage", str(s)), note=f"ZeRO stage {s}, CPU accelerator", zero_stage=s,
                wildcard_ports=2)
      for s in range(4)],
    # TF's gRPC server binds [::]:PORT for the port in TF_CONFIG: the address is fixed in its binary
    Framework("tf_multiworker", "tensorflow", "tf_multiworker.py", "tf_config",
              note="MultiWorkerMirroredStrategy, 2 processes", wildcard_ports=job.WORKERS),
    Framework("tf_mirrored", "tensorflow", "tf_mirrored.py", "single",
              note="MirroredStrategy, 2 logical CPUs, 1 process"),
    # rank 0's TCPStore (Paddle's libuv server) binds 0.0.0.0 even with --host/--master 127.0.0.1
    Framework("paddle_fleet", "paddle", "paddle_fleet.py", "paddle", note="fleet collective mode",
              wildcard_ports=1),
    # horovodrun's rendezvous HTTP server binds ('', port): every interface, fixed in its code
    Framework("horovod", "horovod", "horovod_job.py", "horovodrun", note="gloo, unmaintained",
              wildcard_ports=1),
    # `accelerate launch --multi_gpu` starts torchrun's agent in-process: its 2 stores on [::]
    Framework("accelerate", "accelerate", "accelerate_job.py", "accelerate",
              note="accelerate launch --multi_gpu, Accelerator(cpu=True)", wildcard_ports=2),
]}

# the trap, not in the table: `accelerate launch --cpu --num_processes 2` runs ONE process
ACCELERATE_CPU_FLAG = Framework("accelerate_cpu_flag", "accelerate", "accelerate_job.py",
                                "accelerate_cpu", ("--allow-fewer",),
                                note="accelerate launch --cpu --num_processes 2 (one process)")


def env_python(env: str | None, build: bool = False) -> str | None:
    """The framework env's python, building it first if ``build``; None if it is not built."""
    if env is None:
        return sys.executable
    if build:
        subprocess.run(["bash", ENV_SCRIPT, env], check=True, stdout=subprocess.DEVNULL)
    d = subprocess.run(["bash", ENV_SCRIPT, "--path", env], check=True, capture_output=True,
                       text=True).stdout.strip()
    return os.path.join(d, "bin", "python") if os.path.exists(os.path.join(d, ".built")) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(fw: Framework, python: str, inputs: str, out: str, variant: str, workdir: str):
    """[(argv, extra environment)] to start: one launcher, or (TF) one process per worker."""
    script = [os.path.join(HERE, fw.script), "--inputs", inputs, "--out", out, "--variant", variant,
              *fw.args]
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if fw.launcher == "torchrun":
        if fw.env == "deepspeed":
            env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.path.join(
                os.path.dirname(os.path.dirname(python)), "torch_extensions"))
        return [([python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                  str(job.WORKERS), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1", *script], env)]
    if fw.launcher == "tf_config":     # TF has no launcher: one process per worker, TF_CONFIG each
        ports = [free_port() for _ in range(job.WORKERS)]
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        return [([python, *script], {**env, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": json.dumps(
                 {"cluster": cluster, "task": {"type": "worker", "index": i}})})
                for i in range(job.WORKERS)]
    if fw.launcher == "single":
        return [([python, *script], {**env, "TF_CPP_MIN_LOG_LEVEL": "2"})]
    if fw.launcher == "paddle":
        return [([python, "-m", "paddle.distributed.launch", "--host", "127.0.0.1", "--master",
                  f"127.0.0.1:{free_port()}", "--nproc_per_node", str(job.WORKERS), "--log_dir",
                  os.path.join(workdir, "paddle_log"), *script], env)]
    if fw.launcher == "horovodrun":    # runs the `python` first on PATH: the env's
        bindir = os.path.dirname(python)
        return [([os.path.join(bindir, "horovodrun"), "-np", str(job.WORKERS), "-H",
                  f"localhost:{job.WORKERS}", "--gloo", "--network-interfaces", "lo",
                  "python", *script], {**env, "PATH": bindir + os.pathsep + os.environ["PATH"]})]
    if fw.launcher in ("accelerate", "accelerate_cpu"):   # HF_HOME: no user config file is read
        mode = ["--multi_gpu", "--num_machines", "1", "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(free_port())] if fw.launcher == "accelerate" else ["--cpu"]
        return [([os.path.join(os.path.dirname(python), "accelerate"), "launch", *mode,
                  "--num_processes", str(job.WORKERS), "--mixed_precision", "no",
                  "--dynamo_backend", "no", *script],
                 {**env, "HF_HOME": os.path.join(workdir, "hf_home")})]
    raise ValueError(f"unknown launcher {fw.launcher!r}")


def _descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (launchers start workers in sessions of their own,
    so killing the launcher's process group is not enough)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _proc_addr(hexaddr: str) -> str:
    """'0100007F:1F90' (from /proc/net/tcp{,6}: 32-bit words in host order) -> '127.0.0.1:8080'."""
    ip, port = hexaddr.split(":")
    raw = b"".join(bytes.fromhex(ip[i:i + 8])[::-1] for i in range(0, len(ip), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return f"{addr}:{int(port, 16)}"


def listening(pids: list[int]) -> set[str]:
    """TCP addresses that the processes ``pids`` (and their children) listen on (Linux /proc)."""
    inodes = set()
    for pid in _descendants(pids):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:        # 0A: LISTEN
                out.add(_proc_addr(cols[1]))
    return out


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr.rsplit(":", 1)[0]).is_loopback


def listening_ok(fw: Framework, addrs) -> bool:
    """Loopback only, but for the ``fw.wildcard_ports`` servers its code binds on every interface."""
    wide = [a for a in addrs if not is_loopback(a)]
    return len(wide) <= fw.wildcard_ports and all(a.rsplit(":", 1)[0] in ("::", "0.0.0.0") for a in wide)


def _kill_all(procs) -> None:
    """SIGKILL each launcher, its process group, and everything it started; reap the launchers."""
    live = [p.pid for p in procs if p.poll() is None]   # a reaped pid may belong to someone else
    tree = _descendants(live) if live and os.path.isdir("/proc") else []
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


# a port picked by free_port() was taken by someone else before the launcher bound it
_PORT_LOST = ("RendezvousConnectionError", "Address already in use", "EADDRINUSE")


def launch(name: str | Framework, inputs: str, out: str, variant: str = "short",
           timeout: float = 300.0, build: bool = False, workdir: str | None = None) -> dict:
    """:func:`launch_once`, started once more (on new ports) if the first start lost its port
    before any training ran (no result written). Same arguments, result and errors."""
    try:
        return launch_once(name, inputs, out, variant, timeout, build, workdir)
    except RuntimeError as e:
        if not any(m in str(e) for m in _PORT_LOST):
            raise
        return launch_once(name, inputs, out, variant, timeout, build, workdir)


def launch_once(name: str | Framework, inputs: str, out: str, variant: str = "short",
                timeout: float = 300.0, build: bool = False, workdir: str | None = None) -> dict:
    """Run framework ``name``'s job; return its result (see job.load_result) plus ``launch_s``
    (seconds from start to exit) and ``listening`` (the TCP addresses its processes were seen
    listening on, sampled every 0.25 s).

    Raises EnvMissing if its env is not built (and not ``build``), RuntimeError with the
    launcher's output if it fails or runs past ``timeout`` seconds (the whole process group is
    killed: nothing is left behind).
    """
    fw = name if isinstance(name, Framework) else FRAMEWORKS[name]
    name = fw.name
    python = env_python(fw.env, build)
    if python is None:
        raise EnvMissing(f"{name}: the '{fw.env}' env is not built; run "
                                f"tools/framework-envs.sh {fw.env}")
    workdir = workdir or tempfile.mkdtemp(prefix=f"minidist-{name}-")
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(out):
        os.remove(out)
    procs, logs, t0 = [], [], time.perf_counter()
    for i, (argv, extra) in enumerate(commands(fw, python, inputs, out, variant, workdir)):
        log = open(os.path.join(workdir, f"launch{i}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(argv, env={**os.environ, **extra}, cwd=workdir, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    failed, heard = None, set()
    try:
        while any(p.poll() is None for p in procs):        # sample what the launch listens on
            if time.perf_counter() > t0 + timeout:
                failed = f"still running after {timeout:.0f} s"
                break
            if os.path.isdir("/proc"):
                heard |= listening([p.pid for p in procs if p.poll() is None])
            time.sleep(0.25)
        for p in procs:
            if p.returncode not in (0, None) and failed is None:
                failed = f"exit status {p.returncode}"
    finally:
        _kill_all(procs)                # the launchers and every worker they started
    seconds = time.perf_counter() - t0
    text = ""
    for log in logs:
        log.seek(0)
        text += log.read()
        log.close()
    if failed or not os.path.exists(out):
        raise RuntimeError(f"{name} ({variant}): {failed or 'no result file'}; output:\n{text[-4000:]}")
    result = job.load_result(out)
    result["launch_s"] = np.float64(seconds)
    result["listening"] = np.array(sorted(heard), dtype=str)
    return result


def compare(result: dict, reference: dict) -> dict:
    """Largest absolute differences: ``loss`` over all steps, ``weights`` over all parameters."""
    if result["losses"].shape != reference["losses"].shape:
        raise ValueError(f"{len(result['losses'])} losses, the reference has {len(reference['losses'])}")
    return {"loss": float(np.abs(result["losses"] - reference["losses"]).max()),
            "weights": max(float(np.abs(result[k] - reference[k]).max()) for k in job.WEIGHT_NAMES)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help=f"default: all of {', '.join(FRAMEWORKS)}")
    p.add_argument("--variant", choices=sorted(job.VARIANTS), action="append")
    p.add_argument("--build", action="store_true", help="build missing envs (minutes, GBs)")
    p.add_argument("--save", action="store_true", help=f"write the table to {RESULTS}")
    a = p.parse_args(argv)
    from reference import run_minidist   # the project's venv: torch + minidist
    work = tempfile.mkdtemp(prefix="minidist-frameworks-")
    inputs = job.make_inputs(os.path.join(work, "inputs.npz"))
    rows, ok = [], True
    for variant in a.variant or ["short", "long"]:
        losses, w = run_minidist(inputs, variant)
        ref = {"losses": np.asarray(losses), **w}
        for name in a.names or FRAMEWORKS:
            row = {"framework": name, "variant": variant}
            try:
                r = launch(name, inputs, os.path.join(work, f"{name}-{variant}.npz"), variant,
                           build=a.build, workdir=os.path.join(work, f"{name}-{variant}"))
            except EnvMissing as e:
                print(f"skipped: {e}")
                continue
            row.update(compare(r, ref), launch_s=round(float(r["launch_s"]), 1),
                       step_ms=round(1e3 * float(r["step_s"]), 2))
            row["equal"] = row["loss"] <= TOLERANCE and row["weights"] <= TOLERANCE
            row["listening"] = sorted(str(a) for a in r["listening"])
            row["listening_ok"] = listening_ok(FRAMEWORKS[name], r["listening"])
            ok &= row["equal"]
            rows.append(row)
            print(f"{name:18s} {variant:5s} loss {row['loss']:.1e} weights {row['weights']:.1e} "
                  f"launch {row['launch_s']:6.1f} s step {row['step_ms']:7.2f} ms "
                  f"{'✓' if row['equal'] else '✗ > %g' % TOLERANCE} listens on "
                  f"{sorted({a.rsplit(':', 1)[0] for a in row['listening']})}",
                  flush=True)
    if a.save:       # keeps what else the file records (machine, command, the traps chapter 10 shows)
        kept = {}
        if os.path.exists(RESULTS):
            with open(RESULTS) as f:
                kept = {k: v for k, v in json.load(f).items() if k not in ("tolerance", "rows")}
        with open(RESULTS, "w") as f:
            json.dump({"tolerance": TOLERANCE, "rows": rows, **kept}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
