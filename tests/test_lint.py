"""The habits of a maintained project: ruff (pyflakes, shadowed builtins, bugbear) on every Python
file, and mypy on the floors 0-2 packages; settings in pyproject.toml ([tool.ruff], [tool.mypy]).

ruff must report nothing. mypy's findings that predate the type check are counted per file in
``tests/mypy_baseline.txt`` (mostly torch's ``Tensor | None`` gradients and untyped containers):
a file may not get *more* than its count (new code is checked), and a file that got fewer must
lower its count (the baseline only shrinks). Both tools are in the ``test`` extra. ruff runs in the
default tier; mypy (37 s without its cache, as in every fresh clone) in the integration tier.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASELINE = Path(__file__).with_name("mypy_baseline.txt")


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")


@pytest.mark.timeout(300)
def test_ruff_finds_nothing():
    _need("ruff")
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format=concise",
                          "minidist", "minidist_course", "tests", "tools", "frameworks",
                          "course/scripts",
                          "course/multinode"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, f"ruff findings (fix them, or justify a rule in pyproject.toml):\n{res.stdout}{res.stderr}"


def mypy_counts(output: str) -> Counter:
    """{file: number of `error:` lines} of mypy's output."""
    return Counter(m.group(1) for m in re.finditer(r"^([^:\n]+\.py):\d+: error:", output, re.M))


def read_baseline() -> Counter:
    return Counter({path: int(n) for path, n in
                    (line.split() for line in BASELINE.read_text().splitlines() if line.strip())})


def test_mypy_counts_are_parsed():
    out = "minidist/a.py:3: error: x  [arg-type]\nminidist/a.py:9: note: y\nminidist/b.py:1: error: z\n"
    assert mypy_counts(out) == Counter({"minidist/a.py": 1, "minidist/b.py": 1})


@pytest.mark.integration   # 37 s cold (a clean clone has no .mypy_cache): CI's integration tier
@pytest.mark.timeout(600)
def test_mypy_adds_no_finding_to_the_baseline():
    _need("mypy")
    res = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT,
                         capture_output=True, text=True, timeout=580)
    if res.returncode not in (0, 1):
        pytest.fail(f"mypy did not run (exit {res.returncode}):\n{res.stdout}{res.stderr}")
    got, base = mypy_counts(res.stdout), read_baseline()
    worse = {f: (n, base.get(f, 0)) for f, n in got.items() if n > base.get(f, 0)}
    assert not worse, ("new mypy findings (file: now vs baseline):\n" +
                       "\n".join(f"  {f}: {n} vs {b}" for f, (n, b) in sorted(worse.items())) +
                       "\n" + "\n".join(line for line in res.stdout.splitlines()
                                        if line.split(":")[0] in worse))
    better = {f: (got.get(f, 0), b) for f, b in base.items() if got.get(f, 0) < b}
    assert not better, ("fewer mypy findings than the baseline: lower these counts in "
                        "tests/mypy_baseline.txt:\n" +
                        "\n".join(f"  {f}: {n} (baseline {b})" for f, (n, b) in sorted(better.items())))
