"""What each exercise part checks: the rules its text teaches, one grader check per rule.

``RULES[notebook][grade_id]`` is ``{rule id: rule text}``; every check of that part's grader is
tagged with one rule id (:attr:`minidist_course.grading.Result.rule`) and named by the rule's text, so a
failed check says which rule was broken. ``show(notebook)`` prints the list in the exercise's
introduction, so the learner knows what is checked. The test suite holds, for every rule, a
plausible wrong solution that the grader must reject by naming that rule
(``tests/course/grading/test_exercise_rules.py``).
"""

from __future__ import annotations

from . import (bug_hunt, checkpoints, composition, context_parallel, cost, data_parallel as ddp, frameworks_map,
    gpu_placement, hierarchical, hybrid, launch_env, expert_parallel as moe, sampling, walls,
    sharding as zero, zero_bubble)
from .collectives import collective_rules

__all__ = ["RULES", "show", "tagger"]

RULES: dict[str, dict[str, dict[str, str]]] = {
    "00_memory_and_time": {"bytes_per_param_grade": walls.BYTES_RULES,
                           "training_memory_grade": walls.MEMORY_RULES,
                           "flops_and_days_grade": walls.FLOPS_RULES},
    "01_token_ring": {
        "shift_right_grade": {
            "receive": "shift_right returns what the left neighbour sent (and x is unchanged)",
            "once": "x goes once to the right neighbour: 4·n bytes through minidist.comm.p2p",
            "pairing": "the send and the receive are posted together (isend/irecv): no deadlock "
                       "whatever the message size"},
        "token_ring_grade": {
            "value": "each rank adds rank + 1 to the token it receives; rank 0 starts each lap",
            "messages": "one message per lap from every rank (W = 1: none)"},
        "ring_sum_grade": collective_rules()},
    "02_collectives_by_composition": {
        "all_gather_by_broadcast_grade": composition.composed_rules("all_gather"),
        "reduce_scatter_by_reduce_grade": composition.composed_rules("reduce_scatter"),
        "busbw_factor_grade": composition.BUSBW_RULES},
    "03_ring_allreduce": {"ring_reduce_scatter_grade": collective_rules("ring", pairing=True),
                          "ring_all_gather_grade": collective_rules("ring", pairing=True),
                          "ring_all_reduce_grade": collective_rules("ring", pairing=True)},
    "04_bucketed_ddp": {"build_buckets_grade": ddp.LAYOUT_RULES, "my_ddp_grade": ddp.DDP_RULES},
    "05_sampler_and_evaluation": {"sampler_grade": sampling.SAMPLER_RULES,
                                  "evaluate_exact_grade": sampling.EVAL_RULES},
    "06_tensor_parallel": {
        "f_and_g_grade": {
            "f_forward": "f is the identity in forward",
            "f_backward": "f all-reduces (sums) the gradient in backward",
            "g_forward": "g all-reduces (sums) its input in forward",
            "g_backward": "g is the identity in backward",
            "copy": "f and g leave the tensor they are given unchanged: the all-reduce works on a "
                    "clone (autograd may still need the original)"},
        "column_row_grade": {
            "column_shard": "ColumnParallelLinear keeps this rank's rows of the weight and the bias "
                            "(its shard of the output)",
            "column_f": "the column layer's input goes through f, so x.grad is summed over ranks",
            "row_shard": "RowParallelLinear keeps this rank's columns of the weight and the whole "
                         "bias",
            "row_g": "the row layer sums the partial outputs with g and adds the bias once, after"}},
    "07_one_f_one_b": {
        "one_f_one_b_grade": {
            "valid": "every micro-batch's F then B on every stage, each once (validate)",
            "deadlock": "no circular wait between stages (simulate)",
            "bubble": "the bubble (P-1)/(M+P-1)",
            "memory": "at most min(P-s, M) micro-batches in flight on stage s (1F1B's point)"},
        "run_on_engine_grade": {
            "local": "each rank keeps only its own stages (local_stages)",
            "engine": "the schedule runs on pipeline_step: gradients and loss equal one process"},
        "zb_h1_grade": zero_bubble.ZB_RULES},
    "08_launch_environment": {"who_am_i_grade": launch_env.WHO_RULES,
                              "diagnose_grade": launch_env.DIAGNOSIS_RULES},
    "08b_hierarchical_allreduce": {"node_groups_grade": hierarchical.GROUP_RULES,
                                   "hierarchical_all_reduce_grade": hierarchical.ALL_REDUCE_RULES},
    "09_zero": {"zero1_grade": zero.ZERO1_RULES, "zero2_grade": zero.ZERO2_RULES},
    "10_framework_map": {"framework_map_grade": frameworks_map.MAP_RULES,
                         "logged_loss_grade": frameworks_map.LOSS_RULES,
                         "clip_factor_grade": frameworks_map.CLIP_RULES},
    "11_gpu_placement": {"place_grade": gpu_placement.PLACE_RULES},
    "12_global_grad_norm": {"global_grad_norm_grade": hybrid.NORM_RULES},
    "13_cost": {"gpus_for_deadline_grade": cost.DEADLINE_RULES,
                "spot_wall_time_grade": cost.SPOT_RULES, "young_interval_grade": cost.YOUNG_RULES},
    "14_context_parallel": {"merge_grade": context_parallel.MERGE_RULES,
                            "zigzag_positions_grade": context_parallel.ZIGZAG_RULES,
                            "ring_grade": context_parallel.RING_RULES},
    "15_moe_dispatch": {"capacity_grade": moe.CAPACITY_RULES, "aux_loss_grade": moe.AUX_RULES,
                        "permutation_grade": moe.PERM_RULES},
    "16_checkpoint_generations": {"pick_grade": checkpoints.PICK_RULES,
                                  "retire_grade": checkpoints.RETIRE_RULES},
    "12b_bug_hunt": {"diagnosis_grade": bug_hunt.DIAGNOSIS_RULES,
                    "loss_weights_grade": bug_hunt.WEIGHT_RULES},
}


def show(notebook: str) -> None:
    """Print the rules each graded part of ``notebook`` (e.g. ``"09_zero"``) checks."""
    parts = RULES[notebook.removesuffix(".ipynb")]
    lines = ["What the graders check (each rule is one check; a broken rule is named in the report):"]
    for grade_id, rules in parts.items():
        lines.append(f"{grade_id}:")
        lines += [f"  [{key}] {text}" for key, text in rules.items()]
    print("\n".join(lines))


def tagger(notebook: str, grade_id: str):
    """For a grading cell written in the notebook: ``T = tagger(nb, gid)``, then
    ``T("rule", message)`` is ``"[rule] text: message"`` (``None`` when ``message`` is ``None``)."""
    rules = RULES[notebook.removesuffix(".ipynb")][grade_id]

    def tag(key: str, message):
        return None if message is None else f"[{key}] {rules[key]}: {message}"
    return tag
