"""Every rule an exercise part teaches has a plausible wrong solution that its grader rejects by
naming that rule. ``RULES`` (minidist/grading/rules.py) lists the rules; ``MUTANTS`` below are the
official solutions with one typical mistake each. A rule without a rejecting mutant fails
``test_every_rule_has_a_mutant``; a mutant the grader accepts, or rejects for another rule only,
fails ``test_grader_rejects_mutant_naming_its_rule``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

import _solutions
from minidist.grading.rules import RULES

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    notebook: str          # stem of solutions/*.ipynb
    grade_id: str          # the grading cell that must reject it
    rule: str              # the rule it breaks (a key of RULES[notebook][grade_id])
    cell: str              # the grade_id of the solution cell it edits
    edits: tuple           # ((old, new), ...): exact text replaced in that cell, each must occur
    what: str = ""         # the mistake, in words

    @property
    def id(self):
        return f"{self.notebook[:2]}-{self.grade_id}-{self.rule}-{self.what[:40]}"


def _cell_source(notebook, cell):
    nb = json.loads((ROOT / "solutions" / f"{notebook}.ipynb").read_text())
    for c in nb["cells"]:
        if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == cell:
            return "".join(c["source"])
    raise KeyError(f"{notebook}: no cell {cell}")


def mutate(m: Mutant) -> dict:
    src = _cell_source(m.notebook, m.cell)
    for old, new in m.edits:
        assert old in src, f"{m.id}: {old!r} is not in cell {m.cell} (the solution changed?)"
        src = src.replace(old, new)
    return {m.cell: src}


M = Mutant
MUTANTS = [
    # ------------------------------------------------------------------ 04 Part A
    M("04_bucketed_ddp", "build_buckets_grade", "reverse", "build_buckets",
      (("reversed(list(params))", "list(params)"),), "registration order, not reversed"),
    M("04_bucketed_ddp", "build_buckets_grade", "cap", "build_buckets",
      (("        if current and size + nbytes > cap_bytes:\n            buckets.append(current)\n"
        "            current, size = [], 0\n        current.append(p)\n        size += nbytes\n",
        "        current.append(p)\n        size += nbytes\n        if size > cap_bytes:\n"
        "            buckets.append(current)\n            current, size = [], 0\n"),),
      "closed after overflowing"),
    M("04_bucketed_ddp", "build_buckets_grade", "whole", "build_buckets",
      (("if current and size + nbytes > cap_bytes:", "if size + nbytes > cap_bytes:"),),
      "an empty bucket before a big parameter"),
    # ------------------------------------------------------------------ 04 Part B
    M("04_bucketed_ddp", "my_ddp_grade", "average", "my_ddp",
      (("buf.div_(self.world_size)", "pass"),), "no division by W"),
    M("04_bucketed_ddp", "my_ddp_grade", "equal", "my_ddp",
      (("p.grad.copy_(buf[offset: offset + p.numel()].view_as(p))",
        "p.grad.copy_(buf[offset: offset + p.numel()].view_as(p))\n                offset -= 0"),
       ("                offset += p.numel()\n        self.works, self.filled",
        "        self.works, self.filled")), "every slot read at offset 0"),
    M("04_bucketed_ddp", "my_ddp_grade", "order", "my_ddp",
      (("        while (len(self.works) < len(self.buckets)\n"
        "               and self.filled[len(self.works)] == len(self.buckets[len(self.works)])):\n"
        "            j = len(self.works)\n",
        "        if self.filled[i] == len(self.buckets[i]):\n            j = i\n"),
       ("        for work, buf, bucket in zip(self.works, self.buffers, self.buckets):",
        "        self.works = [w for _, w in sorted(zip(self.launch_log[-len(self.buckets):], "
        "self.works), key=lambda t: t[0][0])]\n"
        "        for work, buf, bucket in zip(self.works, self.buffers, self.buckets):")),
      "launched in readiness order"),
    M("04_bucketed_ddp", "my_ddp_grade", "overlap", "my_ddp",
      (("        while (len(self.works) < len(self.buckets)\n"
        "               and self.filled[len(self.works)] == len(self.buckets[len(self.works)])):\n"
        "            j = len(self.works)\n"
        "            self.launch_log.append((j, self.ready_count))\n"
        "            self.works.append(dist.all_reduce(self.buffers[j], async_op=True))\n", ""),
       ("        if len(self.works) != len(self.buckets):",
        "        for j in range(len(self.buckets)):\n"
        "            self.launch_log.append((j, self.ready_count))\n"
        "            self.works.append(dist.all_reduce(self.buffers[j], async_op=True))\n"
        "        if len(self.works) != len(self.buckets):")), "every bucket launched after backward"),
    M("04_bucketed_ddp", "my_ddp_grade", "async", "my_ddp",
      (("self.works.append(dist.all_reduce(self.buffers[j], async_op=True))",
        "dist.all_reduce(self.buffers[j])\n            self.works.append(None)"),
       ("            work.wait()\n", "")), "a blocking all-reduce in the hook, no wait"),
    M("04_bucketed_ddp", "my_ddp_grade", "async", "my_ddp",
      (("self.works.append(dist.all_reduce(self.buffers[j], async_op=True))",
        "self.works.append(dist.all_reduce(self.buffers[j], async_op=True))\n"
        "            self.works[-1].wait()"),), "waited inside the hook"),
    M("04_bucketed_ddp", "my_ddp_grade", "wait", "my_ddp",
      (("            work.wait()\n", ""),), "no wait"),
    M("04_bucketed_ddp", "my_ddp_grade", "reset", "my_ddp",
      (("        self.works, self.filled, self.ready_count = [], [0] * len(self.buckets), 0\n", ""),),
      "per-step state never reset"),
    # ------------------------------------------------------------------ 09 Part A
    M("09_zero", "zero1_grade", "pad", "zero1",
      (("        flat = torch.zeros(self.W_S)\n        offset = 0\n        for p in self.params:\n"
        "            flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))\n"
        "            offset += p.numel()\n        return flat\n",
        "        return torch.cat([p.grad.reshape(-1) for p in self.params])\n"),),
      "gradients concatenated, no padding"),
    M("09_zero", "zero1_grade", "average", "zero1",
      (("self.mine.grad = mine / self.world", "self.mine.grad = mine"),), "no division by W"),
    M("09_zero", "zero1_grade", "gather", "zero1",
      (("        self.optimizer.step()\n        all_gather(self.flat, self.mine.clone())\n",
        "        all_gather(self.flat, self.mine.clone())\n        self.optimizer.step()\n"),),
      "all-gather before the step"),
    M("09_zero", "zero1_grade", "equal", "zero1",
      (("        for p in self.params:\n            flat[offset", "        for p in self.params[::-1]:\n            flat[offset"),),
      "gradients packed in reverse order"),
    M("09_zero", "zero1_grade", "traffic", "zero1",
      (("        mine = torch.empty(self.S)\n        reduce_scatter(mine, flat)\n",
        "        dist.all_reduce(flat)\n        mine = flat[self.rank * self.S:(self.rank + 1) * self.S]\n"),),
      "all-reduce then slice"),
    M("09_zero", "zero1_grade", "state", "zero1",
      (("        self.optimizer = optimizer_class([self.mine], **defaults)\n",
        "        self.optimizer = optimizer_class([self.mine], **defaults)\n"
        "        self.full = optimizer_class(self.params, **defaults)\n"),
       ("        flat = self.flat_grad()\n        mine = torch.empty(self.S)\n        reduce_scatter(mine, flat)\n"
        "        self.mine.grad = mine / self.world\n        self.optimizer.step()\n"
        "        all_gather(self.flat, self.mine.clone())\n",
        "        for p in self.params:\n            dist.all_reduce(p.grad)\n            p.grad /= self.world\n"
        "        self.full.step()\n")), "a full optimizer under another name"),
    # ------------------------------------------------------------------ 09 Part B
    M("09_zero", "zero2_grade", "average", "zero2",
      (("self.mine.grad = self.reduced / self.world", "self.mine.grad = self.reduced"),),
      "no division by W"),
    M("09_zero", "zero2_grade", "gather", "zero2",
      (("        self.optimizer.step()\n        all_gather(self.flat, self.mine.clone())\n",
        "        all_gather(self.flat, self.mine.clone())\n        self.optimizer.step()\n"),),
      "all-gather before the step"),
    M("09_zero", "zero2_grade", "equal", "zero2",
      (("        o = self.offsets[p]\n", "        o = self.offsets[p] + (p.numel() % 2)\n"),
       ("        self.grad_flat[o:o + p.numel()]", "        self.grad_flat[o:o + p.numel()]"),),
      "some slots one element off"),
    M("09_zero", "zero2_grade", "traffic", "zero2",
      (("            self.reduced = torch.empty(self.S)\n"
        "            self.work = reduce_scatter(self.reduced, self.grad_flat, async_op=True)\n",
        "            self.work = dist.all_reduce(self.grad_flat, async_op=True)\n"),
       ("        self.mine.grad = self.reduced / self.world\n",
        "        self.mine.grad = self.grad_flat[self.rank * self.S:(self.rank + 1) * self.S] / self.world\n")),
      "all-reduce in the hook, then slice"),
    M("09_zero", "zero2_grade", "state", "zero2",
      (("        super().__init__(params, optimizer_class, **defaults)\n",
        "        super().__init__(params, optimizer_class, **defaults)\n"
        "        self.full = optimizer_class(self.params, **defaults)\n"),
       ("        self.mine.grad = self.reduced / self.world\n        self.optimizer.step()\n"
        "        all_gather(self.flat, self.mine.clone())\n",
        "        g = torch.empty(self.W_S)\n        all_gather(g, self.reduced / self.world)\n"
        "        o = 0\n        for p in self.params:\n"
        "            p.grad = g[o:o + p.numel()].view_as(p).clone()\n            o += p.numel()\n"
        "        self.full.step()\n        for p in self.params:\n            p.grad = None\n")),
      "a full optimizer fed the gathered average"),
    M("09_zero", "zero2_grade", "free", "zero2",
      (("        p.grad = None\n", ""),), "p.grad kept after the copy"),
    M("09_zero", "zero2_grade", "async", "zero2",
      (("self.work = reduce_scatter(self.reduced, self.grad_flat, async_op=True)",
        "reduce_scatter(self.reduced, self.grad_flat)\n            self.work = None"),
       ("        self.work.wait()\n", "")), "a blocking reduce-scatter in the hook"),
    M("09_zero", "zero2_grade", "wait", "zero2",
      (("        self.work.wait()\n", ""),), "the work never waited"),
    M("09_zero", "zero2_grade", "reset", "zero2",
      (("        self.grad_flat = self.work = self.reduced = None\n", ""),),
      "per-backward state never reset"),
]


def test_every_rule_has_a_mutant():
    missing = [(nb, gid, rule) for nb, parts in RULES.items() for gid, rules in parts.items()
               for rule in rules
               if not any((m.notebook, m.grade_id, m.rule) == (nb, gid, rule) for m in MUTANTS)]
    assert not missing, f"rules no wrong solution tests: {missing}"
    unknown = [m.id for m in MUTANTS if m.rule not in RULES[m.notebook][m.grade_id]]
    assert not unknown, unknown


def test_every_exercise_prints_its_rules():
    for nb in RULES:
        cells = json.loads((ROOT / "solutions" / f"{nb}.ipynb").read_text())["cells"]
        assert any(f'rules.show("{nb}")' in "".join(c["source"]) for c in cells[:4]), \
            f"{nb}: the introduction does not print grading.rules.show({nb!r})"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.id)
def test_grader_rejects_mutant_naming_its_rule(m):
    ns = _solutions.load(f"{m.notebook}.ipynb", mutate(m))
    text, error = _solutions.grade(f"{m.notebook}.ipynb", m.grade_id, ns)
    assert error is not None, f"{m.id}: the grader accepted it:\n{text}"
    rule_text = RULES[m.notebook][m.grade_id][m.rule]
    assert f"✗ {rule_text}" in text, f"{m.id}: rule [{m.rule}] not named as failed:\n{text}"
