"""Grade exercise 16: the two rules of checkpoint generations, against
:mod:`minidist.resume_rule` (which :mod:`minidist.checkpoint_io` applies to real folders).

The learner writes (see ``exercises/16_checkpoint_generations.ipynb``), on a listing
``[(number, status), ...]`` in any order, ``status`` one of ``"unfinished"`` (no manifest: the
save never finished), ``"corrupt"`` (a manifest, but a file differs from it) or ``"verified"``:

* ``pick(listing, generation=None, fallback=False) -> int``: the generation a run resumes from,
  raising ``FileNotFoundError`` / ``ValueError`` as the library does;
* ``retire(listing, new, keep) -> list[int]``: what a save of ``new`` removes, oldest first.

Named cases first, then listings hypothesis draws (up to 8 generations, every status, numbers
with gaps, any order). A wrong answer is matched against the usual slips and named by its rule.
"""

from __future__ import annotations

from minidist.resume_rule import choose_generation, generations_to_retire
from .core import Report
from .generated import generated_check, st

__all__ = ["PICK_RULES", "RETIRE_RULES", "PICK_CASES", "RETIRE_CASES", "grade_pick",
           "grade_retire"]

PICK_RULES = {
    "complete": "never resume from an unfinished save (no manifest): it did not finish",
    "newest": "the newest complete generation by number, whatever the listing's order",
    "fallback": "only fallback=True skips a corrupt generation (to the newest one that verifies; "
                "ValueError when none does); without it the newest complete one is taken, and its "
                "load then fails loudly on the checksum",
    "asked": "generation=n returns n if it is complete, else raises FileNotFoundError",
    "none": "no complete generation at all: FileNotFoundError, never a guess",
}
RETIRE_RULES = {
    "new": "the generation just saved is never removed",
    "good": "keep counts the new one and the older ones that are complete and verify: a corrupt "
            "or unfinished one never pushes out a good one",
    "older": "everything older than the last good one kept is removed, unfinished and corrupt "
             "ones included; nothing newer than it is",
    "list": "returns the numbers removed as a list of ints, oldest first",
    "sorted": "the listing comes in any order (a directory's listing is not sorted): order the "
              "generations by number before counting the good ones",
}

V, C, U = "verified", "corrupt", "unfinished"
PICK_CASES = [  # (listing, generation, fallback)
    ([(1, V), (2, V), (3, V)], None, False),
    ([(1, V), (2, V), (3, U)], None, False),          # a save killed before its manifest
    ([(3, V), (1, V), (2, V)], None, False),          # listed out of order
    ([(1, V), (2, C)], None, False),                  # corrupt newest: taken, its load fails
    ([(1, V), (2, C)], None, True),                   # ... unless falling back
    ([(1, V), (2, C), (3, U)], None, True),
    ([(1, C), (2, C)], None, True),                   # nothing to fall back to: ValueError
    ([(1, U)], None, False),                          # FileNotFoundError
    ([], None, False),
    ([(1, V), (2, V)], 1, False),                     # asked for generation 1
    ([(1, V), (2, U)], 2, False),                     # asked for an unfinished one
    ([(1, V), (2, V)], 3, False),                     # asked for one that does not exist
]
RETIRE_CASES = [  # (listing, new, keep)
    ([(1, V), (2, V), (3, V)], 3, 1),
    ([(1, V), (2, V), (3, V)], 3, 2),
    ([(1, V), (2, C), (3, V)], 3, 2),                 # the corrupt 2 does not count
    ([(1, V), (2, U), (3, V), (4, V)], 4, 2),
    ([(1, V), (2, C), (3, U), (4, V), (5, V)], 5, 3),
    ([(4, V), (2, U), (5, V), (1, V)], 5, 1),         # out of order
]


def _reference_pick(listing, generation, fallback):
    status = dict(listing)
    return choose_generation([(n, s != U) for n, s in listing], generation, fallback,
                             lambda n: status[n] == V)


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except (FileNotFoundError, ValueError) as e:
        return None, type(e)


def _pick_check(fn, case):
    listing, generation, fallback = case
    want, want_error = _outcome(_reference_pick, listing, generation, fallback)
    try:
        got, got_error = _outcome(lambda *a: fn(list(a[0]), generation=a[1], fallback=a[2]),
                                  listing, generation, fallback)
    except Exception as e:  # noqa: BLE001 - another exception: name what was expected
        got, got_error = f"{type(e).__name__}: {e}", None
    status = dict(listing)
    expected = want_error.__name__ if want_error else f"generation {want}"
    gave = got_error.__name__ if got_error else repr(got)
    text = f"expected {expected}, got {gave}"
    if got_error is want_error and (want_error or got == want):
        return None
    if generation is not None:
        return "asked", text + (" (generation= is answered before fallback is looked at)"
                                if fallback else "")
    if want_error is FileNotFoundError:
        return "none", text + ": no generation here is complete (with or without fallback)"
    if status.get(got) == U:
        return "complete", text + f": generation {got} has no manifest (the save never finished)"
    if fallback and C in status.values():
        return "fallback", (f"expected {expected} — the newest complete one that verifies, "
                            f"however many corrupt ones are newer — got {gave}")
    if want_error is ValueError or status.get(got) == C or (not fallback and status.get(want) == C):
        return "fallback", text
    return "newest", (f"expected {expected} — the largest number among the complete ones — "
                      f"got {gave}")


