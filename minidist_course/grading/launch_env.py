"""Grade exercise 08: read a launch environment, and diagnose broken launch logs.

* ``who_am_i(environ)`` → ``{"rank", "local_rank", "world_size", "local_world_size", "node_rank",
  "master_addr"}`` from torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  GROUP_RANK, MASTER_ADDR) or Slurm's (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID,
  SLURM_TASKS_PER_NODE, SLURM_JOB_NODELIST). torchrun's win when both are set (srun started one
  torchrun agent per node). ``SLURM_TASKS_PER_NODE`` lists the tasks of each node, compressed:
  ``"2(x2),1"`` is 2, 2, 1. The master address is MASTER_ADDR, else the first host of
  SLURM_JOB_NODELIST (``"gpu[07-08]"`` → ``gpu07``). Rank, local rank, world size, local world size and node
  rank are compared with :func:`minidist.env.detect` on the same variables, and every field with the
  answers below (:data:`ENV_CASES`).
* ``diagnose()`` → ``{log name: fix letter}`` for the three logs of :data:`LOGS`, fixes in
  :data:`FIXES`; a wrong choice is told what its log shows.
"""

from __future__ import annotations

from minidist.env import detect
from .core import Report
from .generated import generated_check, st

__all__ = ["ENV_CASES", "LOGS", "FIXES", "grade_who_am_i", "grade_diagnosis", "WHO_RULES",
           "DIAGNOSIS_RULES"]

WHO_RULES = {
    "ids": "rank, local rank and world size from the launcher's variables (RANK or SLURM_PROCID, "
           "LOCAL_RANK or SLURM_LOCALID, WORLD_SIZE or SLURM_NTASKS), as ints",
    "torchrun_first": "under srun + torchrun, torchrun's variables win over Slurm's",
    "local_world": "local_world_size is this node's entry of SLURM_TASKS_PER_NODE ('2(x2),1')",
    "node_rank": "node_rank is GROUP_RANK or SLURM_NODEID, not rank // tasks per node",
    "master": "MASTER_ADDR, else the first host of SLURM_JOB_NODELIST ('gpu[07-08]' is gpu07)",
}
DIAGNOSIS_RULES = {
    "interface": "log_1: the advertised address is docker0's: choose the interface (C)",
    "port": "log_2: EADDRINUSE: the port is taken (B)",
    "counts": "log_3: the nodes disagree on the processes per node (D)",
}
_FIELD_RULE = {"local_world_size": "local_world", "node_rank": "node_rank",
               "master_addr": "master"}

_TR = {"TORCHELASTIC_RUN_ID": "job42", "MASTER_PORT": "29500"}

# (description, environment, expected answer)
ENV_CASES = [
    ("torchrun, 1 node x 4", dict(_TR, RANK="2", LOCAL_RANK="2", WORLD_SIZE="4",
                                 LOCAL_WORLD_SIZE="4", GROUP_RANK="0", MASTER_ADDR="127.0.0.1"),
     dict(rank=2, local_rank=2, world_size=4, local_world_size=4, node_rank=0,
          master_addr="127.0.0.1")),
    ("torchrun, 2 nodes x 4, second node", dict(_TR, RANK="5", LOCAL_RANK="1", WORLD_SIZE="8",
                                               LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
                                               MASTER_ADDR="node01"),
     dict(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
          master_addr="node01")),
    ("srun, 2 nodes x 4 tasks", dict(SLURM_PROCID="6", SLURM_LOCALID="2", SLURM_NTASKS="8",
                                     SLURM_NODEID="1", SLURM_NNODES="2", SLURM_TASKS_PER_NODE="4(x2)",
                                     SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NODELIST="gpu[07-08]"),
     dict(rank=6, local_rank=2, world_size=8, local_world_size=4, node_rank=1, master_addr="gpu07")),
    ("srun, uneven: 3 + 2 tasks", dict(SLURM_PROCID="4", SLURM_LOCALID="1", SLURM_NTASKS="5",
                                       SLURM_NODEID="1", SLURM_NNODES="2",
                                       SLURM_TASKS_PER_NODE="3,2", SLURM_JOB_NODELIST="cn[1,5]"),
     dict(rank=4, local_rank=1, world_size=5, local_world_size=2, node_rank=1, master_addr="cn1")),
    ("srun, uneven: 2 + 2 + 1 tasks", dict(SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NTASKS="5",
                                           SLURM_NODEID="2", SLURM_NNODES="3",
                                           SLURM_TASKS_PER_NODE="2(x2),1",
                                           SLURM_JOB_NODELIST="a[01-03]"),
     dict(rank=4, local_rank=0, world_size=5, local_world_size=1, node_rank=2, master_addr="a01")),
    ("srun, uneven: 1 + 3 tasks", dict(SLURM_PROCID="3", SLURM_LOCALID="2", SLURM_NTASKS="4",
                                       SLURM_NODEID="1", SLURM_NNODES="2",
                                       SLURM_TASKS_PER_NODE="1,3", SLURM_JOB_NODELIST="n[1-2]"),
     dict(rank=3, local_rank=2, world_size=4, local_world_size=3, node_rank=1, master_addr="n1")),
    ("srun starts one torchrun per node (2 nodes x 2)",
     dict(_TR, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
          MASTER_ADDR="node03", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NTASKS="2",
          SLURM_NODEID="1", SLURM_NNODES="2", SLURM_TASKS_PER_NODE="1(x2)",
          SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NODELIST="node[03-04]"),
     dict(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
          master_addr="node03")),
]

