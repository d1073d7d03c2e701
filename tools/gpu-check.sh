#!/usr/bin/env bash
# The GPU check: every CUDA path of minidist on a machine with one (or more) GPU, one line per
# check (PASS/FAIL/SKIP), under 6 minutes on one GPU. Exit status 1 if any check FAILed.
# Without a GPU it says so and exits 0, running nothing (the CPU paths are the test suite's job).
#
#   tools/gpu-check.sh                 # all checks
#   tools/gpu-check.sh ddp zero        # only the checks whose name contains one of the words
#   tools/gpu-check.sh --rehearse      # the same checks on the CPU with staging forced (no GPU)
#
# PYTHON selects the interpreter (default: the repository's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout 900 "$PY" -m minidist_course.lessons.gpu_check "$@"
