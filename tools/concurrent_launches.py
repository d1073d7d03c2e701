"""Start many ``minidist.run`` jobs at the same moment, each from its own Python process, and count failures.

A classroom puts many learners on one server, each notebook launching ranks. This script is the
measurement behind that claim: each round starts ``--jobs`` separate interpreters that wait for
the same wall-clock instant, then each calls ``minidist.run(f, W)`` with W taken in turn from
``--worlds``; ``f`` returns at once (``--all-reduce``: after one all-reduce). A job fails when its process exits non-zero.

    python tools/concurrent_launches.py --jobs 3 --worlds 2 --rounds 8
    python tools/concurrent_launches.py --jobs 12 --worlds 2,3,4 --rounds 20
    python tools/concurrent_launches.py --jobs 3 --rounds 8 --no-retry   # first starts only

``--no-retry`` turns the launcher's start-up retry off in each job, so the count is the raw rate at
which a first start fails; without it the count is what a learner sees. Retries that happened are
counted either way (from the launcher's log). Prints one line per round and a summary; exits 1
when any job failed. Timings on a loaded machine say nothing about speed: only failures count.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

_JOB = textwrap.dedent("""
    import logging, sys, time
    import torch, torch.distributed as dist
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(message)s")
    import minidist
    if {no_retry}:
        try:
            from minidist.launch import errors
            errors.START_ATTEMPTS = 1
        except ImportError:  # before the launcher became a package
            from minidist import launch_errors
            launch_errors.START_ATTEMPTS = 1
    def f(rank, world):
        t = torch.tensor([rank + 1.0])
        if {all_reduce}:
            dist.all_reduce(t)
        return t.item()
    while time.time() < {start}:
        time.sleep(0.001)
    world = {world}
    print("LOG entering minidist.run", file=sys.stderr, flush=True)
    res = minidist.run(f, world, timeout={timeout})
    expected = [world * (world + 1) / 2] * world if {all_reduce} else [r + 1.0 for r in range(world)]
    assert res == expected, res
""")


def one_round(jobs: int, worlds: list[int], no_retry: bool, timeout: float,
              all_reduce: bool = False, python: str = sys.executable) -> list[dict]:
    """Start ``jobs`` processes that all call ``minidist.run`` at the same instant; one dict per job.

    Each dict: ``world``, ``ok`` (exit status 0), ``started`` (the job reached ``minidist.run``;
    on a crowded machine importing torch alone can take minutes), ``retries`` (start-up retries
    logged) and ``error`` (the first error line of the job's stderr when it failed).
    """
    start = time.time() + 3.0 + 0.25 * jobs  # every interpreter has imported torch by then
    procs = []
    for j in range(jobs):
        world = worlds[j % len(worlds)]
        code = _JOB.format(no_retry=no_retry, start=start, world=world, timeout=timeout,
                           all_reduce=all_reduce)
        procs.append((world, subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)))
    results = []
    for world, p in procs:
        try:
            _, err = p.communicate(timeout=timeout + 600)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n(job did not finish: killed by tools/concurrent_launches.py)"
        lines = [ln for ln in err.splitlines() if ln.strip()]
        errors = [ln for ln in lines if not ln.startswith("LOG ")]
        first = next((ln for ln in errors if "failed" in ln or "Error" in ln), errors[-1] if errors else "")
        results.append(dict(world=world, ok=p.returncode == 0,
                            started=any("entering minidist.run" in ln for ln in lines),
                            retries=sum("starting again" in ln for ln in lines),
                            error="" if p.returncode == 0 else first[:300]))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3, help="concurrent jobs per round (default 3)")
    parser.add_argument("--worlds", default="2", help="world sizes, cycled over jobs (default 2)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (default 8)")
    parser.add_argument("--timeout", type=float, default=120.0, help="minidist.run timeout per job")
    parser.add_argument("--no-retry", action="store_true", help="turn the start-up retry off")
    parser.add_argument("--all-reduce", action="store_true",
                        help="f does one all-reduce (default: f returns at once, as in the report)")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    failed_jobs = failed_rounds = retries = unstarted = 0
    t0 = time.monotonic()
    for r in range(args.rounds):
        res = one_round(args.jobs, worlds, args.no_retry, args.timeout, args.all_reduce)
        bad = [x for x in res if not x["ok"] and x["started"]]
        not_started = [x for x in res if not x["started"]]
        failed_jobs += len(bad)
        unstarted += len(not_started)
        failed_rounds += bool(bad)
        retries += sum(x["retries"] for x in res)
        print(f"round {r + 1}/{args.rounds}: {sum(x['ok'] for x in res)}/{len(res)} ok, "
              f"{len(not_started)} never reached minidist.run, "
              f"{sum(x['retries'] for x in res)} start-up retries", flush=True)
        for x in bad:
            print(f"    W={x['world']}: {x['error']}", flush=True)
    print(f"summary: jobs={args.jobs} worlds={args.worlds} rounds={args.rounds} "
          f"retry={'off' if args.no_retry else 'on'} all_reduce={args.all_reduce}: {failed_rounds} rounds with a failure, "
          f"{failed_jobs} failed jobs of {args.jobs * args.rounds}, {unstarted} never reached "
          f"minidist.run, {retries} start-up retries, "
          f"{time.monotonic() - t0:.0f} s (cpu count {os.cpu_count()})", flush=True)
    return 1 if failed_jobs else 0


if __name__ == "__main__":
    sys.exit(main())
