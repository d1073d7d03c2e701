"""docker/: the compose cluster, its slurm.conf, the Dockerfiles and the README agree.

tests/integration/test_docker_build.py builds and runs these files with podman (root and apt only); this checks
the files against each other, everywhere and in a second: the controller and node hostnames in the
compose file are the SlurmctldHost / NodeNames of docker/slurm.conf, every path a container uses
exists in the repository under the mounted course folder, each CPU sbatch template asks for no more
nodes and cores than the compose cluster has, both Dockerfiles take the build arguments the README
documents (with compose passing them through, defaults equal), and JupyterLab is published on loopback.
"""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
TEMPLATES = sorted((ROOT / "course" / "multinode").glob("sbatch_*.sh"))


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DOCKER / "compose.yml").read_text())


def slurm_conf() -> dict:
    conf, nodes = {}, {}
    for line in (DOCKER / "slurm.conf").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(f.split("=", 1) for f in line.split())
        if "NodeName" in fields:
            nodes[fields["NodeName"]] = fields
        else:
            conf.update(fields)
    conf["nodes"] = nodes
    return conf


def sbatch_options(path: Path) -> dict:
    opts = {}
    for m in re.finditer(r"^#SBATCH\s+--([\w-]+)=(\S+)", path.read_text(), re.M):
        opts[m.group(1)] = m.group(2)
    return opts


def mount_of(service) -> tuple[Path, str]:
    """(host path relative to the repo, container path) of the course folder volume."""
    host, container = service["volumes"][0].split(":")[:2]
    return (DOCKER / host).resolve(), container


def in_repo(container_path: str, service) -> Path:
    host, container = mount_of(service)
    assert container_path.startswith(container + "/"), f"{container_path} is not under {container}"
    return host / container_path[len(container) + 1:]


def test_hostnames_match_slurm_conf(compose):
    conf, services = slurm_conf(), compose["services"]
    hosts = {name: s["hostname"] for name, s in services.items()}
    assert conf["SlurmctldHost"] in hosts.values()
    compute = {h for h in hosts.values() if h != conf["SlurmctldHost"]}
    assert compute == set(conf["nodes"]), "compose compute services and slurm.conf NodeNames differ"
    assert set(conf["Nodes"].split(",")) == compute, "the partition must hold both compute nodes"


def test_every_service_mounts_the_repository_and_finds_its_files(compose):
    for name, s in compose["services"].items():
        host, container = mount_of(s)
        assert host == ROOT, f"{name} must mount the repository root (the shared filesystem)"
        assert s["working_dir"] == container
        assert in_repo(s["environment"]["SLURM_CONF"], s) == DOCKER / "slurm.conf"
        entry = in_repo(s["command"][0], s)
        assert entry.exists() and entry.stat().st_mode & 0o111, f"{entry} missing or not executable"
        assert s["build"]["dockerfile"] in ("docker/Dockerfile.cpu",)
        assert (DOCKER / s["build"]["context"] / s["build"]["dockerfile"]).resolve().exists()


def test_the_image_provides_the_python_and_paths_the_templates_use(compose):
    dockerfile = (DOCKER / "Dockerfile.cpu").read_text()
    for s in compose["services"].values():
        python = s["environment"]["PYTHON"]
        venv = python.rsplit("/bin/", 1)[0]
        assert f"python -m venv {venv}" in dockerfile
    _, container = mount_of(next(iter(compose["services"].values())))
    assert f"WORKDIR {container}" in dockerfile
    for tpl in TEMPLATES:
        text = tpl.read_text()
        # templates find train.py relative to the submission folder (the mounted repository)
        rel = re.search(r"\$SLURM_SUBMIT_DIR/(\S+?)\}", text).group(1)
        assert (ROOT / rel).exists(), f"{tpl.name}: {rel} not in the repository"
        assert "${PYTHON:-" in text, f"{tpl.name} must take the interpreter from $PYTHON"


@pytest.mark.parametrize("template", [t for t in TEMPLATES if t.name.endswith("_cpu.sh")],
                         ids=lambda p: p.name)
