"""Two houses, arrows down only (docs/ARCHITECTURE.md): the library ``minidist`` never imports the
course kit ``minidist_course``; inside each, no module imports from a floor above its own; and no
two modules (or top-level packages) import each other.

Every module of both packages is parsed (``ast``), every import counted — at the top, inside a
function, or relative — and compared with the floor of the room it imports from:

* the library, ``minidist``:
  floor 0, the ground: ``env``, ``netif``, ``comm``, ``trace``, ``chrome_trace``, ``grid``, ``models``;
  floor 1, the launcher, the public collectives and checkpoint generations: ``collectives``,
  ``communicator``, ``launch``, ``checkpoint_io``;
  floor 2, the strategies: ``data_parallel``, ``tensor_parallel``, ``pipeline_parallel``,
  ``sharding``, ``hybrid``, ``expert_parallel``, ``context_parallel``
* the course kit, ``minidist_course``, above the whole library, in sub-floors (3.0 < ... < 3.3):
  3.0 ``references`` (the oracles), ``planner``, ``diagrams``, ``data``, ``text``, ``zoo`` (the bugs,
  patched into the library from outside); 3.1 ``bench`` (measures); 3.2 ``lessons``, ``grading``,
  ``exercises``, ``doctor`` (teach, grade, inspect); 3.3 ``cli``

Importing down is allowed, and sideways within one (sub-)floor, but never both ways. The one
module of the library that names the kit is ``minidist/__main__.py``: the door ``python -m
minidist`` opens onto the kit's command, run as a script and imported by nothing. A module the
table does not know fails the test, so a new module has to be given a floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOUSES = ("minidist", "minidist_course")

FLOORS = {
    0: ("minidist.env", "minidist.netif", "minidist.comm", "minidist.trace", "minidist.chrome_trace",
        "minidist.backward",
        "minidist.core",
        "minidist.grid", "minidist.models"),
    1: ("minidist.collectives", "minidist.communicator", "minidist.launch", "minidist.checkpoint_io",
        "minidist.resume_rule",
        "minidist.state"),
    2: ("minidist.data_parallel", "minidist.tensor_parallel", "minidist.pipeline_parallel",
        "minidist.sharding", "minidist.hybrid", "minidist.expert_parallel", "minidist.context_parallel"),
    3.0: ("minidist_course.references", "minidist_course.planner", "minidist_course.diagrams",
          "minidist_course.data", "minidist_course.text", "minidist_course.zoo"),
    3.1: ("minidist_course.bench", "minidist_course.matrix", "minidist_course.problems"),
    3.2: ("minidist_course.lessons", "minidist_course.grading", "minidist_course.exercises",
          "minidist_course.doctor", "minidist_course.site"),
    3.3: ("minidist_course.cli", "minidist.__main__"),
}
FLOOR_OF = {name: floor for floor, names in FLOORS.items() for name in names}
# the package roots are front doors (lazy attributes), not rooms
FRONT_DOORS = {"minidist": ("run", "init", "RankError", "RankTimeoutError")}

# Edges known to point up, each with the reason it is still there. Remove an entry when it is
# fixed: the test then fails if the edge comes back.
KNOWN: dict[tuple[str, str], str] = {}


def top_name(module: str) -> str | None:
    """The room of a module: ``minidist.comm.ring`` -> ``minidist.comm``,
    ``minidist_course.bench.ddp`` -> ``minidist_course.bench``; a house's root -> None."""
    parts = module.split(".")
    if parts[0] not in HOUSES:
        raise ValueError(f"not a minidist or minidist_course module: {module}")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of the modules of either house ``source`` (the text of ``module``) imports,
    wherever the import statement sits. ``from . import x`` counts as importing ``pkg.x``."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in HOUSES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in HOUSES:
                continue
            if target in HOUSES:  # from minidist import collectives, run
                found.update(f"{target}.{a.name}" for a in node.names)
            else:
                found.add(target)
    return found


def upward_edges(source: str, module: str, is_package: bool = False) -> list[tuple[str, str]]:
    """``(importer room, imported room)`` pairs where the import points up (a higher floor, or
    from the library into the course kit)."""
    me = top_name(module)
    if me is None:
        return []  # a house's __init__ exposes its rooms (lazily): it is the front door
    edges = []
    for target in sorted(imported_modules(source, module, is_package)):
        other = top_name(target)
        if other is None or other == me:
            continue
        if other not in FLOOR_OF:
            house, _, name = other.partition(".")
            if target.count(".") == 1 and name in FRONT_DOORS.get(house, ()):
                other = "minidist.env" if name == "init" else "minidist.launch"
            else:
                raise KeyError(f"{module} imports {target}: give {other} a floor in FLOORS")
        if me not in FLOOR_OF:
            raise KeyError(f"give {me} a floor in FLOORS")
        if FLOOR_OF[other] > FLOOR_OF[me]:
            edges.append((me, other))
    return sorted(set(edges))


