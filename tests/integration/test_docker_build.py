"""docker/ built and run for real, with Debian's podman (issue 16).

The CPU image is built from docker/Dockerfile.cpu and must pass ``minidist demo`` (every line ✓),
serve JupyterLab on the host's loopback with token auth on (401/403 without the token), and, as the
three nodes of docker/compose.yml (podman-compose), run course/multinode/sbatch_torchrun_cpu.sh to
completion: world size 4, two workers on each of node1 and node2, identical parameters on every rank.
docker/Dockerfile.cuda is built too (run only where a GPU and podman's CDI spec for it exist).

No registry is used: tools/podman-setup.sh makes a Debian 12 base image with Python 3.11 from the apt
mirror (debootstrap + podman import; saved for a week under ~/.cache/minidist), and every build runs
with --pull=never and BASE_IMAGE set to it. torch: where pip's find-links hold a CPU torch wheel for
Python 3.11 (this project's CI machine has one), it goes in with --build-context wheels=DIR and
TORCH_VERSION set to it (~0.2 GB instead of PyPI's 6 GB CUDA build); torchvision then comes from
PyPI, whose build needs CUDA torch, so ``import torchvision`` fails in the test image (nothing
tested here uses it; the default build takes both from PyPI or the CPU index, where they match).
Without such a wheel both come from PyPI (``MINIDIST_TORCH_INDEX_URL`` names another index): the
CUDA build, about 6 GB, because PyTorch's CPU index is not a package registry every machine
reaches (this project's CI machine, since 2026-12-03, has neither the wheel nor that index).
The host's extra CA certificates (/usr/local/share/ca-certificates, e.g. a TLS-intercepting proxy's)
go in as EXTRA_CA_CERTS. Podman keeps its storage and networks in a folder of its own, emptied and
removed at the end, failure or not; the test checks that no container, image or network is left.

Needs root and apt-get (or podman installed) on Linux; otherwise skipped with the reason.
"""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "tools" / "podman-setup.sh"
STATE = Path(os.environ.get("MINIDIST_PODMAN_DIR", "/var/tmp/minidist-podman-test"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minidist"
BASE = "localhost/minidist-test/base:bookworm"
CPU = "localhost/minidist-test:cpu"
CUDA = "localhost/minidist-test:cuda"
PROJECT = "minidisttest"  # podman-compose project: containers PROJECT_<service>_1, network PROJECT_cluster

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3000)]


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "podman builds need Linux"
    if os.geteuid() != 0:
        return "rootful podman (overlay storage, bridge networks) needs root: run as root"
    if not shutil.which("podman") and not shutil.which("apt-get"):
        return "podman is not installed and apt-get is not available to install it"
    return None


def _env() -> dict:
    return dict(os.environ, CONTAINERS_CONF=str(STATE / "containers.conf"),
                CONTAINERS_STORAGE_CONF=str(STATE / "storage.conf"), MINIDIST_IMAGE=CPU)


def sh(*cmd, timeout: float = 120, check: bool = True, log: Path | None = None) -> subprocess.CompletedProcess:
    """Run cmd with the test's podman settings; on failure show its output (or the log's tail)."""
    out = open(log, "w") if log else subprocess.PIPE
    try:
        p = subprocess.run([str(c) for c in cmd], env=_env(), stdout=out, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout, cwd=ROOT)
    finally:
        if log:
            out.close()
    text = log.read_text(errors="replace") if log else p.stdout
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))[:300]} exited {p.returncode}:\n{text[-6000:]}")
    return p if not log else subprocess.CompletedProcess(p.args, p.returncode, text)


def _podman_lists() -> dict:
    return {"containers": sh("podman", "ps", "-a", "--format", "{{.Names}}").stdout.split(),
            "images": sh("podman", "images", "-a", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}").stdout.splitlines(),
            "networks": [n for n in sh("podman", "network", "ls", "--format", "{{.Name}}").stdout.split()
                         if n != "podman"]}  # podman's built-in default network is not a file of ours


def _remove_everything():
    """Every container, image and network in the test's own podman storage."""
    sh("podman-compose", "-p", PROJECT, "-f", "docker/compose.yml", "down", timeout=120, check=False)
    sh("podman", "rm", "-a", "-f", "-t", "2", timeout=120, check=False)
    for net in _podman_lists()["networks"]:
        sh("podman", "network", "rm", "-f", net, check=False)
    sh("podman", "rmi", "-a", "-f", timeout=300, check=False)