_HINTS = {
    "rank": "torchrun's RANK wins over SLURM_PROCID (which numbers the srun tasks, here the agents)",
    "local_rank": "LOCAL_RANK (torchrun) or SLURM_LOCALID (srun): the index on this node",
    "node_rank": "GROUP_RANK (torchrun) or SLURM_NODEID — not rank // tasks per node when nodes "
                 "hold different numbers of tasks",
    "local_world_size": "LOCAL_WORLD_SIZE, or this node's entry of SLURM_TASKS_PER_NODE "
                        "('2(x2),1' is 2, 2, 1)",
    "master_addr": "MASTER_ADDR, else the first host of SLURM_JOB_NODELIST ('gpu[07-08]' → gpu07)",
}


def _check_env(fn, environ, want):
    got = fn(dict(environ))
    if not isinstance(got, dict):
        return "ids", f"who_am_i should return a dict, got {type(got).__name__}"
    d = detect(dict(environ))
    library = dict(rank=d.rank, local_rank=d.local_rank, world_size=d.world_size,
                   local_world_size=d.local_world_size, node_rank=d.node_rank)
    for key, value in want.items():
        if key in library and library[key] != value:  # the answer key and the library disagree
            raise AssertionError(f"grader: minidist.env.detect gives {key}={library[key]}, "
                                 f"the answer key {value}: report this")
        if got.get(key) != value:
            rule = _FIELD_RULE.get(key, "ids")
            if rule == "ids" and "RANK" in environ and "SLURM_PROCID" in environ:
                rule = "torchrun_first"
            return rule, f"{key}: expected {value!r}, got {got.get(key)!r} — {_HINTS.get(key, '')}"
    return None


def _tasks_per_node(tasks: list) -> str:
    """Slurm's compressed form: [2, 2, 1] -> '2(x2),1'."""
    out, i = [], 0
    while i < len(tasks):
        j = i
        while j < len(tasks) and tasks[j] == tasks[i]:
            j += 1
        out.append(f"{tasks[i]}(x{j - i})" if j - i > 1 else str(tasks[i]))
        i = j
    return ",".join(out)


def _allocation(draw):
    """A Slurm allocation and one task of it: (description, environment, expected answer)."""
    tasks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    prefix = draw(st.sampled_from(["gpu", "cn", "node", "a"]))
    width = draw(st.integers(1, 3))
    if draw(st.booleans()):                      # consecutive hosts: prefix[07-09]
        start = draw(st.integers(1, 20))
        numbers = list(range(start, start + len(tasks)))
        body = f"{numbers[0]:0{width}d}-{numbers[-1]:0{width}d}"
    else:                                        # a list: prefix[1,5,9]
        numbers = sorted(draw(st.sets(st.integers(1, 99), min_size=len(tasks), max_size=len(tasks))))
        body = ",".join(f"{n:0{width}d}" for n in numbers)
    nodelist = f"{prefix}{numbers[0]:0{width}d}" if len(tasks) == 1 else f"{prefix}[{body}]"
    rank = draw(st.integers(0, sum(tasks) - 1))
    node = next(i for i in range(len(tasks)) if rank < sum(tasks[:i + 1]))
    local = rank - sum(tasks[:node])
    environ = dict(SLURM_PROCID=str(rank), SLURM_LOCALID=str(local), SLURM_NTASKS=str(sum(tasks)),
                   SLURM_NODEID=str(node), SLURM_NNODES=str(len(tasks)),
                   SLURM_TASKS_PER_NODE=_tasks_per_node(tasks), SLURM_JOB_NODELIST=nodelist)
    if len(set(tasks)) == 1:
        environ["SLURM_NTASKS_PER_NODE"] = str(tasks[0])
    want = dict(rank=rank, local_rank=local, world_size=sum(tasks), local_world_size=tasks[node],
                node_rank=node, master_addr=f"{prefix}{numbers[0]:0{width}d}")
    return f"srun, tasks per node {tasks}, nodes {nodelist}, task {rank}", environ, want