def library_imports_the_kit(source: str, module: str, is_package: bool = False) -> list[str]:
    """The course-kit modules a library module imports (anywhere in its text)."""
    return sorted(t for t in imported_modules(source, module, is_package)
                  if t.split(".")[0] == "minidist_course")


def _modules():
    for house in HOUSES:
        for path in sorted((ROOT / house).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            yield ".".join(parts), path, is_package


def test_the_library_never_imports_the_course_kit():
    """``minidist`` is readable and usable without ``minidist_course``: no import of the kit in it,
    at the top, inside a function or relative (``minidist/__main__.py``, the command's door, aside)."""
    bad = [f"{module} imports {', '.join(targets)}"
           for module, path, is_package in _modules()
           if module.split(".")[0] == "minidist" and module != "minidist.__main__"
           for targets in [library_imports_the_kit(path.read_text(), module, is_package)] if targets]
    assert not bad, "the library imports the course kit:\n" + "\n".join(bad)


def test_every_module_has_a_floor():
    unknown = sorted({top_name(m) for m, _, _ in _modules()} - set(FLOOR_OF) - {None})
    assert not unknown, f"give these a floor in FLOORS: {unknown}"


def test_no_module_imports_from_a_floor_above_its_own():
    bad = []
    for module, path, is_package in _modules():
        for edge in upward_edges(path.read_text(), module, is_package):
            if edge not in KNOWN:
                bad.append(f"{module} (floor {FLOOR_OF[edge[0]]}) imports {edge[1]} "
                           f"(floor {FLOOR_OF[edge[1]]})")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


@pytest.mark.parametrize("edge", sorted(KNOWN) or [pytest.param(None, marks=pytest.mark.skip(
    reason="no known upward edge left"))])
def test_known_upward_edge_is_still_there(edge):
    """A known exception that has been fixed must leave KNOWN (else it could silently return)."""
    importer, imported = edge
    still = any(e == edge for module, path, is_package in _modules()
                if top_name(module) == importer
                for e in upward_edges(path.read_text(), module, is_package))
    if not still:
        pytest.fail(f"{importer} no longer imports {imported}: remove the entry from KNOWN")
    pytest.xfail(KNOWN[edge])


def module_edges(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The minidist modules (files) ``module`` imports, wherever the statement sits: ``from pkg
    import name`` counts as importing ``pkg.name`` when that is a module in ``known``, else as
    importing ``pkg`` (its ``__init__``)."""
    package = module if is_package else module.rpartition(".")[0]

    def file_of(name: str) -> str:
        while name not in known and "." in name:  # pkg.mod.attr -> the module pkg.mod
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(file_of(a.name) for a in node.names if a.name.split(".")[0] in HOUSES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in HOUSES:
                continue
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in known else file_of(target)
                         for a in node.names)
    found.discard(module)
    return found


def mutual_pairs(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs ``(a, b)``, ``a < b``, where a imports b and b imports a."""
    return sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets
                   if a in edges.get(b, ())})


def _module_graph() -> dict[str, set[str]]:
    mods = list(_modules())
    known = {m for m, _, _ in mods}
    return {m: module_edges(path.read_text(), m, is_package, known) for m, path, is_package in mods}


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        me = top_name(module)
        for target in targets:
            other = top_name(target)
            if me is not None and other is not None and other != me:
                rooms.setdefault(me, set()).add(other)
    return rooms


def test_no_two_modules_import_each_other():
    """A pair that imports each other (at the top, inside a function, or through a re-export) is
    one idea cut in two, or a loop that only import order keeps working."""
    pairs = mutual_pairs(_module_graph())
    assert not pairs, "modules that import each other:\n" + "\n".join(f"{a} <-> {b}" for a, b in pairs)


def test_no_two_top_level_packages_import_each_other():
    """Sideways imports within one (sub-)floor are allowed, loops between two rooms are not."""
    pairs = mutual_pairs(_package_graph(_module_graph()))
    assert not pairs, "packages that import each other:\n" + "\n".join(f"{a} <-> {b}" for a, b in pairs)


