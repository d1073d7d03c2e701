"""Pictures for the DDP lessons: the bucket layout of a model."""

from __future__ import annotations

__all__ = ["plot_buckets"]


def plot_buckets(layout: list[dict], param_sizes: dict | None = None, ax=None, title: str = ""):
    """Draw :meth:`BucketedDDP.bucket_layout`: one bar per bucket (left: first all-reduced),
    split into its parameters, width = bytes. ``param_sizes`` (name → elements) labels the
    parameters with their sizes. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.5 * len(layout) + 1.2), dpi=80)
    cmap = plt.get_cmap("tab10")
    for i, bucket in enumerate(layout):
        per_param = bucket["bytes"] / max(bucket["numel"], 1)
        x = 0.0
        for name in bucket["params"]:
            n = (param_sizes or {}).get(name)
            width = n * per_param / 1024 if n is not None else bucket["bytes"] / 1024 / len(bucket["params"])
            ax.barh(i, width, left=x, color=cmap(i % 10), edgecolor="white")
            ax.text(x + width / 2, i, name, ha="center", va="center", fontsize=6, rotation=0)
            x += width
    ax.set_yticks(range(len(layout)), [f"bucket {b['bucket']}" for b in layout])
    ax.invert_yaxis()
    ax.set_xlabel("KiB (fp32)")
    ax.set_title(title or "buckets, in the order they are all-reduced (top first)")
    return ax