def _describe_pick(case):
    listing, generation, fallback = case
    return (f"listing {listing}" + (f", generation={generation}" if generation is not None else "")
            + (", fallback=True" if fallback else ""))


def _pick_inputs():
    listing = st.dictionaries(st.integers(0, 20), st.sampled_from([V, C, U]), max_size=8).map(
        lambda d: list(d.items()))
    return st.tuples(listing, st.one_of(st.none(), st.integers(0, 20)), st.booleans())


def grade_pick(fn, total: float = 3) -> Report:
    """``fn(listing, generation=None, fallback=False)`` against :func:`choose_generation`."""
    report = Report("Part A: which generation a run resumes from", total=total, rules=PICK_RULES)
    for case in PICK_CASES:
        report.check(_describe_pick(case), lambda c=case: _pick_check(fn, c))
    generated_check(report, "listings of up to 8 generations", _pick_inputs(),
                    lambda c: _pick_check(fn, c), max_examples=150, describe=_describe_pick,
                    crash_rule="newest")
    return report


def _retire_check(fn, case):
    listing, new, keep = case
    status = dict(listing)
    want = generations_to_retire([(n, s != U) for n, s in listing], new, keep,
                                 lambda n: status[n] == V)
    got = fn(list(listing), new, keep)
    if not isinstance(got, list) or not all(isinstance(n, int) for n in got):
        return "list", f"expected a list of ints, got {got!r}"
    if got == want:
        return None
    text = f"expected {want}, got {got}"
    if new in got:
        return "new", text
    if listing != sorted(listing) and _same_answer(fn, sorted(listing), new, keep, want):
        return "sorted", text + (": your function gives the right answer when the listing is "
                                 "sorted, so it reads the listing's order as the generations' "
                                 "order")
    if sorted(got) == sorted(want):
        return "list", text + ": the right numbers, not oldest first"
    kept = sorted(set(status) - set(got) - {new})
    good = 1 + sum(s == V for n, s in status.items() if n != new)
    if good < keep and got:
        return "older", text + (f": only {good} good generation(s) exist (the new one included), "
                                f"fewer than keep = {keep}: nothing is removed yet")
    for off in (1, -1):
        if keep + off >= 1 and got == generations_to_retire(
                [(n, s != U) for n, s in listing], new, keep + off, lambda n: status[n] == V):
            return "good", text + (f": that keeps {keep + off} good ones, not {keep} — the new "
                                   "generation counts as the first of them")
    if any(status[n] != V for n in set(want) - set(got)) and set(got) <= set(want):
        return "older", text + ": an unfinished or corrupt generation older than the last good " \
                               "one kept must go too"
    newer = [n for n in got if n not in want]
    if newer and all(status[n] != V for n in newer):
        return "older", text + f": {newer} are newer than the last good one kept: they stay"
    if len([n for n in kept if status[n] == V]) + 1 != min(keep, 1 + sum(
            status[n] == V for n in status if n != new)):
        return "good", text + f" (you kept {kept} besides the new one: only complete " \
                              f"generations that verify count toward keep = {keep})"
    return "good", text


def _same_answer(fn, listing, new, keep, want) -> bool:
    try:
        return fn(list(listing), new, keep) == want
    except Exception:  # noqa: BLE001 - the learner's code on another input: only a hint
        return False


def _describe_retire(case):
    listing, new, keep = case
    return f"listing {listing}, new {new}, keep {keep}"


def _retire_inputs():
    older = st.dictionaries(st.integers(0, 19), st.sampled_from([V, C, U]), max_size=7)
    return st.tuples(older, st.integers(20, 25), st.integers(1, 5)).map(
        lambda t: (list(t[0].items()) + [(t[1], V)], t[1], t[2]))


def grade_retire(fn, total: float = 2) -> Report:
    """``fn(listing, new, keep)`` against :func:`generations_to_retire`."""
    report = Report("Part B: what a save retires", total=total, rules=RETIRE_RULES)
    for case in RETIRE_CASES:
        report.check(_describe_retire(case), lambda c=case: _retire_check(fn, c))
    generated_check(report, "listings of up to 8 generations, keep 1-5", _retire_inputs(),
                    lambda c: _retire_check(fn, c), max_examples=150,
                    describe=_describe_retire, crash_rule="list")
    return report