ALLOCATIONS = st.composite(_allocation)()


def grade_who_am_i(fn, total: float = 6) -> Report:
    """``fn(environ)`` on :data:`ENV_CASES`."""
    report = Report("Part A: who am I?", total=total, rules=WHO_RULES, default_rule="ids")
    for name, environ, want in ENV_CASES:
        report.check(name, lambda e=environ, w=want: _check_env(fn, e, w))
    generated_check(report, "Slurm allocations of 1-5 nodes, 1-4 tasks each", ALLOCATIONS,
                    lambda c: _check_env(fn, c[1], c[2]), max_examples=80,
                    describe=lambda c: f"{c[0]} ({c[1]})")
    return report


# --------------------------------------------------------------------------- logs
LOGS = {
    "log_1": """\
[node02] torchrun --nnodes=2 --nproc-per-node=4 --rdzv-endpoint=node01:29500 train.py
[node02] [rank 5] RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error
[node02] [rank 5] Gloo connectFullMesh failed with [.../pair.cc:144] connect 172.17.0.1:41377: Connection refused
[node01] $ ip -brief addr
[node01] lo       UNKNOWN 127.0.0.1/8
[node01] docker0  UP      172.17.0.1/16
[node01] eth0     UP      10.0.0.11/24""",
    "log_2": """\
[node01] torchrun --nnodes=2 --nproc-per-node=4 --rdzv-endpoint=node01:29500 train.py
[node01] torch.distributed.DistNetworkError: The server socket has failed to listen on any local
[node01] network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message:
[node01] address already in use
[node01] $ ss -ltnp | grep 29500
[node01] LISTEN 0 4096 *:29500 *:* users:(("python",pid=81234))   # yesterday's job""",
    "log_3": """\
[node01] torchrun --nnodes=2 --nproc-per-node=4 --rdzv-endpoint=node01:29500 train.py
[node02] torchrun --nnodes=2 --nproc-per-node=2 --rdzv-endpoint=node01:29500 train.py
[node01] [rank 0] Waiting in store based barrier to initialize process group for rank: 0,
[node01]   key: store_based_barrier_key:1 (world_size=8, num_workers_joined=6, timeout=0:30:00)""",
}

FIXES = {
    "A": "set MASTER_ADDR (the rendezvous endpoint) to the first node's hostname, not localhost",
    "B": "pick a free MASTER_PORT (e.g. derived from the job id), or end the job still holding it",
    "C": "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface the nodes reach each "
         "other on (here eth0)",
    "D": "start every node with the same --nnodes and --nproc-per-node, so the ranks that join "
         "add up to the world size",
    "E": "pick the GPU with LOCAL_RANK, not RANK",
    "F": "raise the timeout: the other nodes are only slow to start",
}

_ANSWERS = {
    "log_1": ("C", "a worker advertised 172.17.0.1, docker0's address, which no other node can "
                   "reach: the interface is wrong"),
    "log_2": ("B", "EADDRINUSE on port 29500: another process (yesterday's job) still listens there"),
    "log_3": ("D", "6 of 8 workers joined: node02 starts 2 processes where node01 expects 4 each"),
}


def grade_diagnosis(fn, total: float = 3) -> Report:
    """``fn()`` → ``{"log_1": letter, ...}`` against the known fixes."""
    report = Report("Part B: diagnose the launch logs", total=total, rules=DIAGNOSIS_RULES)

    def one(log):
        got = fn()
        if not isinstance(got, dict):
            return f"diagnose() should return a dict {{log name: letter}}, got {got!r}"
        answer, why = _ANSWERS[log]
        choice = str(got.get(log, "")).strip().upper()
        if choice != answer:
            picked = f" ({FIXES[choice]})" if choice in FIXES else ""
            return f"{log}: you chose {choice or 'nothing'!r}{picked}; the log shows {why}"
        return None

    for log, rule in zip(LOGS, DIAGNOSIS_RULES):
        report.check(log, lambda lg=log: one(lg), rule=rule)
    return report
