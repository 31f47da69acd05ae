"""infra: what a real run needs and a student may skip. The recipe files never import it; scalerl.py calls it.

  cli.py          options from `Config` and its comments, presets, the resume rules, cross-option checks, --help
  rundir.py       the run directory: lock, atomic writes, config.json, metrics.jsonl, checkpoints, export, preemption
  run.py          a run's life around the loop: start, engines, policy, evaluation, the generator rank, the end
  dist.py         torchrun: roles, transport with time-outs, FSDP2, weight buckets, the trainer link, generator ranks
  vllm_engine.py  the Engine interface on vLLM (every vLLM call of the project)
  sources.py      datasets (presets, files, the hub cache, reasoning-gym, DeepCoder tests), math-verify, models
  sandbox.py      the code sandbox that runs untrusted programs against tests

Errors end a run in one of two ways: `fail` (a user's mistake: one line, exit 2, before or between steps) and `die`
(a rank that cannot go on: one line, then exit at once, threads and all).
"""
import os
import sys

from pipeline_rl import first_line

__all__ = ["die", "fail", "first_line", "print0"]


def fail(msg):
    """A one-line error a user can act on, and a non-zero exit."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def die(msg):
    """Say what this rank waited for, then exit at once: a thread stuck on a dead peer must not keep it alive."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    os._exit(1)


def print0(*args, **kw):
    """Print on global rank 0 only (every rank of a torchrun job runs this script)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kw)
