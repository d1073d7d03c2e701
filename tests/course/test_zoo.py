"""The bug zoo (:mod:`minidist_course.zoo`): each bug patches one library function from outside,
only inside :func:`~minidist_course.zoo.inject`, and the library never names the zoo. (That the
bisector finds each bug: tests/library/hybrid/test_hybrid_bisect.py.)"""

from pathlib import Path

import pytest
import torch

import minidist
from minidist.context_parallel import ring, sharding
from minidist.hybrid import dp_pipeline, moe, stages
from minidist.pipeline_parallel import microbatch
from minidist_course import zoo


def _targets():
    return {"dp_pipeline.average_flat": lambda: dp_pipeline.average_flat,
            "dp_pipeline._sum_over": lambda: dp_pipeline._sum_over,
            "HybridGPT.allreduce_tied_grads": lambda: stages.HybridGPT.allreduce_tied_grads,
            "HybridGPT.finish_sequence_parallel_grads":
                lambda: stages.HybridGPT.finish_sequence_parallel_grads,
            "CPGPTStage.positions": lambda: stages.CPGPTStage.positions,
            "sharding.block_kind": lambda: sharding.block_kind,
            "ring.block_kind": lambda: ring.block_kind,
            "microbatch.loss_weights": lambda: microbatch.loss_weights,
            "moe._expert_replicas": lambda: moe._expert_replicas}


@pytest.mark.parametrize("bug", sorted(zoo.BUGS))
def test_each_bug_patches_one_function_only_inside_the_block(bug):
    before = {k: get() for k, get in _targets().items()}
    with zoo.inject(bug):
        assert zoo.on(bug)
        changed = {k for k, get in _targets().items() if get() is not before[k]}
        assert changed, f"{bug} patches none of the known sites"
    assert not zoo.on(bug)
    assert {k: get() for k, get in _targets().items()} == before


def test_mutations_do_what_the_list_says():
    assert microbatch.loss_weights(10, 4) == [0.3, 0.3, 0.2, 0.2]
    with zoo.inject("microbatch-mean-of-means"):
        assert microbatch.loss_weights(10, 4) == [0.25] * 4
    q, k = torch.arange(4, 8), torch.arange(4, 8)
    assert ring.block_kind(q, k) == "diagonal"
    with zoo.inject("ring-diagonal-unmasked"):
        assert ring.block_kind(q, k) == sharding.block_kind(q, k) == "full"
        assert sharding.block_kind(torch.arange(4), torch.arange(4, 8)) == "skipped"


def test_every_bug_has_a_source_and_the_library_never_names_the_zoo():
    assert all(what and source and "#" not in source for what, source in zoo.BUGS.values())
    root = Path(minidist.__file__).parent
    naming = [str(p.relative_to(root)) for p in root.rglob("*.py") if "zoo" in p.read_text()]
    assert not naming, f"library files naming the zoo: {naming}"
