"""The Python snippets of the README and of docs/library.md run as printed, and give what their
comments promise.

Each ```python block of README.md, then of docs/library.md, is executed, in order, in one namespace; every function it defines whose first two
parameters are ``(rank, world_size)`` is run under ``minidist.run`` at the world size its snippet
needs. A snippet that drifts from the library (a renamed class, a changed signature) fails here.
"""

import inspect
import re
from pathlib import Path

import pytest
import torch

import minidist

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "library.md")   # the library's snippets, read as one session
# world size per snippet function; the 3-D one needs dp * pp * tp = 8 ranks, the 5-D one 16
WORLD = {"f": 4, "ddp": 2, "tp": 2, "pp": 2, "three_d": 8, "ep": 4, "five_d": 16, "hsdp": 4,
         "two_level": 4}
# 16 ranks on two cores take ~20 s: the integration tier runs that snippet
HEAVY = {"five_d"}


def _snippets() -> list[str]:
    return [code for page in PAGES for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def _rank_functions() -> dict:
    found, namespace = {}, {}     # one namespace: later snippets use earlier imports, as in a session
    for code in _snippets():
        code = code.replace("minidist.run(f, world_size=4)", "None")   # the call the test makes
        exec(compile(code, str(README), "exec"), namespace)
        for name, obj in namespace.items():
            if inspect.isfunction(obj) and list(inspect.signature(obj).parameters)[:2] == [
                    "rank", "world_size"]:
                found[name] = obj
    return found


def test_every_snippet_function_has_a_world_size():
    assert set(_rank_functions()) == set(WORLD), "a README snippet was added or renamed: add it to WORLD"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.integration) if n in HEAVY else n
                                  for n in sorted(WORLD)])
def test_snippet_runs_and_ranks_agree(name):
    fn = _rank_functions()[name]
    results = minidist.run(fn, WORLD[name], timeout=180)
    if name == "f":
        assert results == [10.0] * 4                 # 1 + 2 + 3 + 4, as the comment says
    elif name == "tp":
        for r in results[1:]:
            assert torch.equal(r, results[0])        # "the same on every rank"
        assert results[0].shape == (4, 8)
    elif name == "pp":
        losses = [r for r in results if r is not None]
        assert len(losses) == 1 and results[-1] is not None   # only the last stage has the loss
    elif name == "two_level":                        # inter-node bytes, all ranks: ring, hierarchical
        assert results == [[3 << 20, 2 << 20]] * 4, results
    elif name == "five_d":                           # (loss, aux loss): the same on every rank
        assert all(r == results[0] for r in results), results
        assert 0 < results[0][1] < results[0][0]     # the aux part is a part of the loss
    else:                                            # ddp, three_d, ep, hsdp: identical on every rank
        assert all(r == results[0] for r in results), results


def test_every_docs_page_the_code_points_to_exists():
    """A docstring's "Design notes: docs/design/x.md" (or any docs/ path in the package's code)
    names a page that is in the repository: a learner who follows it finds it."""
    missing = {}
    for pkg in ("minidist", "minidist_course"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for ref in re.findall(r"\bdocs/[\w/.-]+\.md\b", path.read_text()):
                if not (ROOT / ref).is_file():
                    missing.setdefault(ref, []).append(str(path.relative_to(ROOT)))
    assert not missing, missing
