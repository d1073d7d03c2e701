"""A grid that does not divide the model or the batch is a ValueError naming the rank and the fix.

Each case is raised by every rank before any communication (so no rank is left waiting in a
collective: the run ends in seconds with :class:`minidist.RankError`, never the timeout), and
:func:`minidist.hybrid.check_grid` says the same without processes.
"""

import time

import pytest
import torch

import minidist
from minidist.grid import ProcessGrid
from minidist.hybrid import HybridGPT, check_grid, train_step, wrap_stages
from minidist.models.gpt import GPTConfig

BASE = dict(vocab_size=50, block_size=16, n_layer=4, n_head=4, n_embd=32)

# name: (config changes, (dp, pp, tp), chunks, sequence_parallel, seq, batch, microbatches, fix)
CASES = {
    "layers < pp*chunks": ({"n_layer": 3}, (1, 4, 1), 1, False, 16, 8, 4, "use n_layer >= 4"),
    "layers < pp*chunks interleaved": ({}, (1, 2, 2), 3, False, 16, 8, 2, "use n_layer >= 6"),
    "heads % tp": ({"n_head": 2}, (1, 1, 4), 1, False, 16, 8, 2,
                   "choose tp among the divisors of 2"),
    "seq % tp with SP": ({}, (1, 1, 4), 1, True, 6, 8, 2, "sequence length (6) divisible by tp=4"),
    "batch % dp": ({}, (4, 1, 1), 1, False, 16, 6, 1, "use a multiple of 4"),
    "microbatches > samples per replica": ({}, (2, 2, 1), 1, False, 16, 4, 4,
                                           "use microbatches <= 2"),
    "interleaved M % pp": ({}, (1, 2, 2), 2, False, 16, 8, 3, "multiple of pp=2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_grid_says_what_to_change(case):
    changes, (dp, pp, tp), v, sp, seq, batch, M, fix = CASES[case]
    cfg = GPTConfig(**{**BASE, **changes})
    with pytest.raises(ValueError, match=r"rank 3") as e:
        check_grid(cfg, dp, pp, tp, v, sp, 3, seq, batch, M)
    assert fix in str(e.value)


def _rank(rank, world, case):
    changes, (dp, pp, tp), v, sp, seq, batch, M, _ = CASES[case]
    cfg = GPTConfig(**{**BASE, **changes})
    model = HybridGPT(cfg, ProcessGrid(dp, pp, tp), chunks=v, sequence_parallel=sp)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    train_step(model, None, wrap_stages(model), ids, ids, M, step=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_without_hanging(case):
    *_, fix = CASES[case]
    t0 = time.monotonic()
    with pytest.raises(minidist.RankError) as e:
        minidist.run(_rank, 4, case, timeout=60)
    message = str(e.value)
    assert fix in message and "ValueError" in message
    assert "rank 0" in message and "also failed" in message   # every rank, not one
    assert time.monotonic() - t0 < 50, "the error should come at once, not at the timeout"


@pytest.mark.timeout(60)
def test_grid_of_the_wrong_size_names_the_rank():
    def fn(rank, world):
        ProcessGrid(2, 2, 2)
    with pytest.raises(minidist.RankError, match=r"world size is 2 \(rank [01]\)"):
        minidist.run(fn, 2, timeout=30)


@pytest.mark.timeout(60)
def test_modules_that_do_not_match_the_dp_mode():
    """Bucketed wrappers driven as "flat" would average every micro-batch's accumulated sum again."""
    def fn(rank, world):
        model = HybridGPT(GPTConfig(**BASE), ProcessGrid(1, 1, 1))
        ids = torch.zeros(2, 16, dtype=torch.long)
        train_step(model, None, wrap_stages(model, "bucketed"), ids, ids, 1, dp_mode="flat",
                   step=False)
    with pytest.raises(minidist.RankError, match=r"modules do not match dp_mode='flat'; build "
                                                 r"them with wrap_stages\(model, 'flat'\)"):
        minidist.run(fn, 1, timeout=30)
