"""``minidist demo`` — the DDP section: train on the digits at world sizes 2 and 4 and check.

Rows (one dict each, printed by the CLI): test accuracy of bucketed DDP on the real handwritten
digits (its error: the gap to one process's accuracy), and the largest difference between the DDP parameters and one process trained on the same
global batches (:func:`~.data_parallel_training.global_batches`), plus replica equality. About 10 s on 2 cores.
"""

from __future__ import annotations

from ..references.data_parallel import max_abs_diff
from .data_parallel_training import train_digits

__all__ = ["demo_rows"]

ACCURACY_GOAL = 0.90
PARAM_TOL = 1e-5  # fp32, ~50-100 SGD steps with momentum: rounding only


def demo_rows(world_sizes=(2, 4), epochs: int = 5, timeout: float = 120) -> list[dict]:
    from minidist.launch import run

    rows = []
    for world in world_sizes:
        results = run(train_digits, world, "bucketed", epochs, timeout=timeout)
        single = train_digits(0, world, "single", epochs)
        ours = results[0]
        acc_gap = abs(ours["accuracy"] - single["accuracy"])
        rows.append({
            "section": "DDP", "check": "digits accuracy: DDP vs one process (MLP)",
            "world_size": world, "max_error": acc_gap, "ok": ours["accuracy"] >= ACCURACY_GOAL,
            "detail": f"accuracy {ours['accuracy']:.3f} (one process {single['accuracy']:.3f}; the "
                      f"error column is the gap) on 450 test digits after {epochs} epochs "
                      f"({ours['steps']} steps, global batch {32 * world}, lr {ours['lr']:.2f}); "
                      f"goal >= {ACCURACY_GOAL}"})
        diff = max_abs_diff(ours["params"], single["params"])
        rows.append({
            "section": "DDP", "check": "parameters equal one process on the global batch",
            "world_size": world, "max_error": diff, "ok": diff <= PARAM_TOL,
            "detail": f"max |p_ddp - p_single| = {diff:.1e} (tolerance {PARAM_TOL:g}, fp32)"})
        spread = max(max_abs_diff(r["params"], ours["params"]) for r in results)
        rows.append({
            "section": "DDP", "check": "replicas bit-identical across ranks",
            "world_size": world, "max_error": spread, "ok": spread == 0.0,
            "detail": f"max difference to rank 0 over {world} ranks: {spread:g}"})
    return rows
