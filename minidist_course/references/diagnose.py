"""Compare a parallel run's records with one process's, tensor by tensor, and say what the error
looks like (the patterns of :mod:`.bisect`'s docstring).

Each rank's piece is compared with the same piece of the one-process tensor — the samples of its
DP slice and micro-batch, the positions of its CP shard (and sequence-parallel chunk), the columns
of its vocabulary shard — so a divergence is attributed to the ranks whose pieces are off, without
reassembling anything. A tensor's error is ``‖got − ref‖ / ‖ref‖`` over all pieces together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minidist.context_parallel.sharding import positions

__all__ = ["Divergence", "diagnose", "compare_all"]

@dataclass
class Divergence:
    """One tensor beyond budget: ``step``, ``phase`` (forward, backward, gradients), ``name``
    (``blocks.2``, ``logits``, a parameter's GPT name), ``ranks`` (global ranks whose piece is off),
    ``error`` and ``budget`` (relative), ``diagnosis`` (words)."""
    step: int
    phase: str
    name: str
    ranks: list = field(default_factory=list)
    error: float = 0.0
    budget: float = 0.0
    diagnosis: str = ""

    def format(self) -> str:
        what = {"forward": "output", "backward": "output gradient", "gradients": "gradient"}[self.phase]
        return (f"step {self.step}, {self.phase}: {self.name} {what} on rank(s) "
                f"{_ranks(self.ranks)}: error {self.error:.2e} (budget {self.budget:.1e}) — "
                f"{self.diagnosis}")


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 6 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def _scale_names(sizes: dict) -> list[tuple[float, str]]:
    W = sizes["dp"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
    out = []
    pairs = [(sizes["dp"], "dp"), (sizes["cp"], "cp"), (sizes["tp"], "tp"), (sizes["pp"], "pp")]
    if sizes["dp"] > 1 and sizes["cp"] > 1:
        pairs.append((sizes["dp"] * sizes["cp"], "dp·cp"))
    for value, label in pairs + [(W, "W")]:
        if value > 1:
            out += [(float(value), label), (1.0 / value, f"1/{label}")]
    return out


def diagnose(got: torch.Tensor, ref: torch.Tensor, sizes: dict, budget: float,
             bad_ranks: list, all_ranks: list, ignored: torch.Tensor | None = None) -> str:
    """Words for the pattern of ``got`` against ``ref`` (same shape, float). ``sizes``: the grid's
    dp/cp/tp/pp; ``bad_ranks``/``all_ranks``: the ranks whose pieces are off / that hold one;
    ``ignored``: a bool per row (leading dims) whose target is ignored, or None."""
    g, r = got.double().reshape(-1), ref.double().reshape(-1)
    rr, gg, gr = float(r @ r), float(g @ g), float(g @ r)
    if rr == 0.0:
        return "the one-process tensor is zero; this one is not"
    cos = gr / math.sqrt(gg * rr) if gg else 0.0
    scale = gr / rr
    if (g - r).norm().item() < 4 * budget * math.sqrt(rr):
        return (f"near the budget (cos {cos:.6f}): more rounding than sums in another order "
                "explain, or a small bug")
    if cos > 1 - 1e-4:
        names = [label for value, label in _scale_names(sizes) if abs(scale / value - 1) < 0.02]
        if names:
            why = ("a sum where an average belongs, or a count too small" if scale > 1 else
                   "divided once too often, or a count too large")
            return f"scaled by {scale:.4g} ≈ {' = '.join(names)}: {why}"
        return f"scaled by {scale:.4g} (the direction is right): a wrong weight or count"
    if cos < -(1 - 1e-4):
        return "sign flipped"
    if got.dim() >= 2 and got.shape[0] > 1:    # rows each proportional, by different factors?
        G, R = got.double().flatten(1), ref.double().flatten(1)
        live = R.norm(dim=1) > 0
        gr_rows, rr_rows = (G * R).sum(1)[live], (R * R).sum(1)[live]
        cos_rows = gr_rows / (G.norm(dim=1)[live] * R.norm(dim=1)[live]).clamp_min(1e-300)
        factors = gr_rows / rr_rows
        if live.any() and bool((cos_rows > 1 - 1e-4).all()) and float(factors.max() - factors.min()) > 1e-3:
            return (f"each row scaled by its own factor ({float(factors.min()):.3g} to "
                    f"{float(factors.max()):.3g}): a loss weight per micro-batch, replica or "
                    "token count is wrong")
    if torch.allclose(g.sort().values, r.sort().values, rtol=budget, atol=budget * r.abs().max().item()):
        return "permuted: the right values in the wrong places (a split or layout mismatch)"
    if ignored is not None and got.dim() >= 2:
        rows = (got - ref).double().flatten(ignored.dim()).norm(dim=-1)
        off = rows > budget * ref.double().flatten(ignored.dim()).norm(dim=-1).clamp_min(1e-30)
        if off.any() and bool(ignored[off].all()):
            return "only rows whose targets are ignored (-100) differ: padding handled wrong"
        if off.any() and not bool(off.all()):
            share = float(off.double().mean())
            note = f"{share:.0%} of the rows differ"
            return (note + f", only rank(s) {_ranks(bad_ranks)}'s" if set(bad_ranks) < set(all_ranks)
                    else note)
    if set(bad_ranks) < set(all_ranks):
        return (f"only rank(s) {_ranks(bad_ranks)} of {_ranks(all_ranks)}: a replica or shard not "
                f"synchronised (cos {cos:.3f})")
    return f"differs everywhere (cos {cos:.3f}, best scale {scale:.3g})"


def _piece(ref: torch.Tensor, res: dict, mb: int, layout: dict, name: str, tensor: torch.Tensor,
           covered: torch.Tensor):
    """The one-process piece rank ``res`` holds of ``ref`` (and its ignored mask); marks the
    (sample, position) pairs it holds in ``covered``."""
    c, z = res["coords"], res["sizes"]
    samples = torch.arange(layout["B"]).tensor_split(z["dp"])[c["dp"]].tensor_split(layout["M"])[mb]
    s = layout["s"]
    pos = positions(res["split"], s, z["cp"], c["cp"]) if z["cp"] > 1 else torch.arange(s)
    if tensor.shape[1] != pos.numel():        # a sequence-parallel chunk of the TP group
        pos = pos.chunk(z["tp"])[c["tp"]]
    piece = ref[samples][:, pos]
    covered[samples.unsqueeze(1), pos.unsqueeze(0)] = True
    if name == "logits":                       # this TP rank's vocabulary columns, padding cut
        width = tensor.shape[-1]
        cols = torch.arange(c["tp"] * width, (c["tp"] + 1) * width)
        keep = cols < layout["V"]
        piece = piece[..., cols[keep]]
        tensor = tensor[..., keep]
    return piece, tensor, layout["ignored"][samples][:, pos]


def _activation_scale(layout: dict, sizes: dict) -> float:
    return {"sum": 1.0, "per_token": float(layout["tokens"]),
            "mean": float(sizes["dp"] * sizes["cp"])}[layout["reduction"]]


def compare_all(results: list, acts: dict, grads: list, layout: dict, budget: float,
                steps: int) -> tuple[list, dict]:
    """Every recorded tensor against one process, in report order; returns ``(divergences,
    errors)``: ``errors[(step, phase, name)]`` is every compared tensor's relative error."""
    sizes = results[0]["sizes"]
    errors: dict = {}
    names = ["embed"] + [f"blocks.{i}" for i in range(results[0]["cfg"].n_layer)] + ["logits"]
    out: list = []
    for step in range(steps):
        for phase, order in (("forward", names), ("backward", names[::-1])):
            for name in order:
                ref = acts.get((step, phase, name))
                pieces = [(res, mb, t) for res in results for (st, ph, n, mb, t) in res["records"]
                          if (st, ph, n) == (step, phase, name)]
                if ref is None:
                    continue
                if not pieces:   # a defect of the recording, not of the run: say so
                    raise RuntimeError(f"bisect: no rank recorded {name} ({phase}, step {step})")
                if phase == "backward":
                    ref = ref * _activation_scale(layout, sizes)
                d, errors[(step, phase, name)] = _compare(pieces, ref, layout, name, sizes,
                                                          budget, step, phase)
                if d is not None:
                    out.append(d)
        ref_grads = grads[step]
        for name in reversed(list(ref_grads) + (["head.weight"] if "head.weight" not in ref_grads else [])):
            ref = ref_grads.get(name, ref_grads.get("tok_emb.weight") if name == "head.weight" else None)
            held = [(res, res["grads"][step][name]) for res in results if name in res["grads"][step]]
            if ref is None or not held:
                continue
            errs = {res["coords"]["rank"]: _rel(t, ref) for res, t in held}
            errors[(step, "gradients", name)] = max(errs.values())
            bad = sorted(r for r, e in errs.items() if e > budget)
            if bad:
                got = torch.stack([t for res, t in held if res["coords"]["rank"] in bad])
                whole = _rel(got, ref.expand_as(got))
                agree = all(torch.equal(g, got[0]) for g in got[1:])   # replicas, or parts?
                other = [res["grads"][step]["tok_emb.weight"] for res in results
                         if name == "head.weight" and "tok_emb.weight" in res["grads"][step]
                         and "head.weight" not in ref_grads]
                if other and _rel(got[0] + other[0], ref) <= 2 * budget:
                    why = ("partial: the tied embedding's two copies (first and last stage) add up "
                           "to the one-process gradient — their sum over the embedding group is "
                           "missing")
                elif not agree and _rel(got.sum(0), ref) <= budget * len(bad):
                    why = (f"partial: the copies on ranks {_ranks(bad)} add up to the one-process "
                           "gradient — a sum over their group is missing")
                else:
                    why = diagnose(got, ref.expand_as(got), sizes, budget, bad, sorted(errs))
                    if not any(d.step == step for d in out):   # activations all within budget
                        why += ("; this step's activations and their gradients agree, so the "
                                "error enters after the local backward: in a gradient reduction "
                                "or a scale (loss weight, token count) applied to the gradients")
                out.append(Divergence(step, "gradients", name, bad, whole, budget, why))
    return out, errors


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.double().norm().item()
    num = (got.double() - ref.double()).norm().item()
    return num / den if den else (0.0 if num == 0 else math.inf)


def _compare(pieces, ref, layout, name, sizes, budget, step, phase):
    got_all, ref_all, ign_all, bad, holders = [], [], [], [], []
    covered = torch.zeros(ref.shape[:2], dtype=torch.bool)
    for res, mb, t in pieces:
        piece, t, ignored = _piece(ref, res, mb, layout, name, t, covered)
        rank = res["coords"]["rank"]
        holders.append(rank)
        if _rel(t, piece) > budget:
            bad.append(rank)
        got_all.append(t.reshape(-1, *t.shape[2:]).float())
        ref_all.append(piece.reshape(-1, *piece.shape[2:]).float())
        ign_all.append(ignored.reshape(-1))
    ignored = torch.cat(ign_all)
    if len({t.shape[1:] for t in got_all}) > 1:   # vocabulary shards of unequal width
        got_all, ref_all, ignored = [t.reshape(-1) for t in got_all], [t.reshape(-1) for t in ref_all], None
    if not bool(covered.all()):   # a defect of the reassembly, not of the run
        raise RuntimeError(f"bisect: the ranks' pieces of {name} ({phase}, step {step}) cover "
                           f"{int(covered.sum())} of {covered.numel()} (sample, position) pairs")
    got, want = torch.cat(got_all), torch.cat(ref_all)
    err = _rel(got, want)
    if err <= budget and not bad:
        return None, err
    bad, holders = sorted(set(bad)), sorted(set(holders))
    return Divergence(step, phase, name, bad or holders, err, budget,
                      diagnose(got, want, sizes, budget, bad or holders, holders, ignored)), err
