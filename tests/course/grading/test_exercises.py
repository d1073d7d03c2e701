"""Exercises: generated from solutions/ (one source of truth), failing when run unmodified, and the
solutions passing. Parametrised over every solutions/*.ipynb, so new chapters are picked up."""

import json
from pathlib import Path

import pytest

import _solutions
from minidist_course import exercises

ROOT = Path(__file__).resolve().parents[3]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds; grading turns a learner's deadlock into a failed check well before


def _grade_cells(nb):
    return [c for c in nb.cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]


def _execute(path: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     allow_errors=True, resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def _errors(cell):
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def test_there_are_solutions():
    assert SOLUTIONS, "no solutions/*.ipynb found"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_is_up_to_date(solution):
    expected = exercises.render(exercises.strip_solutions(json.loads(solution.read_text()),
                                                          str(solution)))
    target = ROOT / "exercises" / solution.name
    assert target.exists(), f"{target} missing: run `python -m minidist_course.exercises`"
    assert target.read_text() == expected, \
        f"{target.name} is out of date: run `python -m minidist_course.exercises`"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_unmodified_exercise_fails_every_grading_cell_in_this_process(solution):
    """Every grading cell of the exercise as shipped, run on its unfilled cells: the grader says no
    (AssertionError), not a NameError or a typo in the grading cell. The default tier's version of
    the next test: no kernel per notebook (each took 6-15 s, 2.5 minutes together)."""
    name = solution.name
    ns = _solutions.load(name, folder="exercises")
    graded = _solutions.grading_cells(name, folder="exercises")
    assert graded, f"{name}: no nbgrader grading cells"
    for gid in graded:
        text, error = _solutions.grade(name, gid, ns, folder="exercises")
        assert error is not None, f"{name}: grading cell {gid} passed on the unmodified exercise:\n{text}"


@pytest.mark.exhaustive   # a kernel per notebook, as a learner runs it: the integration tier
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_unmodified_exercise_fails_every_grading_cell(solution):
    nb = _execute(ROOT / "exercises" / solution.name)
    graded = _grade_cells(nb)
    assert graded, f"{solution.name}: no nbgrader grading cells"
    for cell in graded:
        errs = _errors(cell)
        gid = cell.metadata["nbgrader"]["grade_id"]
        assert errs, f"{solution.name}: grading cell {gid} passed on the unmodified exercise"
        # the grader ran and said no (not a NameError or a typo in the grading cell)
        assert errs[0].ename == "AssertionError", (gid, errs[0].ename, errs[0].evalue)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes_every_grading_cell(solution):
    """Every grading cell run now on the solution's code gives a full score (in this process), and
    the stored run shows it: no cell raised, every grading cell printed a full score.

    The integration tier also executes every solution under nbval (``testpaths`` holds
    solutions/; tests/conftest.py tiers them), where a changed printed score fails the output
    comparison."""
    ns = _solutions.load(solution.name)
    for gid in _solutions.grading_cells(solution.name):
        text, error = _solutions.grade(solution.name, gid, ns)
        assert error is None and "score:" in text and "✗" not in text, f"{gid}:\n{text}"
    nb = json.loads(solution.read_text())
    graded = [c for c in nb["cells"] if c["cell_type"] == "code"
              and c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    assert graded, f"{solution.name}: no nbgrader grading cells"
    for i, cell in enumerate(nb["cells"]):
        errs = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errs, f"{solution.name} cell {i}: {errs[0]['ename']}: {errs[0]['evalue']}" if errs else ""
    for cell in graded:
        text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                       if o.get("output_type") == "stream")
        assert "score:" in text and "✗" not in text, text


# --------------------------------------------------------------------------- the generator itself
def _nb(*cells):
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _code(src, **meta):
    return {"cell_type": "code", "source": src, "metadata": meta, "outputs": [{"x": 1}],
            "execution_count": 3}


def test_strip_solutions_code_markdown_hidden():
    nb = _nb(_code("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    y = x * 2\n    ### END SOLUTION\n"
                   "    return y", nbgrader={"solution": True}),
             {"cell_type": "markdown", "metadata": {},
              "source": "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"},
             _code("assert f(2) == 4\n### BEGIN HIDDEN TESTS\nassert f(3) == 6\n### END HIDDEN TESTS"))
    out = exercises.strip_solutions(nb)
    code, mdc, test = out["cells"]
    assert "".join(code["source"]) == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n"
                                       "    raise NotImplementedError()\n    return y")
    assert code["outputs"] == [] and code["execution_count"] is None
    assert code["metadata"] == {"nbgrader": {"solution": True}}
    assert "".join(mdc["source"]) == "Why?\nYOUR ANSWER HERE"
    assert "".join(test["source"]) == "assert f(2) == 4"
    assert nb["cells"][0]["outputs"] == [{"x": 1}]  # the input is not modified