def test_cpu_templates_fit_the_compose_cluster(template):
    conf, opts = slurm_conf(), sbatch_options(template)
    assert int(opts["nodes"]) <= len(conf["nodes"])
    per_node = int(opts["ntasks-per-node"]) * int(opts.get("cpus-per-task", 1))
    assert all(per_node <= int(n["CPUs"]) for n in conf["nodes"].values()), \
        f"{template.name} asks {per_node} CPUs per node"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_templates_explain_every_sbatch_line_and_never_mix_srun_with_many_torchrun_tasks(template):
    text = template.read_text()
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert "#" in line[len("#SBATCH"):], f"{template.name}: unexplained line {line!r}"
    opts = sbatch_options(template)
    if "torch.distributed.run" in text:  # failure case L4: srun x torchrun
        assert opts["ntasks-per-node"] == "1"
        assert "--rdzv_id=\"$SLURM_JOB_ID\"" in text and "--rdzv_backend=c10d" in text
    else:
        assert "MASTER_ADDR=" in text and "MASTER_PORT=" in text
    assert "--kill-on-bad-exit=1" in text


def test_gpu_templates_give_every_task_all_gpus_of_its_node():
    """cuda:LOCAL_RANK must exist: --gpus-per-task=1 alone would show each task one GPU as cuda:0."""
    for tpl in TEMPLATES:
        if tpl.name.endswith("_gpu.sh"):
            opts = sbatch_options(tpl)
            assert "gpus-per-node" in opts and "gpus-per-task" not in opts
            assert "--backend=nccl" in tpl.read_text()


DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]


def arg_defaults(dockerfile: Path) -> dict:
    return dict(m.groups() for m in re.finditer(r"^ARG (\w+)=(\S*)", dockerfile.read_text(), re.M))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_build_from_any_base_and_torch_index_with_the_tested_torch(dockerfile):
    text = dockerfile.read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim-bookworm", "ARG BASE_IMAGE must come before any FROM"
    assert [ln for ln in lines if ln.startswith("FROM")][-1] == "FROM ${BASE_IMAGE}"
    args = arg_defaults(dockerfile)
    index = {"Dockerfile.cpu": "https://download.pytorch.org/whl/cpu", "Dockerfile.cuda": "https://pypi.org/simple"}
    assert args["TORCH_INDEX_URL"] == index[dockerfile.name]
    tested = re.search(r"tested with (\d+\.\d+\.\d+)", (ROOT / "pyproject.toml").read_text()).group(1)
    assert args["TORCH_VERSION"] == tested, "pin torch to the version pyproject.toml says is tested"
    minor = int(tested.split(".")[1])
    assert args["TORCHVISION_VERSION"].startswith(f"0.{minor + 15}."), "torch 2.N pairs with torchvision 0.(N+15)"
    assert '--index-url "$TORCH_INDEX_URL"' in text and '"torch==$TORCH_VERSION"' in text
    run_lines = " ".join(ln for ln in lines if not ln.startswith("ARG"))
    assert "download.pytorch.org" not in run_lines, "the index comes only from TORCH_INDEX_URL"
    # a TLS-intercepting proxy: its CA certificates are trusted before pip runs
    assert args["EXTRA_CA_CERTS"] == "" and "update-ca-certificates" in text
    assert text.index("EXTRA_CA_CERTS\"") < text.index("pip install")
    assert "PIP_CERT=/etc/ssl/certs/ca-certificates.crt" in text


def test_compose_passes_the_build_arguments_with_the_dockerfile_defaults(compose):
    defaults = arg_defaults(DOCKER / "Dockerfile.cpu")
    for name, s in compose["services"].items():
        build_args = s["build"]["args"]
        assert set(build_args) >= {"BASE_IMAGE", "TORCH_INDEX_URL", "EXTRA_CA_CERTS"}, name
        for arg, value in build_args.items():
            m = re.fullmatch(r"\$\{(\w+):-(.*)\}", value)
            assert m and m.group(1) == arg, f"{name}: {arg} must come from the environment: {value}"
            assert m.group(2) == defaults[arg], f"{name}: {arg} default differs from Dockerfile.cpu's"


def test_readme_publishes_jupyterlab_on_loopback_only():
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in DOCKERFILES)
    publish = re.findall(r"(?:docker|podman) run [^\n]*?-p (\S+)", text)
    assert publish, "no run line with -p found"
    assert all(p.startswith("127.0.0.1:") for p in publish), publish
    assert "JUPYTER_TOKEN=" not in text.replace("-e JUPYTER_TOKEN=...", ""), "never publish a fixed token"
    assert "--NotebookApp.token=''" not in text and "--IdentityProvider.token=''" not in text
