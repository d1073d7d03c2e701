"""Every rule an exercise part teaches has a plausible wrong solution that its grader rejects by
naming that rule. ``RULES`` (minidist_course/grading/rules.py) lists the rules; ``MUTANTS`` below are the
official solutions with one typical mistake each. A rule without a rejecting mutant fails
``test_every_rule_has_a_mutant``; a mutant the grader accepts, or rejects for another rule only,
fails ``test_grader_rejects_mutant_naming_its_rule``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

import _solutions
from minidist_course.grading.rules import RULES

ROOT = Path(__file__).resolve().parents[3]


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


# exercise 03's reduce-scatter with one mistake: Part A is graded on it, and Part C through it
_RS_BLOCKING = (("p2p.exchange(chunks[send_idx], right, incoming, left)",
                 "p2p.send(chunks[send_idx], right)\n        p2p.recv(incoming, left)"),)
_RS_ADDS_BEFORE_WAIT = (
    ("p2p.exchange(chunks[send_idx], right, incoming, left)\n        chunks[recv_idx] += incoming",
     "works = [p2p.irecv(incoming, left), p2p.isend(chunks[send_idx], right)]\n"
     "        chunks[recv_idx] += incoming\n        p2p.wait_all(works)"),)

# exercise 08b's three phases, replaced whole by the mutants that move the wrong bytes
_HAR_PHASES = ("    pieces = list(tensor.tensor_split(L))\n"
               "    ring.reduce_scatter_chunks(pieces, op, local, L, intra)\n"
               "    ring.all_reduce(pieces[local], op, node, M, inter)\n"
               "    ring.all_gather_chunks(pieces, local, L, intra)\n")

M = Mutant
MUTANTS = [
    # ------------------------------------------------------------------ 00
    M("00_memory_and_time", "bytes_per_param_grade", "fp32", "bytes_per_param",
      (('"optimizer": 4 + 4}', '"optimizer": 4}'),), "one Adam moment in fp32"),
    M("00_memory_and_time", "bytes_per_param_grade", "master", "bytes_per_param",
      (('"optimizer": 4 + 4 + 4}', '"optimizer": 4 + 4}'),), "master weights forgotten"),
    M("00_memory_and_time", "bytes_per_param_grade", "keys", "bytes_per_param",
      (('{"weights": 4, "grads": 4,', '{"weight": 4, "grads": 4,'),), "a key misspelt"),
    M("00_memory_and_time", "training_memory_grade", "total", "training_memory",
      (("params * sum(bytes_per_param(mixed_precision).values())",
        "params * (bytes_per_param(mixed_precision)['weights'] + "
        "bytes_per_param(mixed_precision)['optimizer'])"),), "gradients left out"),
    M("00_memory_and_time", "training_memory_grade", "master", "training_memory",
      (("params * sum(bytes_per_param(mixed_precision).values())",
        "params * (12 if mixed_precision else 16)"),), "12 bytes in mixed precision"),
    M("00_memory_and_time", "training_memory_grade", "bytes", "training_memory",
      (("params * sum(bytes_per_param(mixed_precision).values())",
        "params * sum(bytes_per_param(mixed_precision).values()) / 1e9"),), "GB"),
    M("00_memory_and_time", "flops_and_days_grade", "six", "flops_and_days",
      (("return 6 * params * tokens", "return 2 * params * tokens"),), "forward only"),
    M("00_memory_and_time", "flops_and_days_grade", "mfu", "flops_and_days",
      (("(n_gpus * peak_flops * mfu)", "(n_gpus * peak_flops)"),), "MFU forgotten"),
    M("00_memory_and_time", "flops_and_days_grade", "days", "flops_and_days",
      (("(n_gpus * peak_flops * mfu) / 86400", "(n_gpus * peak_flops * mfu)"),), "seconds"),
    # ------------------------------------------------------------------ 01 ring_sum
    M("01_token_ring", "ring_sum_grade", "equal", "ring_sum",
      (("for _ in range(world_size - 1):", "for _ in range(world_size - 2):"),), "one shift short"),
    M("01_token_ring", "ring_sum_grade", "sizes", "ring_sum",
      (("    passing = x.clone()\n", "    if x.numel() < world_size:\n        return x\n"
        "    passing = x.clone()\n"),), "skips tensors smaller than W"),
    # ------------------------------------------------------------------ 02
    M("02_collectives_by_composition", "all_gather_by_broadcast_grade", "equal",
      "all_gather_by_broadcast",
      (("dist.broadcast(chunks[root], src=root)",
        "dist.broadcast(chunks[(root + 1) % world_size], src=root)"),), "the wrong chunk"),
    M("02_collectives_by_composition", "all_gather_by_broadcast_grade", "sizes",
      "all_gather_by_broadcast",
      (("        dist.broadcast(chunks[root], src=root)",
        "        if chunks[root].numel() > 1:\n            dist.broadcast(chunks[root], src=root)"),),
      "skips one-element chunks"),
    M("02_collectives_by_composition", "all_gather_by_broadcast_grade", "compose",
      "all_gather_by_broadcast",
      (("for root in range(world_size):", "for root in list(range(world_size)) * 2:"),),
      "every broadcast twice"),
    M("02_collectives_by_composition", "reduce_scatter_by_reduce_grade", "equal",
      "reduce_scatter_by_reduce",
      (("dist.reduce(chunks[root], dst=root)",
        "dist.reduce(chunks[(root + 1) % world_size], dst=root)"),), "the wrong chunk"),
    M("02_collectives_by_composition", "reduce_scatter_by_reduce_grade", "sizes",
      "reduce_scatter_by_reduce",
      (("        dist.reduce(chunks[root], dst=root)",
        "        if chunks[root].numel() > 1:\n            dist.reduce(chunks[root], dst=root)"),),
      "skips one-element chunks"),
    M("02_collectives_by_composition", "reduce_scatter_by_reduce_grade", "compose",
      "reduce_scatter_by_reduce",
      (("dist.reduce(chunks[root], dst=root)", "dist.all_reduce(chunks[root])"),),
      "an all-reduce per chunk"),
    M("02_collectives_by_composition", "busbw_factor_grade", "all_reduce", "busbw_factor",
      (('{"all_reduce": 2 * (w - 1) / w', '{"all_reduce": (w - 1) / w'),), "all-reduce's 2 missing"),
    M("02_collectives_by_composition", "busbw_factor_grade", "one_phase", "busbw_factor",
      (('"all_gather": (w - 1) / w', '"all_gather": 1.0'),), "all-gather as 1"),
    M("02_collectives_by_composition", "busbw_factor_grade", "rooted", "busbw_factor",
      (('"broadcast": 1.0', '"broadcast": (w - 1) / w'),), "broadcast as (W-1)/W"),
    # ------------------------------------------------------------------ 03
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "equal", "ring_reduce_scatter",
      (("for step in range(world_size - 1):", "for step in range(world_size - 2):"),),
      "one step short"),
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "sizes", "ring_reduce_scatter",
      (("incoming = torch.empty_like(chunks[recv_idx])", "incoming = torch.empty_like(chunks[send_idx])"),),
      "buffer shaped like the sent chunk"),
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "p2p", "ring_reduce_scatter",
      (("    for step in range(world_size - 1):\n        send_idx",
        "    for c in chunks:\n        torch.distributed.all_reduce(c)\n    for step in range(0):\n        send_idx"),),
      "torch's all-reduce"),
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "ring", "ring_reduce_scatter",
      (("    for step in range(world_size - 1):\n        send_idx",
        "    full = torch.cat(chunks)\n    passing = full.clone()\n"
        "    for _ in range(world_size - 1):\n        incoming = torch.empty_like(passing)\n"
        "        p2p.exchange(passing, right, incoming, left)\n        passing = incoming\n"
        "        full += incoming\n"
        "    chunks[rank].copy_(full.tensor_split(world_size)[rank])\n"
        "    for step in range(0):\n        send_idx"),), "the whole tensor passed around"),
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "pairing", "ring_reduce_scatter",
      _RS_BLOCKING,
      "blocking send before receive (deadlock)"),
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "wait", "ring_reduce_scatter",
      _RS_ADDS_BEFORE_WAIT,
      "adds the buffer before its irecv is waited"),
    M("03_ring_allreduce", "ring_reduce_scatter_grade", "wait", "ring_reduce_scatter",
      (("p2p.exchange(chunks[send_idx], right, incoming, left)",
        "p2p.isend(chunks[send_idx], right)\n        p2p.irecv(incoming, left).wait()"),),
      "an isend never waited"),
    M("03_ring_allreduce", "ring_all_gather_grade", "pairing", "ring_all_gather",
      (("p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left)",
        "p2p.send(chunks[send_idx], right)\n        p2p.recv(chunks[recv_idx], left)"),),
      "blocking send before receive (deadlock)"),
    M("03_ring_allreduce", "ring_all_gather_grade", "wait", "ring_all_gather",
      (("p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left)",
        "p2p.isend(chunks[send_idx], right)\n        p2p.irecv(chunks[recv_idx], left).wait()"),),
      "an isend never waited"),
    M("03_ring_allreduce", "ring_all_reduce_grade", "pairing", "ring_reduce_scatter",
      _RS_BLOCKING,
      "its reduce-scatter sends before receiving (deadlock)"),
    M("03_ring_allreduce", "ring_all_reduce_grade", "wait", "ring_reduce_scatter",
      _RS_ADDS_BEFORE_WAIT,
      "its reduce-scatter adds before the irecv is waited"),
    M("03_ring_allreduce", "ring_all_gather_grade", "equal", "ring_all_gather",
      (("send_idx = (rank - step) % world_size", "send_idx = (rank - step - 1) % world_size"),),
      "sends the chunk it is about to receive"),
    M("03_ring_allreduce", "ring_all_gather_grade", "sizes", "ring_all_gather",
      (("        p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left)",
        "        works = []\n        if chunks[recv_idx].numel() > 1:\n"
        "            works.append(p2p.irecv(chunks[recv_idx], left))\n"
        "        if chunks[send_idx].numel() > 1:\n"
        "            works.append(p2p.isend(chunks[send_idx], right))\n        p2p.wait_all(works)"),),
      "one-element chunks never sent"),
    M("03_ring_allreduce", "ring_all_gather_grade", "p2p", "ring_all_gather",
      (("    for step in range(world_size - 1):\n        send_idx",
        "    for j in range(world_size):\n        torch.distributed.broadcast(chunks[j], src=j)\n"
        "    for step in range(0):\n        send_idx"),), "torch broadcasts"),
    M("03_ring_allreduce", "ring_all_gather_grade", "ring", "ring_all_gather",
      (("        p2p.exchange(chunks[send_idx], right, chunks[recv_idx], left)",
        "        works = [p2p.irecv(chunks[j], left) for j in range(world_size) if j != rank]\n"
        "        works += [p2p.isend(chunks[j], right) for j in range(world_size) if j != right]\n"
        "        p2p.wait_all(works)"),), "every chunk sent every step"),
    M("03_ring_allreduce", "ring_all_reduce_grade", "equal", "ring_all_reduce",
      (("    ring_all_gather(chunks, rank, world_size)\n", ""),), "no all-gather"),
    M("03_ring_allreduce", "ring_all_reduce_grade", "sizes", "ring_all_reduce",
      (("tensor.view(-1).tensor_split(world_size)", "tensor.view(-1).chunk(world_size)"),),
      "chunk() instead of tensor_split()"),
    M("03_ring_allreduce", "ring_all_reduce_grade", "p2p", "ring_all_reduce",
      (("    ring_reduce_scatter(chunks, rank, world_size)\n    ring_all_gather(chunks, rank, world_size)\n",
        "    torch.distributed.all_reduce(tensor)\n"),), "torch's all-reduce"),
    M("03_ring_allreduce", "ring_all_reduce_grade", "ring", "ring_all_reduce",
      (("    ring_reduce_scatter(chunks, rank, world_size)\n    ring_all_gather(chunks, rank, world_size)\n",
        "    passing = tensor.clone()\n    for _ in range(world_size - 1):\n"
        "        incoming = torch.empty_like(passing)\n"
        "        p2p.exchange(passing, (rank + 1) % world_size, incoming, (rank - 1) % world_size)\n"
        "        passing = incoming\n        tensor += incoming\n"),), "the whole tensor passed around"),
    # ------------------------------------------------------------------ 01
    M("01_token_ring", "shift_right_grade", "receive", "shift_right",
      (("p2p.wait_all([p2p.irecv(received, left), p2p.isend(x, right)])",
        "p2p.wait_all([p2p.irecv(received, right), p2p.isend(x, left)])"),), "sends left"),
    M("01_token_ring", "shift_right_grade", "once", "shift_right",
      (("p2p.wait_all([p2p.irecv(received, left), p2p.isend(x, right)])",
        "p2p.wait_all([p2p.irecv(received, left), p2p.isend(x, right)])\n"
        "    p2p.wait_all([p2p.irecv(received, left), p2p.isend(x, right)])"),), "sends twice"),
    M("01_token_ring", "shift_right_grade", "pairing", "shift_right",
      (("p2p.wait_all([p2p.irecv(received, left), p2p.isend(x, right)])",
        "p2p.send(x, right)\n    p2p.recv(received, left)"),), "blocking send first (deadlock)"),
    M("01_token_ring", "token_ring_grade", "value", "token_ring",
      (("            token += rank + 1", "            token += rank"),), "adds the rank"),
    M("01_token_ring", "token_ring_grade", "messages", "token_ring",
      (("            p2p.send(token, right)\n    ### END", "            p2p.send(token, right)\n"
        "    if world_size > 1 and rank == 0:\n        p2p.send(token, right)\n"
        "    if world_size > 1 and rank == 1:\n        p2p.recv(torch.zeros(1), left)\n    ### END"),),
      "an extra message"),
    # ------------------------------------------------------------------ 06
    M("06_tensor_parallel", "f_and_g_grade", "f_forward", "f_and_g",
      (('        return x.view_as(x)\n        ### END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return collectives.all_reduce(grad.clone(), "sum")',
        '        return collectives.all_reduce(x.clone(), "sum")\n        ### END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return collectives.all_reduce(grad.clone(), "sum")'),),
      "f all-reduces in forward"),
    M("06_tensor_parallel", "f_and_g_grade", "f_backward", "f_and_g",
      (('    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return collectives.all_reduce(grad.clone(), "sum")',
        '    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return grad'),), "f's backward forgot the all-reduce"),
    M("06_tensor_parallel", "f_and_g_grade", "g_forward", "f_and_g",
      (('        return collectives.all_reduce(x.clone(), "sum")', '        return x.view_as(x)'),),
      "g forgot the all-reduce"),
    M("06_tensor_parallel", "f_and_g_grade", "g_backward", "f_and_g",
      (('    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return grad\n',
        '    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return collectives.all_reduce(grad.clone(), "sum")\n'),),
      "g all-reduces in backward too"),
    M("06_tensor_parallel", "f_and_g_grade", "copy", "f_and_g",
      (('        return collectives.all_reduce(x.clone(), "sum")', '        return collectives.all_reduce(x, "sum")'),),
      "g all-reduces its input in place"),
    M("06_tensor_parallel", "f_and_g_grade", "copy", "f_and_g",
      (('    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return collectives.all_reduce(grad.clone(), "sum")',
        '    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return collectives.all_reduce(grad, "sum")'),),
      "f's backward all-reduces the gradient in place"),
    M("06_tensor_parallel", "column_row_grade", "column_shard", "column_row",
      (("self.weight = nn.Parameter(full.weight.data.chunk(world_size, 0)[rank].clone())",
        "self.weight = nn.Parameter(full.weight.data.chunk(world_size, 1)[rank].clone())"),),
      "the column weight split along the input features"),
    M("06_tensor_parallel", "column_row_grade", "column_shard", "column_row",
      (("self.bias = nn.Parameter(full.bias.data.chunk(world_size, 0)[rank].clone())",
        "self.bias = nn.Parameter(full.bias.data.chunk(world_size, 0)[world_size - 1 - rank].clone())"),),
      "another rank's bias shard"),
    M("06_tensor_parallel", "column_row_grade", "column_f", "column_row",
      (("return F.linear(copy_to_region(x), self.weight, self.bias)", "return F.linear(x, self.weight, self.bias)"),),
      "no f on the input"),
    M("06_tensor_parallel", "column_row_grade", "row_shard", "column_row",
      (("        self.bias = nn.Parameter(full.bias.data.clone())\n",
        "        self.bias = nn.Parameter(full.bias.data.clone() / world_size)\n"),
       ("return reduce_from_region(F.linear(x_shard, self.weight)) + self.bias",
        "return reduce_from_region(F.linear(x_shard, self.weight) + self.bias)")),
      "a 1/W bias on every rank, summed by g"),
    M("06_tensor_parallel", "column_row_grade", "row_g", "column_row",
      (("return reduce_from_region(F.linear(x_shard, self.weight)) + self.bias",
        "return reduce_from_region(F.linear(x_shard, self.weight, self.bias))"),), "bias added on every rank"),
    # ------------------------------------------------------------------ 07
    M("07_one_f_one_b", "one_f_one_b_grade", "valid", "one_f_one_b",
      (("        row += [Op(\"B\", m, r) for m in range(M - w, M)]", "        row += [Op(\"B\", m, r) for m in range(M - w, M - 1)]"),),
      "the last backward missing"),
    M("07_one_f_one_b", "one_f_one_b_grade", "deadlock", "one_f_one_b",
      (("w = min(P - 1 - r, M)", "w = min(r, M)"),), "warm-up growing with the stage"),
    M("07_one_f_one_b", "one_f_one_b_grade", "bubble", "one_f_one_b",
      (("w = min(P - 1 - r, M)", "w = max(min(P - 1 - r, M) - 1, 0)"),), "warm-up one too short"),
    M("07_one_f_one_b", "one_f_one_b_grade", "memory", "one_f_one_b",
      (("w = min(P - 1 - r, M)", "w = min(P - r, M)"),), "warm-up one too long"),
    M("07_one_f_one_b", "run_on_engine_grade", "local", "run_on_engine",
      (("    modules = local_stages(split_model(model, world_size), schedule, rank)\n    res = pipeline_step(schedule, modules, x, y, loss_fn)\n",
        "    loss = loss_fn(model(x), y)\n    loss.backward()\n    modules = {0: model}\n    return loss.item(), stage_grads(model, modules)\n"),),
      "the whole model on every rank"),
    M("07_one_f_one_b", "run_on_engine_grade", "engine", "run_on_engine",
      (("    res = pipeline_step(schedule, modules, x, y, loss_fn)",
        "    res = pipeline_step(schedule, modules, x, y, lambda a, b: nn.functional.mse_loss(a, b, reduction='sum'))"),),
      "summed loss"),
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
    # ------------------------------------------------------------------ 05
    M("05_sampler_and_evaluation", "sampler_grade", "pad", "sampler",
      (("        pad = self.total_size - len(order)\n        order += (order * math.ceil(pad / len(order)))[:pad]\n", ""),
       ("return iter(order[self.rank: self.total_size: self.num_replicas])",
        "return iter(order[self.rank:: self.num_replicas])"),
       ("        return self.num_samples\n", "        return len(range(self.rank, self.n, self.num_replicas))\n")),
      "no padding"),
    M("05_sampler_and_evaluation", "sampler_grade", "epoch", "sampler",
      (("manual_seed(self.seed + self.epoch)", "manual_seed(self.seed)"),), "epoch ignored"),
    M("05_sampler_and_evaluation", "sampler_grade", "order", "sampler",
      (("return iter(order[self.rank: self.total_size: self.num_replicas])",
        "return iter(order[self.rank * self.num_samples: (self.rank + 1) * self.num_samples])"),),
      "contiguous blocks"),
    M("05_sampler_and_evaluation", "sampler_grade", "equal", "sampler",
      (("order = torch.randperm(self.n, generator=g).tolist()",
        "order = torch.randperm(self.n, generator=g).flip(0).tolist()"),), "another permutation"),
    M("05_sampler_and_evaluation", "evaluate_exact_grade", "once", "evaluate_exact",
      (("    idx = list(range(rank, len(x), world_size))\n",
        "    per = -(-len(x) // world_size)\n"
        "    idx = [(rank + k * world_size) % len(x) for k in range(per)]\n"),),
      "a padded sampler's indices"),
    M("05_sampler_and_evaluation", "evaluate_exact_grade", "reduce", "evaluate_exact",
      (("    dist.all_reduce(totals)\n", ""),), "no all-reduce"),
    M("05_sampler_and_evaluation", "evaluate_exact_grade", "join", "evaluate_exact",
      (("    idx = list(range(rank, len(x), world_size))\n",
        "    idx = list(range(rank, len(x), world_size))\n    if not idx:\n        return 0, 0, 0.0\n"),),
      "an empty rank returns early"),
    M("05_sampler_and_evaluation", "evaluate_exact_grade", "loss", "evaluate_exact",
      (('reduction="sum")) if idx else 0.0', 'reduction="mean")) if idx else 0.0'),),
      "mean loss"),
    # ------------------------------------------------------------------ 08
    M("08_launch_environment", "who_am_i_grade", "ids", "who_am_i",
      (('rank=int(environ["SLURM_PROCID"])', 'rank=int(environ["SLURM_LOCALID"])'),),
      "SLURM_LOCALID as the rank"),
    M("08_launch_environment", "who_am_i_grade", "torchrun_first", "who_am_i",
      (('    if "RANK" in environ:', '    if "RANK" in environ and "SLURM_PROCID" not in environ:'),),
      "Slurm's variables first"),
    M("08_launch_environment", "who_am_i_grade", "local_world", "who_am_i",
      (('tasks_per_node(environ["SLURM_TASKS_PER_NODE"])[node]',
        'tasks_per_node(environ["SLURM_TASKS_PER_NODE"])[0]'),), "the first node's count"),
    M("08_launch_environment", "who_am_i_grade", "node_rank", "who_am_i",
      (("                node_rank=node,",
        '                node_rank=int(environ["SLURM_PROCID"]) // tasks_per_node(environ["SLURM_TASKS_PER_NODE"])[0],'),),
      "rank // tasks per node"),
    M("08_launch_environment", "who_am_i_grade", "master", "who_am_i",
      (('return prefix + rest.split(",")[0].split("-")[0].rstrip("]")',
        'return prefix + rest.split(",")[0].rstrip("]")'),), "a range kept as the host"),
    M("08_launch_environment", "diagnose_grade", "interface", "diagnose",
      (('"log_1": "C"', '"log_1": "A"'),), "log_1 blamed on MASTER_ADDR"),
    M("08_launch_environment", "diagnose_grade", "port", "diagnose",
      (('"log_2": "B"', '"log_2": "F"'),), "log_2 blamed on a timeout"),
    M("08_launch_environment", "diagnose_grade", "counts", "diagnose",
      (('"log_3": "D"', '"log_3": "F"'),), "log_3 blamed on a timeout"),
    # ------------------------------------------------------------------ 08b
    M("08b_hierarchical_allreduce", "node_groups_grade", "intra", "node_groups",
      (("list(range(m * L, (m + 1) * L))", "list(range(m, m + L))"),), "node m as ranks m … m+L-1"),
    M("08b_hierarchical_allreduce", "node_groups_grade", "inter", "node_groups",
      (("list(range(local, world_size, L))", "list(range(local * M, (local + 1) * M))"),),
      "a block of M ranks, not every L-th"),
    M("08b_hierarchical_allreduce", "node_groups_grade", "every_rank", "node_groups",
      (("        group = dist.new_group(list(range(m * L, (m + 1) * L)))\n        if rank // L == m:\n"
        "            intra = group",
        "        if rank // L == m:\n            intra = dist.new_group(list(range(m * L, (m + 1) * L)))"),
       ("        group = dist.new_group(list(range(local, world_size, L)))\n        if rank % L == local:\n"
        "            inter = group",
        "        if rank % L == local:\n            inter = dist.new_group(list(range(local, world_size, L)))")),
      "only its own groups"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "inter_bytes", "hierarchical_all_reduce",
      ((_HAR_PHASES, "    ring.all_reduce(tensor, op, rank, world_size)\n"),), "a flat ring over the world"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "inter_bytes", "hierarchical_all_reduce",
      ((_HAR_PHASES, "    ring.all_reduce(tensor, op, local, L, intra)\n"
                     "    ring.all_reduce(tensor, op, node, M, inter)\n"),), "the whole tensor in the node, then across"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "result", "hierarchical_all_reduce",
      (("    ring.all_gather_chunks(pieces, local, L, intra)\n", ""),), "no all-gather"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "uneven", "hierarchical_all_reduce",
      (("    pieces = list(tensor.tensor_split(L))\n",
        "    if tensor.numel() < world_size:\n        return tensor\n    pieces = list(tensor.tensor_split(L))\n"),),
      "skips tensors smaller than W"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "uneven", "hierarchical_all_reduce",
      (("tensor.tensor_split(L)", "tensor.chunk(L)"),), "chunk gives fewer pieces (a crash)"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "op", "hierarchical_all_reduce",
      (("tensor.div_(world_size)", "tensor.div_(ranks_per_node)"),), "averaged over the node only"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "op", "hierarchical_all_reduce",
      (("ring.reduce_scatter_chunks(pieces, op,", 'ring.reduce_scatter_chunks(pieces, "sum",'),
       ("ring.all_reduce(pieces[local], op,", 'ring.all_reduce(pieces[local], "sum",')),
      "always a sum"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "once", "hierarchical_all_reduce",
      (("    pieces = list(tensor.tensor_split(L))\n",
        "    intra, inter = node_groups(rank, world_size, ranks_per_node)\n"
        "    pieces = list(tensor.tensor_split(L))\n"),), "groups made in every call"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "in_place", "hierarchical_all_reduce",
      (("    pieces = list(tensor.tensor_split(L))\n",
        "    pieces = [p.clone() for p in tensor.tensor_split(L)]\n"),
       ('    if op == "avg":\n        tensor.div_(world_size)',
        '    tensor = torch.cat(pieces)\n    if op == "avg":\n        tensor.div_(world_size)')),
      "cloned pieces joined by torch.cat"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "in_place", "hierarchical_all_reduce",
      (("tensor.div_(world_size)", "tensor = tensor / world_size"),), "avg as tensor = tensor / W"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "inter_bytes", "hierarchical_all_reduce",
      ((_HAR_PHASES, "    dist.all_reduce(tensor, op={'max': dist.ReduceOp.MAX, 'min': dist.ReduceOp.MIN}"
                     ".get(op, dist.ReduceOp.SUM))\n"),), "torch's all_reduce"),
    M("08b_hierarchical_allreduce", "hierarchical_all_reduce_grade", "result", "hierarchical_all_reduce",
      (("    ring.all_reduce(pieces[local], op, node, M, inter)\n", ""),), "no phase across the nodes"),
    # ------------------------------------------------------------------ 10
    M("10_framework_map", "framework_map_grade", "dp", "framework_map",
      (('"hvd.DistributedOptimizer": "BucketedDDP"', '"hvd.DistributedOptimizer": "ShardedOptimizer(stage=1)"'),),
      "Horovod's optimizer as a sharded one"),
    M("10_framework_map", "framework_map_grade", "zero", "framework_map",
      (('"DeepSpeed zero_optimization.stage 3": "fully_shard"',
        '"DeepSpeed zero_optimization.stage 3": "ShardedOptimizer(stage=2)"'),), "stage 3 as stage 2"),
    M("10_framework_map", "framework_map_grade", "collective", "framework_map",
      (('"hvd.broadcast_parameters": "broadcast_module"', '"hvd.broadcast_parameters": "BucketedDDP"'),),
      "the broadcast as DDP"),
    M("10_framework_map", "framework_map_grade", "launch", "framework_map",
      (('"TF_CONFIG": "env.detect"', '"TF_CONFIG": "ProcessGrid"'),), "TF_CONFIG as a grid"),
    M("10_framework_map", "framework_map_grade", "grid", "framework_map",
      (('"Paddle hybrid topology (dp, mp, pp degrees)": "ProcessGrid"',
        '"Paddle hybrid topology (dp, mp, pp degrees)": "fully_shard"'),), "the topology as FSDP"),
    M("10_framework_map", "logged_loss_grade", "times_w", "logged_loss",
      (("    return global_loss * workers", "    return global_loss"),), "the true loss"),
    M("10_framework_map", "logged_loss_grade", "mean", "logged_loss",
      (("    return global_loss * workers", "    return worker_losses[0] * workers"),),
      "rank 0's loss times W"),
    M("10_framework_map", "clip_factor_grade", "shrink", "clip_factor",
      (("        return False, 1.0", "        return False, max_norm / grad_norm if grad_norm else 1.0"),),
      "small gradients scaled up"),
    M("10_framework_map", "clip_factor_grade", "factor", "clip_factor",
      (("    return True, max_norm / grad_norm", "    return True, 1.0 / grad_norm"),), "max_norm dropped"),
    M("10_framework_map", "clip_factor_grade", "changes", "clip_factor",
      (("    if grad_norm <= max_norm:\n        return False, 1.0", "    if grad_norm <= max_norm:\n        return True, 1.0"),),
      "always reports a change"),
    # ------------------------------------------------------------------ 11
    M("11_gpu_placement", "place_grade", "cpu", "place",
      (('        return "cpu", "gloo", None', '        return "cpu", "gloo", 1.0'),), "a share on the CPU"),
    M("11_gpu_placement", "place_grade", "device", "place",
      (('f"cuda:{local_rank % gpus}"', 'f"cuda:{local_rank}"'),), "cuda:local_rank on a shared GPU"),
    M("11_gpu_placement", "place_grade", "share", "place",
      (("(1 / per_gpu if per_gpu > 1 else None)", "(1 / local_world_size if per_gpu > 1 else None)"),),
      "the share over all ranks"),
    M("11_gpu_placement", "place_grade", "backend", "place",
      (('backend = "nccl" if per_gpu == 1 else "gloo"', 'backend = "nccl"'),), "auto is always nccl"),
    M("11_gpu_placement", "place_grade", "nccl_error", "place",
      (('    if backend == "nccl" and per_gpu > 1:\n', '    if False:\n'),), "nccl on a shared GPU accepted"),
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
    # ------------------------------------------------------------------ 12
    M("12_global_grad_norm", "global_grad_norm_grade", "replicated", "global_grad_norm",
      (("        if not getattr(p, \"tensor_model_parallel\", False) and grid.tp_rank != 0:\n"
        "            continue", "        pass"),), "replicated counted on every TP rank"),
    M("12_global_grad_norm", "global_grad_norm_grade", "tied", "global_grad_norm",
      (("if p.grad is None or model.is_tied_copy(p):", "if p.grad is None:"),),
      "the tied copy counted"),
    M("12_global_grad_norm", "global_grad_norm_grade", "dp", "global_grad_norm",
      (("    return float(total.sqrt())",
        "    dist.all_reduce(total, group=grid.dp_group)\n    return float(total.sqrt())"),),
      "summed over DP"),
    M("12_global_grad_norm", "global_grad_norm_grade", "tp", "global_grad_norm",
      (("    dist.all_reduce(total, group=grid.tp_group)", "    pass"),), "no TP sum"),
    M("12_global_grad_norm", "global_grad_norm_grade", "pp", "global_grad_norm",
      (("    dist.all_reduce(total, group=grid.pp_group)", "    pass"),), "no PP sum"),
    M("12_global_grad_norm", "global_grad_norm_grade", "square", "global_grad_norm",
      (("    return float(total.sqrt())", "    return float(total)"),), "no square root"),
    M("12_global_grad_norm", "global_grad_norm_grade", "sqrt_last", "global_grad_norm",
      (("    dist.all_reduce(total, group=grid.tp_group)",
        "    total = total.sqrt()\n    dist.all_reduce(total, group=grid.tp_group)"),
       ("    return float(total.sqrt())", "    return float(total)")), "root taken per rank"),
    M("12_global_grad_norm", "global_grad_norm_grade", "measure", "global_grad_norm",
      (("    return float(total.sqrt())",
        "    for p in model.parameters():\n        if p.grad is not None:\n"
        "            p.grad.mul_(min(1.0, 1.0 / float(total.sqrt())))\n"
        "    return float(total.sqrt())"),), "clips while measuring"),
    M("12_global_grad_norm", "global_grad_norm_grade", "equal", "global_grad_norm",
      (("total = torch.zeros(1, dtype=torch.float64)", "total = torch.zeros(1, dtype=torch.float16)"),
       ("total += p.grad.detach().double().pow(2).sum()", "total += p.grad.detach().half().pow(2).sum()")),
      "squares summed in fp16"),
    M("12_global_grad_norm", "global_grad_norm_grade", "collective", "global_grad_norm",
      (("    dist.all_reduce(total, group=grid.pp_group)",
        "    if grid.pp_rank == 0:\n        dist.all_reduce(total, group=grid.pp_group)"),),
      "PP sum only on stage 0 (deadlock)"),
    # ------------------------------------------------------------------ 13
    M("13_cost", "gpus_for_deadline_grade", "enough", "gpus_for_deadline",
      (("math.ceil(gpus / gpus_per_node * (1 - 1e-12))", "math.floor(gpus / gpus_per_node)"),),
      "rounded down"),
    M("13_cost", "gpus_for_deadline_grade", "nodes", "gpus_for_deadline",
      (("    return nodes * gpus_per_node", "    return math.ceil(gpus)"),), "GPUs not in whole nodes"),
    M("13_cost", "gpus_for_deadline_grade", "gpus", "gpus_for_deadline",
      (("    return nodes * gpus_per_node", "    return nodes"),), "returns nodes"),
    M("13_cost", "gpus_for_deadline_grade", "seconds", "gpus_for_deadline",
      (("flops / (deadline * peak_flops * mfu)", "flops / (deadline / 3600 * peak_flops * mfu)"),),
      "deadline converted to hours"),
    M("13_cost", "gpus_for_deadline_grade", "errors", "gpus_for_deadline",
      (("    if not 0 < mfu <= 1:\n        raise ValueError(f\"mfu must be in (0, 1], got {mfu!r}\")\n", ""),),
      "no MFU validation"),
    M("13_cost", "spot_wall_time_grade", "half", "spot_wall_time",
      (("/ (1 - rate * checkpoint_interval / 2)", "/ (1 - rate * checkpoint_interval)"),),
      "a whole interval lost"),
    M("13_cost", "spot_wall_time_grade", "checkpoints", "spot_wall_time",
      (("work_time * (1 + checkpoint_time / checkpoint_interval)", "work_time"),),
      "checkpoint writes forgotten"),
    M("13_cost", "spot_wall_time_grade", "restarts", "spot_wall_time",
      (("    return running * (1 + rate * restart_time)", "    return running"),),
      "restarts forgotten"),
    M("13_cost", "spot_wall_time_grade", "per_hour", "spot_wall_time",
      (("rate = interruptions_per_hour / 3600", "rate = interruptions_per_hour"),),
      "rate taken per second"),
    M("13_cost", "spot_wall_time_grade", "never", "spot_wall_time",
      (("        raise ValueError(\"the run never finishes: checkpoint more often\")", "        pass"),),
      "no error when it never finishes"),
    M("13_cost", "spot_wall_time_grade", "formula", "spot_wall_time",
      (("(1 + rate * restart_time)", "(1 + rate * restart_time / 2)"),), "half the restarts"),
    M("13_cost", "young_interval_grade", "young", "young_interval",
      (("math.sqrt(2 * checkpoint_time * mtbf)", "math.sqrt(checkpoint_time * mtbf)"),),
      "the 2 missing"),
    # ------------------------------------------------------------------ 07 Part C
    M("07_one_f_one_b", "zb_h1_grade", "valid", "zb_h1",
      (("                    row.append(waiting.pop(0))", "                    row.insert(len(row) - 1, waiting.pop(0))"),),
      "W inserted before the B"),
    M("07_one_f_one_b", "zb_h1_grade", "order", "zb_h1",
      (("for op in base.ops[r]:", "for op in sorted(base.ops[r], key=lambda o: o.kind == \"B\"):"),),
      "F and B regrouped (GPipe's order)"),
    M("07_one_f_one_b", "zb_h1_grade", "split", "zb_h1",
      (("ops.append(tuple(row + waiting))", "ops.append(tuple(row))"),), "the W still waiting dropped"),
    M("07_one_f_one_b", "zb_h1_grade", "memory", "zb_h1",
      (("if n_b > r:", "if n_b > r + 1:"),), "W lagging one backward too many"),
    M("07_one_f_one_b", "zb_h1_grade", "oldest", "zb_h1",
      (("row.append(waiting.pop(0))", "row.append(waiting.pop())"),), "the newest waiting W first"),
    M("07_one_f_one_b", "zb_h1_grade", "bubble", "zb_h1",
      (("if n_b > r:", "if n_b > 0:"),), "every W right after its B"),
    # ------------------------------------------------------------------ 14
    M("14_context_parallel", "merge_grade", "shape", "merge",
      (("wa = torch.exp(lse_a - lse_safe).unsqueeze(-1)", "wa = torch.exp(lse_a - lse_safe)"),
       ("wb = torch.exp(lse_b - lse_safe).unsqueeze(-1)", "wb = torch.exp(lse_b - lse_safe)")),
      "weights not broadcast over d"),
    M("14_context_parallel", "merge_grade", "lse", "merge",
      (("    lse = torch.where(empty, m, lse)\n", "    lse = m\n"),), "lse taken as the max"),
    M("14_context_parallel", "merge_grade", "weights", "merge",
      (("return wa * out_a + wb * out_b, lse", "return out_a + out_b, lse"),), "outputs added unweighted"),
    M("14_context_parallel", "merge_grade", "stable", "merge",
      (("lse = m_safe + torch.log1p(torch.exp(-(lse_a - lse_b).abs().nan_to_num(nan=math.inf)))",
        "lse = lse_a + torch.log(1 + torch.exp(lse_b - lse_a))"),), "log(1 + exp(b - a))"),
    M("14_context_parallel", "merge_grade", "empty", "merge",
      (("lse = m_safe + torch.log1p(", "lse = m + torch.log1p("),
       ("    lse = torch.where(empty, m, lse)\n    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)\n",
        "    lse_safe = lse\n")), "two empty blocks not special-cased"),
    M("14_context_parallel", "zigzag_positions_grade", "pairing", "zigzag_positions",
      (("chunks[2 * world - 1 - rank]", "chunks[world + rank]"),), "chunks r and W + r"),
    M("14_context_parallel", "zigzag_positions_grade", "uneven", "zigzag_positions",
      (("torch.arange(seq_len).tensor_split(2 * world)", "torch.arange(seq_len).split(seq_len // (2 * world))"),),
      "equal chunks of S // 2W"),
    M("14_context_parallel", "zigzag_positions_grade", "order", "zigzag_positions",
      (("torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])",
        "torch.cat([chunks[2 * world - 1 - rank], chunks[rank]])"),), "the late chunk first"),
    M("14_context_parallel", "ring_grade", "finite", "merge",
      (("lse = m_safe + torch.log1p(torch.exp(-(lse_a - lse_b).abs().nan_to_num(nan=math.inf)))",
        "lse = lse_a + torch.log(1 + torch.exp(lse_b - lse_a))"),), "an overflowing merge in the ring"),
    M("14_context_parallel", "ring_grade", "cover", "zigzag_positions",
      (("torch.arange(seq_len).tensor_split(2 * world)", "torch.arange(seq_len).split(max(1, seq_len // (2 * world)))"),),
      "chunks of S // 2W: the last positions on no rank"),
    M("14_context_parallel", "ring_grade", "equal", "merge",
      (("return wa * out_a + wb * out_b, lse", "return out_a + out_b, lse"),), "an unweighted merge in the ring"),
    # ------------------------------------------------------------------ 15
    M("15_moe_dispatch", "capacity_grade", "ceil", "capacity",
      (("return math.ceil(", "return math.floor("),), "rounded down"),
    M("15_moe_dispatch", "capacity_grade", "exact", "capacity",
      (("return math.ceil(Fraction(num_tokens * top_k) * f / num_experts)",
        "return math.ceil(num_tokens * top_k * capacity_factor / num_experts)"),), "the float ceil"),
    M("15_moe_dispatch", "capacity_grade", "top_k", "capacity",
      (("Fraction(num_tokens * top_k)", "Fraction(num_tokens)"),), "k forgotten"),
    M("15_moe_dispatch", "capacity_grade", "int", "capacity",
      (("return math.ceil(Fraction(num_tokens * top_k) * f / num_experts)",
        "return float(math.ceil(Fraction(num_tokens * top_k) * f / num_experts))"),), "a float"),
    M("15_moe_dispatch", "capacity_grade", "once", "capacity",
      (("return math.ceil(Fraction(num_tokens * top_k) * f / num_experts)",
        "return math.ceil(math.ceil(Fraction(num_tokens * top_k, num_experts)) * f)"),),
      "the factor after a first ceil"),
    M("15_moe_dispatch", "aux_loss_grade", "counts", "aux_loss",
      (("torch.bincount(experts.reshape(-1), minlength=E)", "torch.bincount(experts.reshape(-1))"),),
      "bincount without minlength"),
    M("15_moe_dispatch", "aux_loss_grade", "f", "aux_loss",
      (("/ experts.numel()", "/ T"),), "f over T, not T·k"),
    M("15_moe_dispatch", "aux_loss_grade", "P", "aux_loss",
      (("probs.mean(dim=0)", "probs.sum(dim=0)"),), "P summed, not averaged"),
    M("15_moe_dispatch", "aux_loss_grade", "E", "aux_loss",
      (("coeff * E * (", "coeff * ("),), "E missing"),
    M("15_moe_dispatch", "aux_loss_grade", "grad", "aux_loss",
      (("probs.mean(dim=0)", "probs.detach().mean(dim=0)"),), "P detached"),
    M("15_moe_dispatch", "aux_loss_grade", "value", "aux_loss",
      (("(f * probs.mean(dim=0)).sum()", "(f * probs.mean(dim=0)).sum().item()"),), "a Python float"),
    M("15_moe_dispatch", "permutation_grade", "dropped", "permutation",
      (("key = torch.where(kept, experts, torch.full_like(experts, num_experts)).reshape(-1)",
        "key = experts.reshape(-1)"),), "dropped rows sent"),
    M("15_moe_dispatch", "permutation_grade", "expert_major", "permutation",
      (("order = torch.sort(key, stable=True).indices", "order = torch.arange(key.numel())[key < num_experts]"),),
      "kept rows in token order"),
    M("15_moe_dispatch", "permutation_grade", "tokens", "permutation",
      (("key = torch.where(kept, experts, torch.full_like(experts, num_experts)).reshape(-1)",
        "key = torch.where(kept, experts, torch.full_like(experts, num_experts)).t().reshape(-1)"),),
      "choice-major rows: the wrong tokens"),
    M("14_context_parallel", "merge_grade", "empty", "merge",
      (("    m = torch.maximum(lse_a, lse_b)\n",
        "    if torch.isinf(lse_a).all():\n        return out_b, lse_b\n"
        "    if torch.isinf(lse_b).all():\n        return out_a, lse_a\n"
        "    m = torch.maximum(lse_a, lse_b)\n"),
       ("empty = torch.isinf(m) & (m < 0)", "empty = torch.zeros_like(m, dtype=torch.bool)")),
      "empty blocks tested as whole tensors"),
    M("15_moe_dispatch", "permutation_grade", "token_index", "permutation",
      (("return order // k,", "return order,"),), "flat row ids t·k + j"),
    M("15_moe_dispatch", "permutation_grade", "weights", "permutation",
      (("weights.reshape(-1)[order]", "weights[kept]"),), "weights in token order"),
    M("15_moe_dispatch", "permutation_grade", "sum", "permutation",
      ((".index_add(0, token_index, weighted)", ".index_copy(0, token_index, weighted)"),),
      "a token's rows assigned"),
    M("15_moe_dispatch", "permutation_grade", "weighted", "permutation",
      (("weighted = rows * row_weights.unsqueeze(-1)", "weighted = rows"),), "rows not weighted"),
    M("15_moe_dispatch", "permutation_grade", "positions", "permutation",
      ((".index_add(0, token_index, weighted)", ".index_add(0, torch.arange(len(token_index)) % num_tokens, weighted)"),),
      "rows back in row order"),
    M("15_moe_dispatch", "permutation_grade", "graph", "permutation",
      (("weights.reshape(-1)[order]", "weights.detach().reshape(-1)[order]"),), "weights detached"),

    # ------------------------------------------------------------------ 16
    M("16_checkpoint_generations", "pick_grade", "complete", "pick",
      (('complete = sorted(n for n, s in listing if s != "unfinished")',
        "complete = sorted(n for n, s in listing)"),), "an unfinished save counted"),
    M("16_checkpoint_generations", "pick_grade", "newest", "pick",
      (("        return complete[-1]",
        '        return [n for n, s in listing if s != "unfinished"][-1]'),), "the last listed"),
    M("16_checkpoint_generations", "pick_grade", "fallback", "pick",
      (("    if not fallback:\n", "    if False:\n"),), "always falls back"),
    M("16_checkpoint_generations", "pick_grade", "asked", "pick",
      (("if generation not in complete:", "if generation not in dict(listing):"),),
      "an unfinished generation given when asked"),
    M("16_checkpoint_generations", "pick_grade", "none", "pick",
      (('    if not complete:\n        raise FileNotFoundError("no complete generation")',
        "    if not complete:\n        return None"),), "None instead of an error"),
    M("16_checkpoint_generations", "retire_grade", "new", "retire",
      (("        if n == new:\n            continue\n", ""),), "the new one not skipped"),
    M("16_checkpoint_generations", "retire_grade", "good", "retire",
      (('        elif status[n] == "verified":', "        else:"),), "every generation counted"),
    M("16_checkpoint_generations", "retire_grade", "older", "retire",
      (("        if good >= keep:", '        if good >= keep and status[n] == "verified":'),),
      "old unfinished and corrupt ones kept"),
    M("16_checkpoint_generations", "retire_grade", "list", "retire",
      (("    return sorted(removed)", "    return removed"),), "newest first"),
    M("16_checkpoint_generations", "retire_grade", "sorted", "retire",
      (("    for n in sorted(status, reverse=True):", "    for n in reversed(list(status)):"),),
      "the listing taken as sorted"),

    # 12b: an answer whose symptoms differ from the mystery's, per rule; the zoo's own weights
    M("12b_bug_hunt", "diagnosis_grade", "scale", "diagnosis",
      (('1: "dp-sum-not-average"', '1: "dp-divide-twice"'),), "divided twice, not summed"),
    M("12b_bug_hunt", "diagnosis_grade", "tied", "diagnosis",
      (('2: "tied-embedding-not-summed"', '2: "sp-grads-not-summed"'),), "a bug with no symptom here"),
    M("12b_bug_hunt", "diagnosis_grade", "weights", "diagnosis",
      (('3: "microbatch-mean-of-means"', '3: "per-token-local-count"'),), "the per-token count"),
    M("12b_bug_hunt", "loss_weights_grade", "proportional", "loss_weights",
      (("return [n / batch_size for n in sizes]", "return [1 / M] * M"),), "every micro-batch 1/M"),
    M("12b_bug_hunt", "loss_weights_grade", "count", "loss_weights",
      (("tensor_split(M)", "chunk(M)"),), "chunk gives fewer pieces"),
    M("12b_bug_hunt", "loss_weights_grade", "order", "loss_weights",
      (("for n in sizes]", "for n in sizes[::-1]]"),), "the smaller micro-batches first"),
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


# These wait out a grader's timeout (20-60 s each, minutes together): the integration tier runs
# them (`pytest -m integration`); tests/course/grading/test_exercises.py keeps a deadlock case per launching
# exercise in the default tier.
_DEADLOCKS = ("pairing", "collective")


def _tier(mutants):
    """The default tier runs every mutant of the exercises that launch no ranks, and of those that
    do (2-5 s a grade, 170 mutants were 5 minutes) the first of each grading cell: every grader is
    shown rejecting a wrong solution by name; the integration tier runs every mutant."""
    first, out = set(), []
    for m in mutants:
        cell = (m.notebook, m.grade_id)
        if m.rule in _DEADLOCKS:
            out.append(pytest.param(m, marks=[pytest.mark.slow, pytest.mark.exhaustive]))
        elif m.notebook in _solutions.LAUNCHING and cell in first:
            out.append(pytest.param(m, marks=pytest.mark.exhaustive))
        else:
            first.add(cell)
            out.append(m)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("m", _tier(MUTANTS), ids=lambda m: m.id)
def test_grader_rejects_mutant_naming_its_rule(m):
    ns = _solutions.load(f"{m.notebook}.ipynb", mutate(m))
    text, error = _solutions.grade(f"{m.notebook}.ipynb", m.grade_id, ns)
    assert error is not None, f"{m.id}: the grader accepted it:\n{text}"
    rule_text = RULES[m.notebook][m.grade_id][m.rule]
    failed = [line for line in text.splitlines() if line.lstrip().startswith("✗")]
    assert any(f"[{m.rule}] {rule_text}" in line for line in failed), \
        f"{m.id}: rule [{m.rule}] not named by a failed check:\n{text}"