def _local_cpu_torch_wheel() -> Path | None:
    """The newest CPU torch wheel for CPython 3.11 in pip's find-links folders, if any."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    conf = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in conf.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip("'\"").split()
    wheels = [w for d in dirs if Path(d).is_dir()
              for w in Path(d).glob("torch-*+cpu-cp311-cp311-manylinux*_x86_64.whl")]
    version = lambda w: tuple(int(x) for x in re.findall(r"\d+", w.name.split("-")[1].split("+")[0]))
    return max(wheels, key=version) if wheels and os.uname().machine == "x86_64" else None


def _build_args() -> list[str]:
    """--build-arg/--build-context options shared by both images (see the module docstring)."""
    certs = sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt"))
    extra = os.environ.get("MINIDIST_EXTRA_CA_CERTS")  # a PEM file, for hosts that keep theirs elsewhere
    pem = "\n".join(p.read_text().strip() for p in certs + ([Path(extra)] if extra else []))
    args = ["--pull=never", "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", f"EXTRA_CA_CERTS={pem}"]
    wheel = _local_cpu_torch_wheel()
    if wheel:
        wheels = STATE / "wheels"
        wheels.mkdir(exist_ok=True)
        target = wheels / wheel.name
        if not target.exists():
            try:
                os.link(wheel, target)
            except OSError:
                shutil.copy(wheel, target)
        tv = wheel.name.split("-")[1].split("+")[0]              # e.g. 2.13.0
        minor = int(tv.split(".")[1])
        args += ["--build-context", f"wheels={wheels}",
                 "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple",  # torchvision and the rest
                 "--build-arg", f"TORCH_VERSION={tv}+cpu",
                 "--build-arg", f"TORCHVISION_VERSION=0.{minor + 15}.*"]  # torch 2.N <-> torchvision 0.(N+15)
    else:   # PyPI: reachable wherever this project's own install was (PyTorch's CPU index may not be)
        index = os.environ.get("MINIDIST_TORCH_INDEX_URL", "https://pypi.org/simple")
        args += ["--build-arg", f"TORCH_INDEX_URL={index}"]
    return args


def _size(image: str) -> str:
    return f"{int(sh('podman', 'image', 'inspect', '--format', '{{.Size}}', image).stdout) / 1e9:.2f} GB"


@pytest.fixture(scope="module")
def podman():
    reason = _why_not()
    if reason:
        print(f"SKIP test_docker_build: {reason}")
        pytest.skip(reason)
    t0 = time.monotonic()
    sh("bash", SETUP, "install", timeout=600)
    if STATE.exists():  # left by a run that was killed: empty it first
        sh("bash", SETUP, "conf", STATE)
        _remove_everything()
    sh("bash", SETUP, "conf", STATE)
    timings = {}
    try:
        sh("bash", SETUP, "base", BASE, CACHE, timeout=900)
        timings["base image"] = time.monotonic() - t0
        yield {"timings": timings, "build_args": _build_args()}
    finally:
        _remove_everything()
        left = _podman_lists()
        print(f"after clean-up: {left}")
        sh("podman", "system", "reset", "-f", timeout=120, check=False)
        shutil.rmtree(STATE, ignore_errors=True)
        print("timings:", ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
              f"| whole module {time.monotonic() - t0:.0f} s")
        assert left == {"containers": [], "images": [], "networks": []}, f"left behind: {left}"


@pytest.fixture(scope="module")
def cpu_image(podman):
    t0 = time.monotonic()
    sh("podman", "build", *podman["build_args"], "-f", "docker/Dockerfile.cpu", "-t", CPU, ".",
       timeout=1800, log=STATE / "build-cpu.log")
    podman["timings"]["cpu image build"] = time.monotonic() - t0
    print(f"{CPU}: {_size(CPU)}, built in {time.monotonic() - t0:.0f} s")
    return CPU


def test_minidist_demo_in_the_cpu_image_is_correct_on_every_line(cpu_image):
    p = sh("podman", "run", "--rm", cpu_image, "minidist", "demo", timeout=600, check=False)
    out = p.stdout
    assert p.returncode == 0, out[-4000:]
    marks = [line for line in out.splitlines() if "✓" in line or "✗" in line]
    assert all("✓" in line and "✗" not in line for line in marks), out
    m = re.search(r"^(\d+) of (\d+) checks correct", out, re.M)
    assert m and m.group(1) == m.group(2) == str(len(marks)), out[-2000:]
    assert len(marks) >= 30, f"only {len(marks)} checks ran:\n{out}"  # 37 today
    print(m.group(0))


def _get(url: str, token: str | None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_jupyterlab_answers_on_loopback_only_with_its_token(cpu_image):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, name = secrets.token_hex(16), f"{PROJECT}-jupyter"
    # the README's run line: the default command, published on the host's loopback, token on
    sh("podman", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8888",
       "-e", f"JUPYTER_TOKEN={token}", cpu_image)
    try:
        url, deadline, status = f"http://127.0.0.1:{port}/api/status", time.monotonic() + 180, None
        while time.monotonic() < deadline:
            try:
                status, body = _get(url, token)
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        logs = sh("podman", "logs", name, check=False).stdout
        assert status == 200, f"JupyterLab did not answer in 180 s:\n{logs[-3000:]}"
        assert "started" in json.loads(body)
        assert _get(url, None)[0] in (401, 403), "the API must refuse a request without the token"
        assert _get(url, "wrong-" + token)[0] in (401, 403)
        ports = sh("podman", "port", name).stdout.split()
        assert ports == ["8888/tcp", "->", f"127.0.0.1:{port}"], ports  # loopback only
    finally:
        sh("podman", "rm", "-f", "-t", "2", name, check=False)


def test_compose_cluster_runs_the_torchrun_sbatch_template_over_both_nodes(cpu_image):
    compose = ["podman-compose", "-p", PROJECT, "-f", "docker/compose.yml"]
    ctl = f"{PROJECT}_slurmctld_1"
    runs = ROOT / "runs" / f"docker-test-{os.getpid()}"  # the compose cluster shares the repository
    runs.mkdir(parents=True, exist_ok=True)
    try:
        sh(*compose, "up", "-d", "--no-build", timeout=300)
        deadline, nodes = time.monotonic() + 180, ""
        while time.monotonic() < deadline:  # slurmd may miss slurmctld once at start-up, then retries
            nodes = sh("podman", "exec", ctl, "sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            if sorted(nodes.split()) == ["idle", "idle", "node1", "node2"]:
                break
            time.sleep(2)
        else:
            pytest.fail(f"compute nodes not idle after 180 s: {nodes!r}\n{_cluster_logs(compose)}")
        rel = runs.relative_to(ROOT)
        jid = sh("podman", "exec", "-w", "/course", "-e", f"OUT=/course/{rel}/out", "-e", "TRAIN_ARGS=--epochs=2",
                 ctl, "sbatch", "--parsable", f"--chdir=/course/{rel}",
                 "course/multinode/sbatch_torchrun_cpu.sh").stdout.strip()
        t0, deadline = time.monotonic(), time.monotonic() + 300
        while time.monotonic() < deadline:
            if not sh("podman", "exec", ctl, "squeue", "-h", "-j", jid, check=False).stdout.strip():
                break
            time.sleep(1)
        else:
            sh("podman", "exec", ctl, "scancel", jid, check=False)
            pytest.fail(f"job {jid} still running after 300 s\n{_cluster_logs(compose)}")
        show = sh("podman", "exec", ctl, "scontrol", "show", "job", jid).stdout
        log = "\n".join(p.read_text(errors="replace") for p in runs.glob(f"*-{jid}.out"))
        assert "JobState=COMPLETED" in show, f"{show}\n{log[-4000:]}\n{_cluster_logs(compose)}"
        print(f"sbatch job {jid} COMPLETED in {time.monotonic() - t0:.0f} s")
        ranks = sorted((json.loads(p.read_text()) for p in (runs / "out").glob("rank*.json")),
                       key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3], log[-4000:]
        assert {r["world_size"] for r in ranks} == {4}
        assert {r["hostname"] for r in ranks} == {"node1", "node2"}
        assert sorted((r["node_rank"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert {r["launcher"] for r in ranks} == {"torchrun"}
        assert len({r["params_sha256"] for r in ranks}) == 1, "replicas differ after training"
        assert ranks[0]["accuracy"] > 0.5  # 2 epochs: ~0.78 (chance 0.1)
    finally:
        sh(*compose, "down", timeout=120, check=False)
        sh("podman", "network", "rm", "-f", f"{PROJECT}_cluster", check=False)  # podman-compose 1.0.3 keeps it
        shutil.rmtree(runs, ignore_errors=True)


def _cluster_logs(compose) -> str:
    out = []
    for svc in ("slurmctld", "node1", "node2"):
        name = f"{PROJECT}_{svc}_1"
        out.append(f"== {name}\n" + sh("podman", "logs", "--tail", "20", name, check=False).stdout)
        log = "slurmctld" if svc == "slurmctld" else "slurmd"
        out.append(sh("podman", "exec", name, "tail", "-20", f"/var/log/{log}.log", check=False).stdout)
    return "\n".join(out)


def test_cuda_image_builds(podman):
    t0 = time.monotonic()
    sh("podman", "build", *podman["build_args"], "-f", "docker/Dockerfile.cuda", "-t", CUDA, ".",
       timeout=1800, log=STATE / "build-cuda.log")
    podman["timings"]["cuda image build"] = time.monotonic() - t0
    print(f"{CUDA}: {_size(CUDA)}, built in {time.monotonic() - t0:.0f} s")
    p = sh("podman", "run", "--rm", CUDA, "python", "-c", "import minidist, torch; print(torch.__version__)")
    assert p.stdout.strip(), p.stdout
    gpu = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    cdi = any(Path(d).glob("nvidia*.yaml") for d in ("/etc/cdi", "/var/run/cdi") if Path(d).is_dir())
    if not (gpu and cdi):
        print("no GPU with a CDI spec (nvidia-ctk cdi generate): the CUDA image was built, not run on a GPU")
        return
    # with a GPU: the image's own default torch (PyPI's CUDA build), then torch sees the GPU
    sh("podman", "build", *podman["build_args"][:5], "-f", "docker/Dockerfile.cuda", "-t", CUDA, ".",
       timeout=1800, log=STATE / "build-cuda-gpu.log")  # [:5]: --pull=never, BASE_IMAGE, EXTRA_CA_CERTS
    sh("podman", "run", "--rm", "--device", "nvidia.com/gpu=all", "--ipc=host", CUDA, "python", "-c",
       "import torch; assert torch.cuda.is_available(), 'no GPU in the container'; print(torch.cuda.get_device_name())",
       timeout=300)
