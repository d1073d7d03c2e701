"""Library code the notebooks print verbatim is frozen: change it, re-execute the notebook.

A chapter shows library functions with ``inspect.getsource`` and nbval compares the printed text
strictly, so an edit to one of them breaks a chapter far from the edit. :data:`DISPLAYED` lists,
per notebook, every library function it prints; ``tests/frozen_code.json`` holds a hash of each
one's source as it was when the notebooks were last executed. The test fails, naming the notebook
to re-execute, when a listed function's source changed; and when a notebook prints a function the
list does not know (or no longer prints a listed one).

After re-executing the notebook (``jupyter nbconvert --to notebook --execute --inplace ...``)::

    python tests/test_frozen_code.py --update      # store the new hashes
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HASHES = Path(__file__).with_name("frozen_code.json")

DISPLAYED: dict[str, list[str]] = {
    "course/03_ring_allreduce.ipynb": [
        "minidist.comm.naive:reduce", "minidist.comm.naive:broadcast",
        "minidist.comm.ring:reduce_scatter_simple", "minidist.comm.ring:all_gather_simple",
        "minidist.comm.ring:all_reduce_simple", "minidist.comm.ring:reduce_scatter_preposted",
        "minidist.comm.ring:all_gather_preposted", "minidist.comm.ring:all_reduce_preposted",
        "minidist.comm.recursive_doubling:all_reduce",
        "minidist.comm.tuner:Table.choose", "minidist.comm.tuner:Table.predict"],
    "course/04_data_parallel.ipynb": [
        "minidist.data_parallel.naive:NaiveDDP.sync_gradients",
        "minidist.data_parallel.flat:FlatDDP.sync_gradients",
        "minidist.data_parallel.bucketed:BucketedDDP._on_grad_ready",
        "minidist.data_parallel.bucketed:BucketedDDP._launch_in_order"],
    "course/04b_measurement_and_large_batches.ipynb": [
        "minidist_course.lessons.large_batch:warmup_lr",
        "minidist.data_parallel.noise_scale:from_two_batches"],
    "course/05_data_parallel_in_practice.ipynb": [
        "minidist_course.lessons.data_parallel_training:train_digits", "minidist_course.references.data_parallel:train_ddp",
        "minidist_course.lessons.data_wall:PNGDigits.__getitem__"],
    "course/06_tensor_parallel.ipynb": [
        "minidist.core.tensor_parallel:_all_reduce",
        "minidist.core.tensor_parallel:CopyToTensorParallelRegion",
        "minidist.core.tensor_parallel:ReduceFromTensorParallelRegion",
        "minidist.core.tensor_parallel:ColumnParallelLinear",
        "minidist.core.tensor_parallel:RowParallelLinear",
        "minidist.tensor_parallel.attention:ParallelSelfAttention.forward"],
    "course/07_pipeline_parallel.ipynb": [
        "minidist.core.pipeline:one_f_one_b", "minidist.core.pipeline:PipelineStage",
        "minidist.core.pipeline:pipeline_step"],
    "course/07b_zero_bubble.ipynb": [
        "minidist.core.zero_bubble:backward_input", "minidist.core.zero_bubble:backward_weight",
        "minidist.core.zero_bubble:zb_h1", "minidist.core.zero_bubble:ZeroBubbleStage"],
    "course/08b_two_level_cluster.ipynb": [
        "minidist.comm.topology:pace", "minidist.comm.hierarchical:all_reduce"],
    "course/09_sharding.ipynb": [
        "minidist.sharding.zero:ShardedOptimizer.step", "minidist.sharding.zero:ShardedOptimizer._on_grad",
        "minidist.sharding.fsdp_unit:ShardUnit.pre_backward",
        "minidist.sharding.fsdp_unit:ShardUnit._on_grad",
        "minidist.sharding.fsdp_param:ParamLayout.to_param_major",
        "minidist.sharding.recompute:checkpoint"],
    "course/10_frameworks.ipynb": ["frameworks/job.py:global_batch", "frameworks/job.py:shard"],
    "course/11_gpu.ipynb": ["minidist.comm.staging:isend", "minidist.comm.staging:irecv"],
    "course/12_capstone.ipynb": [
        "minidist.core.grid:_along", "minidist.core.grid:group_ranks",
        "minidist.hybrid.step:train_step",
        "minidist_course.references.hybrid:batch", "minidist.hybrid.dp_pipeline:_over_replicas",
        "minidist.hybrid.stages:HybridGPT.allreduce_tied_grads",
        "minidist.hybrid.moe:average_gradients"],
    "course/15_mixture_of_experts.ipynb": [
        "minidist.core.moe:route", "minidist.core.moe:capacity",
        "minidist.core.moe:load_balancing_loss",
        "minidist.core.moe:dispatch_combine", "minidist.core.moe:AllToAll",
        "minidist.expert_parallel.gpt:sync_grads"],
    "course/14_context_parallel.ipynb": [
        "minidist.core.ring_attention:log_add_exp", "minidist.core.ring_attention:merge",
        "minidist.core.ring_attention:RingAttention.forward",
        "minidist.core.ring_attention:RingAttention.backward"],
    "course/16_fault_tolerance.ipynb": ["minidist_course.lessons.fault_tolerant_demo:killed_mid_step",
                                        "minidist_course.references.fault_tolerant:_replica",
                                        "minidist_course.lessons.fault_tolerant_demo:async_save_overlap",
                                        "minidist.data_parallel.diloco:DiLoCo.state_dict"],
    "solutions/03_ring_allreduce.ipynb": ["minidist.comm.ring:reduce_scatter_simple"],
    "exercises/03_ring_allreduce.ipynb": ["minidist.comm.ring:reduce_scatter_simple"],
    "solutions/07_one_f_one_b.ipynb": ["minidist.pipeline_parallel.schedules:gpipe"],
    "exercises/07_one_f_one_b.ipynb": ["minidist.pipeline_parallel.schedules:gpipe"],
}


def source_hash(name: str) -> str:
    """``"pkg.module:Class.method"`` (or ``"path/file.py:function"``, a script of the repository)
    -> the first 16 hex digits of sha256 of its source."""
    module, _, attr = name.partition(":")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module).stem, ROOT / module)
        obj = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(obj)
    else:
        obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def displayed_names(notebook: Path) -> set[str]:
    """The last dotted component of every ``getsource(X)`` / ``show(X)`` in the code cells (X a
    plain dotted name; ``show(obj)``, the helper's own argument, and calls with more arguments
    are not displays)."""
    found = set()
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        for arg in re.findall(r"(?:getsource|\bshow)\(([^()]*)\)", src):
            if re.fullmatch(r"[A-Za-z_][\w.]*", arg) and arg != "obj":
                found.add(arg.rsplit(".", 1)[-1])
    return found


@pytest.mark.parametrize("notebook", sorted(DISPLAYED))
def test_the_list_matches_what_the_notebook_prints(notebook):
    listed = {n.rsplit(".", 1)[-1].rpartition(":")[2] for n in DISPLAYED[notebook]}
    shown = displayed_names(ROOT / notebook)
    assert shown == listed, (f"{notebook} prints {sorted(shown)}, DISPLAYED lists {sorted(listed)}: "
                             "update DISPLAYED (and the hashes) in tests/test_frozen_code.py")


def test_no_other_notebook_prints_library_code():
    others = [str(p.relative_to(ROOT)) for d in ("course", "exercises", "solutions")
              for p in sorted((ROOT / d).glob("*.ipynb"))
              if str(p.relative_to(ROOT)) not in DISPLAYED and displayed_names(p)]
    assert not others, f"these notebooks print library code: add them to DISPLAYED: {others}"


def test_displayed_functions_are_unchanged_since_the_notebooks_ran():
    stored = json.loads(HASHES.read_text())
    stale = {}
    for notebook, names in DISPLAYED.items():
        for name in names:
            if stored.get(name) != source_hash(name):
                stale.setdefault(notebook, []).append(name)
    assert not stale, ("library code a notebook prints changed; re-execute the notebook, then run "
                       "`python tests/test_frozen_code.py --update`:\n" +
                       "\n".join(f"  {nb}: {', '.join(names)}" for nb, names in stale.items()))


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    sys.path.insert(0, str(ROOT))
    hashes = {n: source_hash(n) for names in DISPLAYED.values() for n in names}
    HASHES.write_text(json.dumps(dict(sorted(hashes.items())), indent=1) + "\n")
    print(f"stored {len(hashes)} hashes in {HASHES}")
