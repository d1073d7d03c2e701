"""What counts as right in the user-loop matrix (:mod:`.user_loop`): equal to one process on the
global batch within :data:`TOL` (fp32), or refused with one of :data:`REFUSALS` — each a case
torch's own wrapper refuses too, with torch's words beside it. :data:`TORCH_FAILS`: cells where
torch's own wrapper fails in a way that would end the launch, reported without running.
"""

from __future__ import annotations

from .user_models import BASE

__all__ = ["TOL", "REFUSALS", "TORCH_FAILS", "torch_fails", "judge", "format_table"]

TOL = 1e-5
# (words of the library's refusal, the case, torch's words for the same case)
REFUSALS = (
    ("produced twice in one backward", "a parameter used twice under a reentrant checkpoint",
     "torch DDP: 'Expected to mark a variable ready only once'"),
    ("received no gradient in this backward", "a parameter unused on one rank",
     "torch DDP: 'Expected to have finished reduction in the prior iteration'"),
    ("frozen at wrap time", "the flat layout thawing a parameter frozen at wrap",
     "torch FSDP1: 'FlatParameter requires uniform requires_grad'"),
    ("you can only change requires_grad flags of leaf variables",
     "freezing one parameter of the flat layout (the module's parameters are views of one flat "
     "parameter)", "torch FSDP1 with use_orig_params=False: the same autograd error"),
    ("is frozen now, in a flat buffer", "freezing a parameter after ZeRO-1/2 packed it",
     "DeepSpeed ZeRO-1/2 fixes the trainable set at deepspeed.initialize; freezing after it "
     "fails: deepspeedai/DeepSpeed#4055"),
)

# torch's own wrappers where they fail in a way that would end the launch: not run, reported
# (a module flag of BASE, the wrapper's prefix, what goes wrong and where it is tracked)
TORCH_FAILS = (
    ("unused", "torch-fsdp2", "a parameter unused on one rank: FSDP2 reduce-scatters only the "
     "gradients a rank has, so the ranks' collectives differ in size (gloo aborts, NCCL hangs): "
     "pytorch/pytorch#158719"),
)


def torch_fails(spec: dict, how: str) -> str | None:
    """Why torch's wrapper ``how`` cannot run module ``spec`` (:data:`TORCH_FAILS`), or None."""
    spec = {**BASE, **spec}
    return next((why for flag, prefix, why in TORCH_FAILS
                 if spec[flag] and how.startswith(prefix)), None)


def _error(a: dict, b: dict) -> float:
    err = 0.0
    for k in b["final"]:
        err = max(err, (a["final"][k].float() - b["final"][k].float()).abs().max().item())
    for key in ("evals", "mids"):
        if len(a[key]) != len(b[key]):
            return float("inf")
        for p, q in zip(a[key], b[key]):
            pairs = [(p[k], q[k]) for k in q] if isinstance(p, dict) else [(p, q)]
            err = max([err] + [(u.float() - v.float()).abs().max().item() for u, v in pairs])
    return err


def judge(got, want) -> tuple[str, str]:
    """(status, detail): ✓ (equal to one process within :data:`TOL`), refused (a message of
    :data:`REFUSALS`), or ✗ (another error, or a wrong value)."""
    if isinstance(got, str):
        for words, case, theirs in REFUSALS:
            quoted = theirs.split("'")[1::2]          # torch's own words, for its wrappers' rows
            if words in got or any(q in got for q in quoted):
                return "refused", f"{case} ({theirs})"
        return "✗", got.splitlines()[0][:300]
    err = _error(got, want)
    return ("✓" if err <= TOL else "✗"), f"max error {err:.2e}"


def format_table(rows: list[dict]) -> str:
    """Per wrapper × event: ✓ / refused / ✗ counts over the modules, then every ✗ and refusal."""
    wrappers = list(dict.fromkeys(r["wrapper"] for r in rows))
    events = list(dict.fromkeys(r["event"] for r in rows))
    width = max(len(w) for w in wrappers) + 2
    head = "".join(f"{e[:13]:>15}" for e in events)
    lines = [f"{'wrapper':<{width}}{head}"]
    for w in wrappers:
        cellsum = []
        for e in events:
            mine = [r["status"] for r in rows if r["wrapper"] == w and r["event"] == e]
            bad, ref = mine.count("✗"), mine.count("refused")
            text = f"{mine.count('✓')}✓" + (f" {ref}r" if ref else "") + (f" {bad}✗" if bad else "")
            cellsum.append(f"{text:>15}")
        lines.append(f"{w:<{width}}" + "".join(cellsum))
    statuses = [r["status"] for r in rows]
    lines.append(f"\n{len(rows)} cells: {statuses.count('✓')} ✓, {statuses.count('refused')} "
                 f"refused, {statuses.count('✗')} ✗ (r: refused by name, as torch refuses it)")
    for r in rows:
        if r["status"] != "✓":
            mark = "✗" if r["status"] == "✗" else "refused"
            lines.append(f"{mark} {r['wrapper']} | {r['model']} | {r['event']}: {r['detail']}")
    return "\n".join(lines)
