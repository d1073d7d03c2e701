"""minidist.diagrams: the ring schedule drawn in chapter 03 is the one minidist's ring runs."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import minidist  # noqa: E402
from minidist import diagrams  # noqa: E402
from minidist.comm import ring  # noqa: E402


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5])
def test_ring_schedule_ends_complete(w):
    steps = diagrams.ring_schedule(w)
    assert len(steps) == 1 + 2 * (w - 1)
    _, after_rs, _ = steps[w - 1]
    assert all(after_rs[r][r] == frozenset(range(w)) for r in range(w))
    _, final, _ = steps[-1]
    assert all(final[r][c] == frozenset(range(w)) for r in range(w) for c in range(w))


def _rs_contributions(rank, world):
    # rank r contributes 2**r to every chunk: the sum tells which ranks are in it
    chunks = [torch.full((1,), float(2 ** rank), dtype=torch.float64) for _ in range(world)]
    ring.reduce_scatter_chunks(chunks, "sum", rank, world)
    return [int(c.item()) for c in chunks]


@pytest.mark.parametrize("w", [2, 3, 4])
def test_schedule_matches_the_library_ring(w):
    got = minidist.run(_rs_contributions, w, timeout=60)
    _, held, _ = diagrams.ring_schedule(w)[w - 1]
    want = [[sum(2 ** k for k in held[r][c]) for c in range(w)] for r in range(w)]
    assert got == want


@pytest.mark.parametrize("op", diagrams.COLLECTIVES)
def test_draw_collective(op):
    before, after = diagrams.collective_layout(op, 4)
    assert len(before) == len(after) == 4
    fig = diagrams.draw_collective(op, 4)
    assert fig.axes
    matplotlib.pyplot.close(fig)


def test_layout_facts_and_errors():
    _, after = diagrams.collective_layout("all_to_all", 3)
    assert [label for _, label in after[1]] == ["0→1", "1→1", "2→1"]
    with pytest.raises(ValueError, match="op must be one of"):
        diagrams.collective_layout("all_to_some")
    with pytest.raises(ValueError, match="root"):
        diagrams.collective_layout("broadcast", 2, root=2)
    matplotlib.pyplot.close(diagrams.draw_ring_steps(3))
