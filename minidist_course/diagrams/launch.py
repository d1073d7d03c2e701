"""Drawings for chapters 01 and 08: where the global ranks sit on the nodes, and the launcher tree.

* :func:`rank_layout` / :func:`draw_rank_grid` — nodes × local ranks → global ranks. torchrun
  numbers ``RANK = GROUP_RANK · LOCAL_WORLD_SIZE + LOCAL_RANK`` (the same count on every node);
  Slurm's default *block* distribution gives each node a consecutive block of task ids
  (``SLURM_PROCID``), in node order, whatever the count per node (``SLURM_TASKS_PER_NODE="3,2"``:
  ranks 0-2 on node 0, 3-4 on node 1); ``--distribution=cyclic`` deals them round-robin.
  Sources: the torchrun manual (environment variables), the srun manual (``--distribution``).
* :func:`draw_launcher_tree` — ``sbatch`` → ``srun`` (one task per node) → one torchrun agent per
  node → its workers, and the rendezvous store every agent joins (on the first node, at
  ``MASTER_ADDR:MASTER_PORT``).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

__all__ = ["rank_layout", "draw_rank_grid", "draw_launcher_tree"]


def rank_layout(tasks_per_node, distribution: str = "block") -> list[list[int]]:
    """``layout[node][local_rank]`` = the global rank, for the given number of tasks per node.

    ``distribution``: ``"block"`` (torchrun, and Slurm's default) or ``"cyclic"`` (Slurm's
    ``--distribution=cyclic``: rank r goes to the next node that still has room, round-robin).
    """
    counts = [int(c) for c in tasks_per_node]
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"tasks_per_node must be positive counts, got {tasks_per_node!r}")
    if distribution == "block":
        starts = [sum(counts[:n]) for n in range(len(counts))]
        return [[starts[n] + i for i in range(c)] for n, c in enumerate(counts)]
    if distribution == "cyclic":
        layout, rank = [[] for _ in counts], 0
        while rank < sum(counts):
            for n, c in enumerate(counts):
                if len(layout[n]) < c:
                    layout[n].append(rank)
                    rank += 1
        return layout
    raise ValueError(f"distribution must be 'block' or 'cyclic', got {distribution!r}")


def draw_rank_grid(tasks_per_node=(4, 4), launcher: str = "torchrun",
                   distribution: str = "block", ax=None):
    """One row per node, one cell per local rank, labelled with the global rank.

    ``launcher="torchrun"`` needs the same count on every node (``--nproc-per-node``) and labels
    the variables RANK / LOCAL_RANK / GROUP_RANK; ``"slurm"`` labels SLURM_PROCID / SLURM_LOCALID
    / SLURM_NODEID and accepts uneven counts.
    """
    if launcher not in ("torchrun", "slurm"):
        raise ValueError(f"launcher must be 'torchrun' or 'slurm', got {launcher!r}")
    counts = [int(c) for c in tasks_per_node]
    if launcher == "torchrun" and len(set(counts)) > 1:
        raise ValueError(f"torchrun starts the same number of workers on every node "
                         f"(--nproc-per-node), got {counts}")
    layout = rank_layout(counts, distribution)
    names = (("RANK", "LOCAL_RANK", "GROUP_RANK") if launcher == "torchrun"
             else ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 1.1 * max(counts), 0.6 + 0.75 * len(counts)), dpi=80)
    cmap = plt.get_cmap("tab10")
    for n, ranks in enumerate(layout):
        y = len(layout) - 1 - n
        ax.text(-0.15, y + 0.45, f"node {n}\n{names[2]}={n}", ha="right", va="center", fontsize=8)
        for i, r in enumerate(ranks):
            ax.add_patch(Rectangle((i, y + 0.05), 0.95, 0.8, facecolor=cmap(n % 10), alpha=0.35,
                                   edgecolor="black"))
            ax.text(i + 0.47, y + 0.52, f"{r}", ha="center", va="center", fontsize=11)
            ax.text(i + 0.47, y + 0.2, f"local {i}", ha="center", va="center", fontsize=6)
    title = {"torchrun": f"torchrun --nproc-per-node={counts[0]}\n"
                         f"RANK = GROUP_RANK·{counts[0]} + LOCAL_RANK",
             "slurm": f"Slurm, {distribution} distribution\n"
                      f"SLURM_TASKS_PER_NODE={','.join(map(str, counts))}"}[launcher]
    ax.set_title(title, fontsize=9)
    ax.text(max(counts) / 2, -0.05, f"cell: {names[0]} (large), {names[1]} (small)", ha="center",
            va="top", fontsize=7)
    ax.set_xlim(-1.6, max(counts) + 0.1)
    ax.set_ylim(-0.4, len(layout) + 0.1)
    ax.axis("off")
    return ax.figure


def _box(ax, x, y, text, colour, w=2.2, h=0.55, **kw):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05",
                                facecolor=colour, edgecolor="black", **kw))
    ax.text(x, y, text, ha="center", va="center", fontsize=7)
    return (x, y)


def _arrow(ax, a, b, h=0.55, **kw):
    ax.add_patch(FancyArrowPatch((a[0], a[1] - h / 2 - 0.05), (b[0], b[1] + h / 2 + 0.05),
                                 arrowstyle="-|>", mutation_scale=10, **kw))


def draw_launcher_tree(nnodes: int = 2, procs_per_node: int = 2, master_port: int = 29500):
    """sbatch → srun → one torchrun agent per node → workers, with the rendezvous store."""
    if nnodes < 1 or procs_per_node < 1:
        raise ValueError(f"nnodes and procs_per_node must be >= 1, got {nnodes}, {procs_per_node}")
    width = max(nnodes * procs_per_node * 1.25, nnodes * 2.6, 5.5)
    fig, ax = plt.subplots(figsize=(min(1.1 * width + 3, 12), 4.4), dpi=80)
    mid = width / 2
    sbatch = _box(ax, mid, 4.0, "sbatch job.sh\n(allocates the nodes, runs the script on node 0)",
                  "0.9", w=4.4)
    srun = _box(ax, mid, 3.0, f"srun --ntasks-per-node=1\n(one task on each of {nnodes} nodes)",
                "0.9", w=4.0)
    _arrow(ax, sbatch, srun)
    store = _box(ax, width + 1.5, 3.0, f"rendezvous store\n(c10d, node0:{master_port})",
                 "#fde0a0", w=2.3)
    node_w = width / nnodes
    for n in range(nnodes):
        cx = node_w * (n + 0.5)
        ax.add_patch(Rectangle((cx - node_w / 2 + 0.1, -0.55), node_w - 0.2, 3.0, fill=False,
                               linestyle=":", edgecolor="0.5"))
        ax.text(cx - node_w / 2 + 0.2, -0.5, f"node {n}", fontsize=7, color="0.4", va="bottom")
        agent = _box(ax, cx, 2.0, f"torchrun agent\n(GROUP_RANK={n})", "#cfe3f7", w=2.1)
        _arrow(ax, srun, agent)
        ax.add_patch(FancyArrowPatch((agent[0] + 1.05, agent[1]), (store[0] - 1.15, store[1]),
                                     arrowstyle="<->", linestyle="--", mutation_scale=8,
                                     color="#b07000", connectionstyle="arc3,rad=-0.15"))
        step = node_w / procs_per_node
        for i in range(procs_per_node):
            wx = cx - node_w / 2 + step * (i + 0.5)
            worker = _box(ax, wx, 0.4, f"worker\nRANK {n * procs_per_node + i}\nLOCAL_RANK {i}",
                          "#d8f0d0", w=min(1.1, step - 0.1), h=0.8)
            _arrow(ax, agent, (worker[0], worker[1] + 0.15))
    ax.set_xlim(-0.3, width + 2.8)
    ax.set_ylim(-0.7, 4.5)
    ax.axis("off")
    ax.set_title("Launcher tree: the agents meet at the rendezvous store;\n"
                 "each agent starts its workers with RANK, LOCAL_RANK, WORLD_SIZE", fontsize=9)
    return fig
