"""minidist_course.diagrams: the ring schedule drawn in chapter 03 is the one minidist's ring runs."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import minidist  # noqa: E402
from minidist_course import diagrams  # noqa: E402
from minidist_course.planner import calc  # noqa: E402
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


# --------------------------------------------------------------------------- chapters 01, 06, 08
def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts] + \
        [ax.get_title() for ax in fig.axes]


def _patches(fig):
    return [p for ax in fig.axes for p in ax.patches]


def test_rank_layout_torchrun_and_slurm_block_and_cyclic():
    assert diagrams.rank_layout((4, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert diagrams.rank_layout((3, 2)) == [[0, 1, 2], [3, 4]]
    assert diagrams.rank_layout((2, 2, 1), "cyclic") == [[0, 3], [1, 4], [2]]
    with pytest.raises(ValueError, match="positive"):
        diagrams.rank_layout((2, 0))
    with pytest.raises(ValueError, match="block"):
        diagrams.rank_layout((2,), "plane")


def test_rank_layout_agrees_with_the_launch_environment_answers():
    from minidist_course.grading.launch_env import ENV_CASES
    for _, environ, want in ENV_CASES:
        if "RANK" in environ or "SLURM_TASKS_PER_NODE" not in environ:
            continue
        counts = []
        for piece in environ["SLURM_TASKS_PER_NODE"].split(","):  # "2(x2),1" -> 2, 2, 1
            n, _, times = piece.rstrip(")").partition("(x")
            counts += [int(n)] * int(times or 1)
        layout = diagrams.rank_layout(counts)
        assert layout[want["node_rank"]][want["local_rank"]] == want["rank"], environ


def test_draw_rank_grid():
    fig = diagrams.draw_rank_grid((4, 4))
    texts = _texts(fig)
    assert [str(r) for r in range(8)] == [t for t in texts if t.isdigit()]
    assert any("GROUP_RANK=1" in t for t in texts) and len(_patches(fig)) == 8
    matplotlib.pyplot.close(fig)
    fig = diagrams.draw_rank_grid((3, 2), "slurm")
    texts = _texts(fig)
    assert any("SLURM_TASKS_PER_NODE=3,2" in t for t in texts)
    assert any("SLURM_NODEID=1" in t for t in texts) and len(_patches(fig)) == 5
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="same number of workers"):
        diagrams.draw_rank_grid((3, 2), "torchrun")


def test_draw_launcher_tree():
    fig = diagrams.draw_launcher_tree(2, 3)
    texts = " | ".join(_texts(fig))
    for needle in ("sbatch", "srun", "torchrun agent\n(GROUP_RANK=1)", "rendezvous store",
                   "RANK 5\nLOCAL_RANK 2"):
        assert needle in texts, needle
    assert sum(t.startswith("worker\n") for t in _texts(fig)) == 6
    matplotlib.pyplot.close(fig)


def test_weight_split_shapes_and_drawing():
    assert diagrams.split_shapes(6, 8, 3, "column") == [(6, 3), (6, 3), (6, 2)]
    assert diagrams.split_shapes(7, 8, 2, "row") == [(4, 8), (3, 8)]
    # the same sizes as the library's shards (torch.tensor_split / chunk on these sizes)
    assert [s for _, s in diagrams.split_shapes(6, 8, 4, "column")] == \
        [c.shape[0] for c in torch.empty(8, 6).tensor_split(4)]
    fig = diagrams.draw_weight_split(6, 8, 2)
    texts = _texts(fig)
    assert "rank 1\nA_1: [6, 4]" in texts and "rank 1\nA_1: [3, 8]" in texts
    assert len(fig.axes) == 2 and len(_patches(fig)) == 4
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="column"):
        diagrams.split_shapes(6, 8, 2, "diagonal")


def test_draw_megatron_block_marks_f_and_g():
    fig = diagrams.draw_megatron_block()
    texts = _texts(fig)
    assert texts.count("f") == 2 and texts.count("g") == 2
    assert any("column-parallel" in t for t in texts) and any("row-parallel" in t for t in texts)
    matplotlib.pyplot.close(fig)


def test_draw_sequence_parallel_regions():
    fig = diagrams.draw_sequence_parallel(world_size=2, seq_len=8)
    texts = _texts(fig)
    assert "tokens 0..3" in texts and "tokens 4..7" in texts
    assert any(t.startswith("all-gather") for t in texts)
    assert any(t.startswith("reduce-scatter") for t in texts)
    matplotlib.pyplot.close(fig)


# --------------------------------------------------------------------------- chapter 09
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 64])
def test_parallelism_memory_agrees_with_calc(world_size):
    # calc.zero_memory is an independent implementation (training_memory's weights/grads/optimizer)
    psi = 7.5e9
    got = diagrams.parallelism_memory(psi, world_size, tp=3, pp=4)
    for stage, name in enumerate(("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")):
        assert got[name] == pytest.approx(calc.zero_memory(psi, world_size, stage), rel=1e-12)
    assert got["TP"] == pytest.approx(calc.training_memory(psi, "fp16").total / 3, rel=1e-12)
    assert got["PP"] == pytest.approx(calc.training_memory(psi, "fp16").total / 4, rel=1e-12)


def test_parallelism_memory_zero_paper_figure_1():
    # ZeRO §5, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB
    got = diagrams.parallelism_memory(7.5e9, 64)
    assert [round(got[n] / 1e9, 1) for n in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == \
        [120.0, 31.4, 16.6, 1.9]


def test_largest_fitting_is_where_the_memory_runs_out():
    fits = diagrams.largest_fitting(80e9, world_size=64, tp=8, pp=4)
    for name, psi in fits.items():
        assert diagrams.parallelism_memory(psi, 64, 8, 4)[name] == pytest.approx(80e9)
        assert diagrams.parallelism_memory(psi * 1.01, 64, 8, 4)[name] > 80e9
    assert fits["DP"] == pytest.approx(5e9)          # 80 GB / 16 bytes per parameter
    assert fits["DP"] < fits["ZeRO-1"] < fits["ZeRO-2"] < fits["ZeRO-3"]
    with pytest.raises(ValueError, match="memory"):
        diagrams.largest_fitting(0)


def test_draw_parallelism_memory_and_errors():
    fig = diagrams.draw_parallelism_memory(world_size=64, tp=8, pp=4)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [lab.split(" ")[0] for lab in labels] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP", "PP"]
    assert "ZeRO-3 (N=64): fits ≤ 320B" in labels and "DP (N=64): fits ≤ 5B" in labels
    assert any("80 GB" in t.get_text() for t in ax.texts)
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        diagrams.parallelism_memory(1e9, tp=0)
    with pytest.raises(ValueError, match="psi"):
        diagrams.parallelism_memory(0)
    with pytest.raises(ValueError, match="device must be one of"):
        diagrams.draw_parallelism_memory(device="TPU")


def test_draw_divergence_boxes_the_first_divergence():
    from minidist_course.references.bisect import Report
    from minidist_course.references.diagnose import Divergence
    errors = {(0, "forward", "blocks.0"): 0.0, (0, "backward", "blocks.0"): 1.0,
              (0, "gradients", "blocks.0.attn.qkv.weight"): 1e-6,
              (0, "gradients", "blocks.0.ln1.bias"): 1e-5,
              (1, "forward", "blocks.0"): 1e-3, (1, "backward", "blocks.0"): 2.0}
    first = Divergence(0, "backward", "blocks.0", [1], 1.0, 1e-5, "scaled")
    fig = diagrams.draw_divergence(Report([first], errors, 1e-5, [(1.0, 1.0)] * 2))
    ax = fig.axes[0]
    image = ax.images[0].get_array()
    assert image.shape == (3, 2) and image.max() == 4.0 and image.min() == -4.0   # clipped
    assert image[2, 0] == 0.0                  # a module's row: its worst parameter, 1e-5 / 1e-5
    box = ax.patches[0]
    assert box.get_xy() == (-0.5, 0.5)          # step 0, the second row (backward blocks.0)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["step 0", "step 1"]
    assert ax.get_yticklabels()[2].get_text() == "grad  blocks.0"