# ---------------------------------------------------------------- the checker itself can fail
@pytest.mark.parametrize("module,source,expected", [
    # a function-level import, as a lazy import would be written
    ("minidist.comm.ring", "def f():\n    from .. import collectives\n",
     [("minidist.comm", "minidist.collectives")]),
    ("minidist.comm.ring", "from ..collectives import all_reduce\n",
     [("minidist.comm", "minidist.collectives")]),
    ("minidist.models.gpt", "from minidist.tensor_parallel import regions\n",
     [("minidist.models", "minidist.tensor_parallel")]),
    # the library reaching into the kit points up, in every spelling
    ("minidist.tensor_parallel.layers", "import minidist_course.references.tensor_parallel\n",
     [("minidist.tensor_parallel", "minidist_course.references")]),
    ("minidist.sharding.zero", "def f():\n    from minidist_course import planner\n",
     [("minidist.sharding", "minidist_course.planner")]),
    ("minidist.data_parallel.base", "from minidist import run\n", []),   # launch: floor 1 < 2
    ("minidist.collectives", "from .comm import ring\nimport torch\n", []),
    ("minidist_course.lessons.data_parallel_demo", "from minidist.data_parallel import NaiveDDP\n", []),
    ("minidist.tensor_parallel", "from . import layers\n", []),          # a package's own module
])
def test_checker_finds_upward_imports_in_synthetic_modules(module, source, expected):
    is_package = module == "minidist.tensor_parallel"
    assert upward_edges(source, module, is_package) == expected


def test_checker_finds_a_sideways_loop_at_the_top_floor():
    """bench importing lessons (and lessons bench) was a loop floor 3 allowed: sub-floors refuse it."""
    B, L = "minidist_course.bench", "minidist_course.lessons"
    assert upward_edges("from ..lessons.sharding_demo import x\n", f"{B}.sharding") == [(B, L)]
    assert upward_edges("from ..bench.hybrid import build\n", f"{L}.timeline") == []
    assert upward_edges("from ..references.data_parallel import x\n", f"{B}.data_parallel") == []
    assert upward_edges("def f():\n    from .. import cli\n", "minidist_course.grading.core") == [
        ("minidist_course.grading", "minidist_course.cli")]
    assert upward_edges("from ..lessons import tensor_parallel_demo\n",
                        "minidist_course.references.tensor_parallel") == [
        ("minidist_course.references", L)]


def test_checker_finds_the_library_importing_the_kit():
    """A synthetic violation: a strategy that imports a reference (or the planner, lazily)."""
    assert library_imports_the_kit("from minidist_course.references.tensor_parallel import x\n",
                                   "minidist.tensor_parallel.layers") == [
        "minidist_course.references.tensor_parallel"]
    assert library_imports_the_kit("def f():\n    import minidist_course.planner\n",
                                   "minidist.sharding.zero") == ["minidist_course.planner"]
    assert library_imports_the_kit("from ..comm import ring\n", "minidist.collectives") == []


def test_checker_finds_modules_and_packages_that_import_each_other():
    known = {"minidist_course.planner.search", "minidist_course.planner.machine", "minidist_course.planner",
             "minidist_course.bench.data_parallel", "minidist_course.grading.data_parallel", "minidist_course.grading"}
    # a re-export at the bottom of one file, a function-level import in the other
    a = module_edges("x = 1\nfrom .machine import this_machine  # noqa: E402\n",
                     "minidist_course.planner.search", False, known)
    b = module_edges("def f():\n    from . import search\n", "minidist_course.planner.machine", False, known)
    assert a == {"minidist_course.planner.machine"} and b == {"minidist_course.planner.search"}
    graph = {"minidist_course.planner.search": a, "minidist_course.planner.machine": b}
    assert mutual_pairs(graph) == [("minidist_course.planner.machine", "minidist_course.planner.search")]
    assert mutual_pairs({"minidist_course.planner.search": a}) == []
    # two rooms on one sub-floor importing each other through different files
    rooms = _package_graph({"minidist_course.bench.data_parallel": {"minidist_course.grading.data_parallel"},
                            "minidist_course.grading.data_parallel": {"minidist_course.grading"},
                            "minidist_course.grading": {"minidist_course.bench.data_parallel"}})
    assert mutual_pairs(rooms) == [("minidist_course.bench", "minidist_course.grading")]


def test_checker_rejects_a_module_without_a_floor():
    with pytest.raises(KeyError, match="give minidist.newthing a floor"):
        upward_edges("from ..newthing import x\n", "minidist.comm.ring")


def test_strategies_are_reachable_from_import_minidist_and_loaded_lazily():
    """``import minidist`` then ``minidist.data_parallel`` etc. work; nothing heavy loads before."""
    import subprocess
    import sys
    code = ("import sys, minidist\n"
            "names = ('data_parallel', 'tensor_parallel', 'pipeline_parallel', 'collectives')\n"
            "assert not any(f'minidist.{n}' in sys.modules for n in names[:3]), sys.modules.keys()\n"
            "print(minidist.data_parallel.BucketedDDP.__name__,\n"
            "      minidist.tensor_parallel.ColumnParallelLinear.__name__,\n"
            "      minidist.pipeline_parallel.make_schedule.__name__,\n"
            "      minidist.collectives.all_reduce.__name__)\n"
            "assert not hasattr(minidist, 'no_such_thing')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["BucketedDDP", "ColumnParallelLinear", "make_schedule", "all_reduce"]