@pytest.mark.parametrize("src,match", [
    ("### BEGIN SOLUTION\nx = 1", "without its END"),
    ("x = 1\n### END SOLUTION", "unbalanced"),
    ("x = 1", "no '### BEGIN SOLUTION'"),
])
def test_bad_markers_are_errors(src, match):
    with pytest.raises(exercises.ExerciseError, match=match):
        exercises.strip_solutions(_nb(_code(src)))


def test_check_mode_exit_codes(tmp_path, capsys):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    (sol / "a.ipynb").write_text(json.dumps(_nb(_code("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))))
    args = ["--solutions", str(sol), "--exercises", str(ex)]
    assert exercises.main(args + ["--check"]) == 1
    assert "a.ipynb" in capsys.readouterr().err
    assert not ex.exists()  # --check never writes
    assert exercises.main(args) == 0
    assert exercises.main(args + ["--check"]) == 0
    (sol / "a.ipynb").write_text(json.dumps(_nb(_code("y = 0\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))))
    assert exercises.main(args + ["--check"]) == 1
    (sol / "a.ipynb").write_text(json.dumps(_nb(_code("x = 1"))))
    assert exercises.main(args) == 2  # no solution block: an error, not an identical "exercise"


# --------------------------------------------------------------------------- graders reject wrong work
# One plausible wrong solution per rule each exercise teaches, injected into the solution's code
# (tests/_solutions.py): the grader must reject it, and say what is wrong.
import time  # noqa: E402

import torch  # noqa: E402

from minidist_course import grading  # noqa: E402


def _rejects(name, grade_id, replace, *needles, timeout=None):
    ns = _solutions.load(name, replace)
    text, error = _solutions.grade(name, grade_id, ns, timeout=timeout)
    assert error is not None, f"{name}/{grade_id} accepted a wrong solution:\n{text}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in the grader's report:\n{text}"
    return text


def test_ex00_rejects_each_slip():
    ns = _solutions.load("00_memory_and_time.ipynb")
    no_master = lambda mixed: {"weights": 2, "grads": 2, "optimizer": 8} if mixed else \
        ns["bytes_per_param"](False)  # noqa: E731
    rep = grading.walls.grade_bytes_per_param(no_master)
    assert not rep.passed and "mixed precision optimizer: expected 12, got 8" in str(rep)
    rep = grading.walls.grade_training_memory(lambda p, m: p * 12 if m else p * 16)
    assert not rep.passed and "master copy of the weights" in str(rep)
    rep = grading.walls.grade_flops_and_days(lambda n, d: 2 * n * d, ns["training_days"])
    assert not rep.passed and "forward pass only" in str(rep)
    seconds = lambda *a: ns["training_days"](*a) * 86400  # noqa: E731
    rep = grading.walls.grade_flops_and_days(ns["training_flops"], seconds)
    assert not rep.passed and "seconds, not days" in str(rep)
    no_mfu = lambda n, d, g, peak, mfu: ns["training_flops"](n, d) / (g * peak) / 86400  # noqa
    assert not grading.walls.grade_flops_and_days(ns["training_flops"], no_mfu).passed


def test_ex01_deadlocking_shift_fails_in_about_one_timeout():
    t0 = time.monotonic()
    text = _rejects("01_token_ring.ipynb", "shift_right_grade", {"shift_right": '''
def shift_right(x, rank, world_size):
    received = torch.empty_like(x)
    p2p.send(x, (rank + 1) % world_size)
    p2p.recv(received, (rank - 1) % world_size)
    return received
'''}, "timed out", "not run: ", "score: 0/3", timeout=6)   # the cell's 20 s, shortened
    assert time.monotonic() - t0 < 6 + 20, text  # one timeout, not twelve
    _rejects("01_token_ring.ipynb", "shift_right_grade", {"shift_right": '''
def shift_right(x, rank, world_size):  # sends left instead of right
    received = torch.empty_like(x)
    if world_size == 1:
        return x.clone()
    p2p.wait_all([p2p.irecv(received, (rank + 1) % world_size), p2p.isend(x, (rank - 1) % world_size)])
    return received
'''}, "expected", "received")


def test_ex02_rejects_a_torch_collective_and_a_wrong_root():
    ns = _solutions.load("02_collectives_by_composition.ipynb")

    def all_gather_by_torch(chunks, rank, world_size):
        import torch.distributed as dist
        out = [torch.empty_like(c) for c in chunks]
        dist.all_gather(out, chunks[rank].contiguous()) if all(
            c.numel() == chunks[0].numel() for c in chunks) else None
        for c, o in zip(chunks, out):
            c.copy_(o)
    rep = grading.composition.grade_composed(all_gather_by_torch, "all_gather", total=3)
    assert not rep.passed and "called dist.all_gather" in str(rep), str(rep)

    def reduce_to_zero(chunks, rank, world_size):
        import torch.distributed as dist
        for j in range(world_size):
            dist.reduce(chunks[j], dst=0)
    rep = grading.composition.grade_composed(reduce_to_zero, "reduce_scatter", total=3)
    assert not rep.passed and "expected" in str(rep), str(rep)
    wrong = lambda op, w: 2 * (w - 1) / w if op != "broadcast" else 1.0  # noqa: E731
    rep = grading.composition.grade_busbw_factor(wrong)
    assert not rep.passed and "all_gather, W=2: expected 0.5" in str(rep)
    assert grading.composition.grade_busbw_factor(ns["busbw_factor"]).passed


def test_ex03_part_c_blames_part_a():
    replace = {"ring_reduce_scatter": '''
def ring_reduce_scatter(chunks, rank, world_size):
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 2):   # one step short
        incoming = torch.empty_like(chunks[(rank - step - 2) % world_size])
        p2p.exchange(chunks[(rank - step - 1) % world_size], right, incoming, left)
        chunks[(rank - step - 2) % world_size] += incoming
'''}
    ns = _solutions.load("03_ring_allreduce.ipynb", replace)
    rep = grading.grade_collective(ns["ring_all_reduce"], "all_reduce", traffic="ring",
                                   world_sizes=(3,), sizes=(10,), total=3,
                                   requires={"reduce_scatter": ns["ring_reduce_scatter"],
                                             "all_gather": ns["ring_all_gather"]})
    assert rep.notes[0].startswith("fails because ring_reduce_scatter fails"), str(rep)
    assert "holds ranks" in str(rep) and "missing" in str(rep)


_EX04 = "04_bucketed_ddp.ipynb"


def test_ex04_feedback_names_the_bug():
    """Part B blames Part A when build_buckets is wrong; a missing wait is called a missing wait
    (not a per-step reset); a missing division gives the ratio W and the bucket."""
    empty_bucket = {"build_buckets": _solutions_cell(_EX04, "build_buckets").replace(
        "if current and size + nbytes > cap_bytes:", "if size + nbytes > cap_bytes:")}
    ns = _solutions.load(_EX04, empty_bucket)
    rep = grading.grade_ddp(ns["MyDDP"])
    assert rep.notes and rep.notes[0].startswith("fails because build_buckets (Part A) fails"), \
        str(rep)
    assert "an empty bucket" in rep.notes[0] and "fix Part A first" in str(rep)
    ns = _solutions.load(_EX04, {"my_ddp": _solutions_cell(_EX04, "my_ddp").replace(
        "            work.wait()\n", "").replace("buf.div_(self.world_size)", "buf.div_(1)")})
    text = str(grading.grade_ddp(ns["MyDDP"]))
    assert "never waited" in text and "reset it in sync_gradients" not in text, text


def _solutions_cell(name, grade_id):
    nb = json.loads((ROOT / "solutions" / name).read_text())
    return next("".join(c["source"]) for c in nb["cells"]
                if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id)


def test_ex05_rejects_no_padding_no_epoch_and_double_counting():
    ns = _solutions.load("05_sampler_and_evaluation.ipynb")
    exec('''
class NoPadding(MySampler):
    def __iter__(self):
        return iter(list(MySampler.__iter__(self))[: len(range(self.rank, self.n, self.num_replicas))])
    def __len__(self):
        return len(range(self.rank, self.n, self.num_replicas))

class IgnoresEpoch(MySampler):
    def set_epoch(self, epoch):
        pass

class PadsOnce(MySampler):     # order += order[:pad]: too short when the padding exceeds n
    def __iter__(self):
        order = list(range(self.n))
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(
                self.seed + self.epoch)).tolist()
        order += order[:self.total_size - len(order)]
        return iter(order[self.rank: self.total_size: self.num_replicas])

def padded_evaluation(model, x, y, rank, world_size):
    idx = list(MySampler(len(x), world_size, rank, shuffle=False))   # the training sampler
    with torch.no_grad():
        logits = model(x[idx])
    t = torch.tensor([float((logits.argmax(1) == y[idx]).sum()), float(len(idx)),
                      float(F.cross_entropy(logits, y[idx], reduction="sum"))], dtype=torch.float64)
    dist.all_reduce(t)
    return int(t[0]), int(t[1]), float(t[2])
''', ns)
    rep = grading.sampling.grade_sampler(ns["NoPadding"])
    assert not rep.passed and "every rank takes the same number of steps" in str(rep)
    rep = grading.sampling.grade_sampler(ns["IgnoresEpoch"])
    assert not rep.passed and "epoch 0's order again" in str(rep), str(rep)
    rep = grading.sampling.grade_sampler(ns["PadsOnce"])
    failed = [r for r in rep.results if not r.passed]
    assert failed and "n=1, W=4" in failed[0].name and "[pad]" in failed[0].message, str(rep)
    assert "repeat the order as often as needed" in str(rep) and "hangs" in str(rep), str(rep)
    rep = grading.sampling.grade_evaluation(ns["padded_evaluation"])
    assert not rep.passed and "counted twice" in str(rep), str(rep)


def test_ex05_rank_without_samples_that_skips_the_all_reduce_is_a_failed_check():
    ns = _solutions.load("05_sampler_and_evaluation.ipynb")
    exec('''
def skips_when_empty(model, x, y, rank, world_size):
    if rank >= len(x):
        return 0, 0, 0.0      # no samples: returns without joining the all-reduce
    return evaluate_exact(model, x, y, rank, world_size)
''', ns)
    rep = grading.sampling.grade_evaluation(ns["skips_when_empty"], timeout=8)
    assert [r.passed for r in rep.results] == [True] * 4 + [False], str(rep)
    # the others either wait for it (a timeout) or see it gone: the launcher names the rank
    # that returned without the all-reduce the others were in
    assert ("timed out" in rep.results[-1].message
            or "rank 3 returned from the function after 0 collective(s)" in rep.results[-1].message
            ), str(rep)


def test_ex08_rejects_slurm_rank_under_torchrun_division_and_wrong_fix():
    ns = _solutions.load("08_launch_environment.ipynb")
    exec('''
def slurm_first(environ):
    if "SLURM_PROCID" in environ:
        environ = {k: v for k, v in environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD", "GROUP", "MASTER", "TORCH"))}
    return who_am_i(environ)

def divides(environ):
    out = who_am_i(environ)
    if "SLURM_NTASKS" in environ and "RANK" not in environ:
        out["node_rank"] = out["rank"] // out["local_world_size"]
    return out
''', ns)
    rep = grading.launch_env.grade_who_am_i(ns["slurm_first"])
    assert not rep.passed and "torchrun's RANK wins over SLURM_PROCID" in str(rep), str(rep)
    rep = grading.launch_env.grade_who_am_i(ns["divides"])
    assert not rep.passed and "not rank // tasks per node" in str(rep), str(rep)
    rep = grading.launch_env.grade_diagnosis(lambda: {"log_1": "A", "log_2": "B", "log_3": "F"})
    text = str(rep)
    assert "log_1: you chose 'A'" in text and "docker0" in text and "log_3" in text
    assert rep.score == 1 and rep.max_score == 3


def test_ex06_rejects_f_without_all_reduce_and_bias_added_on_every_rank():
    _rejects("06_tensor_parallel.ipynb", "f_and_g_grade", {"f_and_g": '''
class CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        return grad                      # forgot the all-reduce

class ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return collectives.all_reduce(x.clone(), "sum")
    @staticmethod
    def backward(ctx, grad):
        return grad

def copy_to_region(x):
    return CopyToRegion.apply(x)

def reduce_from_region(x):
    return ReduceFromRegion.apply(x)
'''}, "x.grad after f", "expected")


def test_ex07_rejects_a_warm_up_one_too_long():
    _rejects("07_one_f_one_b.ipynb", "one_f_one_b_grade", {"one_f_one_b": '''
def my_one_f_one_b(P, M):
    ops = []
    for r in range(P):
        w = min(P - r, M)                 # one forward too many in the warm-up
        row = [Op("F", m, r) for m in range(w)]
        for i in range(M - w):
            row += [Op("F", w + i, r), Op("B", i, r)]
        row += [Op("B", m, r) for m in range(M - w, M)]
        ops.append(tuple(row))
    return Schedule("my 1f1b", P, M, 1, tuple(ops))
'''}, "peak micro-batches in flight")


_ZB_HEAD = """
def my_zb_h1(P, M):
    base = my_one_f_one_b(P, M)
    ops = []
    for r in range(P):
        row, waiting, n_b = [], [], 0
        for op in base.ops[r]:
"""


def test_ex07_zb_h1_rejects_misplaced_w_ops_naming_the_op():
    # W right after its B: valid, same memory, but the W no longer fill the bubble
    _rejects("07_one_f_one_b.ipynb", "zb_h1_grade", {"zb_h1": _ZB_HEAD + """
            row.append(op)
            if op.kind == "B":
                row.append(Op("W", op.mb, op.stage))
        ops.append(tuple(row))
    return Schedule("my zb-h1", P, M, 1, tuple(ops))
"""}, "P=2, M=2: the step takes 8 units", "ZB-H1 7",
        "rank 1: W0@s1 runs after B0@s1; ZB-H1 runs it after B1@s1")
    # W before its B: the schedule checker refuses it, naming the op
    _rejects("07_one_f_one_b.ipynb", "zb_h1_grade", {"zb_h1": _ZB_HEAD + """
            if op.kind == "B":
                row.append(Op("W", op.mb, op.stage))
            row.append(op)
        ops.append(tuple(row))
    return Schedule("my zb-h1", P, M, 1, tuple(ops))
"""}, "W0@s0 (weight gradient) comes before its B0@s0")
    # W lagging one backward too many: holds more than 1F1B's peak
    _rejects("07_one_f_one_b.ipynb", "zb_h1_grade", {"zb_h1": _ZB_HEAD + """
            row.append(op)
            if op.kind == "B":
                n_b += 1
                waiting.append(Op("W", op.mb, op.stage))
                if n_b > r + 1:
                    row.append(waiting.pop(0))
        ops.append(tuple(row + waiting))
    return Schedule("my zb-h1", P, M, 1, tuple(ops))
"""}, "micro-batches are in flight, 1F1B's peak is min(P, M) = 4", "must run before")
    # no W at all: each B would be the fused backward, which is not ZB-H1
    _rejects("07_one_f_one_b.ipynb", "zb_h1_grade", {"zb_h1": _ZB_HEAD + """
            row.append(op)
        ops.append(tuple(row))
    return Schedule("my zb-h1", P, M, 1, tuple(ops))
"""}, "no W0@s0: every backward is split")
    # the newest waiting W first (a learner's attempt that scored 3/3: same time and count)
    _rejects("07_one_f_one_b.ipynb", "zb_h1_grade", {"zb_h1": _ZB_HEAD + """
            row.append(op)
            if op.kind == "B":
                n_b += 1
                waiting.append(Op("W", op.mb, op.stage))
                if n_b > r:
                    row.append(waiting.pop(0))
        ops.append(tuple(row + waiting[::-1]))
    return Schedule("my zb-h1", P, M, 1, tuple(ops))
"""}, "the W ops run oldest first")


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_text_points_and_printed_score_agree(solution):
    """The part's heading says "(N points)", nbgrader's metadata gives N, and the grading cell's
    stored output ends with "score: N/N" — the same number in all three places."""
    import re
    nb = json.loads(solution.read_text())
    heading_points = None
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and (m := re.search(r"^## .*\((\d+) points?\)", src, re.M)):
            heading_points = float(m.group(1))
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell["cell_type"] == "code" and meta.get("grade"):
            gid = meta["grade_id"]
            text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
            scores = re.findall(r"score: ([\d.]+)/([\d.]+)", text)
            assert scores, f"{gid}: no printed score stored (re-execute the solution)"
            assert float(scores[-1][1]) == meta["points"], (gid, scores, meta["points"])
            assert heading_points == meta["points"], (gid, heading_points, meta["points"])


def test_ex01_rejects_a_token_that_adds_the_rank_and_a_ring_sum_one_shift_short():
    _rejects("01_token_ring.ipynb", "token_ring_grade", {"token_ring": '''
def token_ring(rank, world_size, laps):
    token = torch.zeros(1)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for _ in range(laps):
        if rank == 0:
            token += 1
            if world_size > 1:
                p2p.send(token, right)
                p2p.recv(token, left)
        else:
            p2p.recv(token, left)
            token += rank                 # should add rank + 1
            p2p.send(token, right)
    return token
'''}, "token[0]: expected", "score: 0.5/2")
    text = _rejects("01_token_ring.ipynb", "ring_sum_grade", {"ring_sum": '''
def ring_sum(x, rank, world_size):
    passing = x.clone()
    for _ in range(world_size - 2):      # one shift short
        passing = shift_right(passing, rank, world_size)
        x += passing
    return x
'''}, "holds ranks", "missing")
    assert "ring taught above" not in text  # ex01's ring_sum is not chapter 03's chunked ring


def test_ex06_rejects_a_row_parallel_bias_added_on_every_rank():
    ns_src = _solutions.load("06_tensor_parallel.ipynb")  # noqa: F841 (checks the notebook loads)
    _rejects("06_tensor_parallel.ipynb", "column_row_grade", {"column_row": '''
class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        full = nn.Linear(in_features, out_features)
        self.weight = nn.Parameter(full.weight.data.chunk(world_size, 0)[rank].clone())
        self.bias = nn.Parameter(full.bias.data.chunk(world_size, 0)[rank].clone())

    def forward(self, x):
        return F.linear(copy_to_region(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        full = nn.Linear(in_features, out_features)
        self.weight = nn.Parameter(full.weight.data.chunk(world_size, 1)[rank].clone())
        self.bias = nn.Parameter(full.bias.data.clone())

    def forward(self, x_shard):
        return reduce_from_region(F.linear(x_shard, self.weight, self.bias))   # bias W times
'''}, "bias added once?", "✓ ColumnParallelLinear (world size 4)")


def test_ex07_rejects_an_engine_run_on_the_whole_model():
    _rejects("07_one_f_one_b.ipynb", "run_on_engine_grade", {"run_on_engine": '''
def pipeline_rank(rank, world_size, M):
    model = make_model()
    x, y = make_batch()
    loss = nn.functional.mse_loss(model(x), y)     # no pipeline: every rank runs everything
    loss.backward()
    modules = {0: model}
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}
'''}, "keep only this rank's stages", "✓ 1F1B M=3 equals one process (world size 1)")


def test_ex10_rejects_stage3_as_zero2_a_true_loss_and_clipping_that_scales_up():
    from minidist_course.grading import frameworks_map
    ns = _solutions.load("10_framework_map.ipynb")
    wrong = dict(ns["framework_map"](), **{"DeepSpeed zero_optimization.stage 3":
                                           "ShardedOptimizer(stage=2)"})
    rep = frameworks_map.grade_framework_map(lambda: wrong)
    assert not rep.passed and "expected 'fully_shard', got 'ShardedOptimizer(stage=2)'" in str(rep)
    text = _rejects("10_framework_map.ipynb", "logged_loss_grade", {"logged_loss": '''
def logged_loss(worker_losses):
    return sum(worker_losses) / len(worker_losses)      # the true loss, not what is logged
'''}, "that is the true global loss", "expected 4, got 2")
    assert "score: 0.33/2" in text, text      # 1 of 6: one worker, where the two agree
    _rejects("10_framework_map.ipynb", "clip_factor_grade", {"clip_factor": '''
def clip_factor(grad_norm, max_norm=1.0):
    return True, max_norm / grad_norm if grad_norm else 1.0   # also scales small gradients up
'''}, "factor expected 1 (torch.nn.utils.clip_grad_norm_), got 3.33333",
        "clipping only shrinks")


def test_ex11_rejects_cuda_local_rank_on_a_shared_gpu_and_nccl_that_does_not_raise():
    text = _rejects("11_gpu_placement.ipynb", "place_grade", {"place": '''
def place(local_rank, local_world_size, gpus, backend):
    if gpus == 0:
        return "cpu", "gloo", None
    per_gpu = -(-local_world_size // gpus)
    if backend == "auto":
        backend = "nccl" if per_gpu == 1 else "gloo"
    return f"cuda:{local_rank}", backend, (1 / per_gpu if per_gpu > 1 else None)
'''}, "local rank 5 of 8, 1 GPU(s), backend 'gloo': [device]", "device: expected 'cuda:0', got 'cuda:5'",
        "local_rank % gpus", "backend 'nccl': [nccl_error]", "expected ValueError")
    assert "✓ local rank 3 of 4, 4 GPU(s), backend 'nccl'" in text, text


EX15 = "15_moe_dispatch.ipynb"


@pytest.mark.parametrize("body,needle", [
    ("return math.ceil(num_tokens * top_k * capacity_factor / num_experts)", "floating point"),
    ("return math.floor(Fraction(num_tokens * top_k) * Fraction(str(capacity_factor)) / num_experts)",
     "rounded down"),
    ("return math.ceil(Fraction(num_tokens) * Fraction(str(capacity_factor)) / num_experts)",
     "top_k is missing"),
])
def test_ex15_capacity_slips_are_named(body, needle):
    _rejects(EX15, "capacity_grade", {"capacity": "def capacity(num_tokens, num_experts, top_k, "
                                                 f"capacity_factor):\n    {body}\n"}, needle)


@pytest.mark.parametrize("body,needle", [
    ("f = torch.bincount(experts.reshape(-1), minlength=E).float() / T\n"
     "    return coeff * E * (f * probs.mean(0)).sum()", "f divided by T, not T·k"),
    ("f = torch.bincount(experts.reshape(-1), minlength=E).float() / experts.numel()\n"
     "    P = torch.zeros(E).scatter_add(0, experts.reshape(-1), probs.gather(1, experts).reshape(-1)) / T\n"
     "    return coeff * E * (f * P).sum()", "P from the chosen experts' weights only"),
    ("f = torch.bincount(experts.reshape(-1), minlength=E).float() / experts.numel()\n"
     "    return coeff * E * (f * probs.detach().mean(0)).sum()", "no gradient"),
    ("f = torch.bincount(experts.reshape(-1), minlength=E).float() / experts.numel()\n"
     "    return coeff * (f * probs.mean(0)).sum()", "the factor E is missing"),
])
def test_ex15_aux_loss_on_the_wrong_statistics_is_named(body, needle):
    _rejects(EX15, "aux_loss_grade", {"aux_loss": "def aux_loss(probs, experts, coeff):\n"
                                                 f"    T, E = probs.shape\n    {body}\n"}, needle)


_PERM_OK = '''
def permutation(experts, weights, kept, num_experts):
    T, k = experts.shape
    key = torch.where(kept, experts, torch.full_like(experts, num_experts)).reshape(-1)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    order = order[: int(counts.sum())]
    return order // k, weights.reshape(-1)[order], counts
'''


@pytest.mark.parametrize("code,needle", [
    # token-major: rows in token order, not grouped by expert
    ('''
def permutation(experts, weights, kept, num_experts):
    T, k = experts.shape
    flat = kept.reshape(-1).nonzero().squeeze(1)
    counts = torch.bincount(experts[kept], minlength=num_experts)
    return flat // k, weights.reshape(-1)[flat], counts

def unpermute(rows, token_index, row_weights, num_tokens):
    w = rows * row_weights.unsqueeze(-1)
    return w.new_zeros(num_tokens, rows.shape[-1]).index_add(0, token_index, w)
''', "not grouped by expert"),
    # a token's k rows assigned, not summed
    (_PERM_OK + '''
def unpermute(rows, token_index, row_weights, num_tokens):
    w = rows * row_weights.unsqueeze(-1)
    return w.new_zeros(num_tokens, rows.shape[-1]).index_copy(0, token_index, w)
''', "summed (index_add), not assigned"),
    # rows not weighted
    (_PERM_OK + '''
def unpermute(rows, token_index, row_weights, num_tokens):
    return rows.new_zeros(num_tokens, rows.shape[-1]).index_add(0, token_index, rows)
''', "not weighted by their router probability"),
    # rows returned in permuted order to the first positions: the wrong tokens
    (_PERM_OK + '''
def unpermute(rows, token_index, row_weights, num_tokens):
    w = rows * row_weights.unsqueeze(-1)
    out = w.new_zeros(num_tokens, rows.shape[-1])
    pos = torch.arange(len(token_index)) % num_tokens
    return out.index_add(0, pos, w)
''', "tokens returned to the wrong positions"),
    # dropped rows sent
    ('''
def permutation(experts, weights, kept, num_experts):
    T, k = experts.shape
    order = torch.sort(experts.reshape(-1), stable=True).indices
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    return order // k, weights.reshape(-1)[order], counts

def unpermute(rows, token_index, row_weights, num_tokens):
    w = rows * row_weights.unsqueeze(-1)
    return w.new_zeros(num_tokens, rows.shape[-1]).index_add(0, token_index, w)
''', "include dropped assignments"),
    # the router weights detached
    (_PERM_OK.replace("weights.reshape(-1)[order]", "weights.detach().reshape(-1)[order]") + '''
def unpermute(rows, token_index, row_weights, num_tokens):
    w = rows * row_weights.unsqueeze(-1)
    return w.new_zeros(num_tokens, rows.shape[-1]).index_add(0, token_index, w)
''', "the router's gradient is not the dense MoE's"),
])
def test_ex15_permutation_slips_are_named(code, needle):
    _rejects(EX15, "permutation_grade", {"permutation": code}, needle)


def test_ex14_rejects_an_unstable_merge_a_plain_sum_and_the_wrong_chunk_pairing():
    naive = '''
def merge(out_a, lse_a, out_b, lse_b):
    lse = lse_a + torch.log(1 + torch.exp(lse_b - lse_a))
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse
'''
    _rejects("14_context_parallel.ipynb", "merge_grade", {"merge": naive},
             "overflow: the merge is not finite", "max + log1p(exp(-|a - b|))",
             "block a saw no key (lse -inf): [empty] ", "no nan): nan or inf where one block saw no key")
    _rejects("14_context_parallel.ipynb", "ring_grade", {"merge": naive}, "non-finite output")
    # stable, but nan where neither block saw a key (a learner's attempt that scored 2/2 once)
    no_both = '''
def merge(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    lse = m + torch.log1p(torch.exp(-(lse_a - lse_b).abs()))
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse
'''
    _rejects("14_context_parallel.ipynb", "merge_grade", {"merge": no_both},
             "with both lse -inf in every row")
    # the [b, h, s] weights not broadcast over d: a hint, not only torch's shape error
    _rejects("14_context_parallel.ipynb", "merge_grade", {"merge": '''
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse
'''}, "broadcast the weights over d with [..., None]")
    plain = '''
def merge(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)
'''
    _rejects("14_context_parallel.ipynb", "merge_grade", {"merge": plain},
             "out is out_a + out_b: weight each by its share")
    _rejects("14_context_parallel.ipynb", "ring_grade", {"merge": plain},
             "output differs from full attention")
    for wrong, needle in (("chunks[world + rank]", "chunks r and W + r: the wrong chunk pairing"),
                          ("chunks[(2 * world - rank) % (2 * world)]", "chunks r and 2W - r")):
        _rejects("14_context_parallel.ipynb", "zigzag_positions_grade", {"zigzag_positions": f'''
def zigzag_positions(seq_len, world, rank):
    chunks = torch.arange(seq_len).tensor_split(2 * world)
    return torch.cat([chunks[rank], {wrong}])
'''}, needle)
    _rejects("14_context_parallel.ipynb", "zigzag_positions_grade", {"zigzag_positions": '''
def zigzag_positions(seq_len, world, rank):
    n = seq_len // (2 * world)
    return torch.cat([torch.arange(rank * n, (rank + 1) * n),
                      torch.arange((2 * world - 1 - rank) * n, (2 * world - rank) * n)])
'''}, "does not divide into")


def test_ex14_names_what_a_learner_did_not_other_mistakes():
    """From a learner's trial: an off-by-one pairing (2W-2-r) was told "chunks r and W + r" and
    "uneven lengths"; an average and swapped weights got no name; a split that drops the last
    positions passed Part C. Each is now named for what it is."""
    off_by_one = {"zigzag_positions": '''
def zigzag_positions(seq_len, world, rank):
    chunks = torch.arange(seq_len).tensor_split(2 * world)
    return torch.cat([chunks[rank], chunks[2 * world - 2 - rank]])
'''}
    text = _rejects("14_context_parallel.ipynb", "zigzag_positions_grade", off_by_one,
                    "[pairing]", "chunks 0 and 6 of 8")
    assert "W + r" not in text and "[uneven]" not in text.split("S = 7, W = 4")[1].split("\n")[0]
    for body, needle in (("(out_a + out_b) / 2", "the average of out_a and out_b"),
                         ("torch.exp(lse_b - lse)[..., None] * out_a + torch.exp(lse_a - lse)[..., None] * out_b",
                          "the weights are swapped")):
        _rejects("14_context_parallel.ipynb", "merge_grade", {"merge": f'''
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return {body}, lse
'''}, "[weights]", needle)
    _rejects("14_context_parallel.ipynb", "zigzag_positions_grade", {"zigzag_positions": '''
def zigzag_positions(seq_len, world, rank):
    chunks = torch.arange(seq_len).chunk(2 * world)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
'''}, "[uneven]", "torch.chunk returns fewer pieces")
    _rejects("14_context_parallel.ipynb", "ring_grade", {"zigzag_positions": '''
def zigzag_positions(seq_len, world, rank):
    chunks = torch.arange(seq_len).split(max(1, seq_len // (2 * world)))
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
'''}, "[cover]", "missing [12]")


def test_ex12b_weights_in_float32_or_six_decimals_pass_and_a_close_miss_shows_its_digits():
    """float32 or 6-decimal weights make the same run (the run's check is 1e-6 relative), so the
    sweep accepts them; a miss that prints like the right values is shown with more digits and
    the tolerance."""
    import torch

    from minidist_course.grading import bug_hunt

    def exact(n, m):
        return [len(p) / n for p in torch.arange(n).tensor_split(m)]
    assert bug_hunt._weights_sweep(lambda n, m: torch.tensor(exact(n, m)).tolist()) is None
    assert bug_hunt._weights_sweep(lambda n, m: [round(w, 6) for w in exact(n, m)]) is None
    rule, text = bug_hunt._weights_sweep(lambda n, m: [w * (1 + 3e-5) for w in exact(n, m)])
    assert rule == "proportional" and "1e-06 relative" in text, text
    got, want = text.split(" = ")[1].split(", expected ")
    assert got != want.split(" (")[0], text


def test_a_rank_waiting_in_the_grader_is_not_told_it_waits_at_its_own_line():
    """The launcher calls every frame outside the library "your code", the grader's too: a rank
    whose function returned and that waits in the grader's next collective is told so, not sent
    to a line of the grader (exercise 08b's all-reduce of the wrong piece)."""
    from minidist_course.grading.core import _where_waiting
    stack = ("    your code: minidist_course/grading/hierarchical.py, line 380, in _all_reduce_rank\n"
             "        dist.all_reduce(expected, op=_TORCH_OPS[op])\n"
             "    call stack (innermost first): minidist_course/grading/hierarchical.py:380 "
             "_all_reduce_rank")
    text = _where_waiting(stack, "idle after all_reduce")
    assert "your line" not in text and "had returned" in text, text
    own = stack.replace("minidist_course/grading/hierarchical.py, line 380, in _all_reduce_rank",
                        "cell 7, line 4, in hierarchical_all_reduce")
    assert "waiting at your line 4 in hierarchical_all_reduce" in _where_waiting(own, "x"), own
