"""infra: what a real run needs and a student may skip (its files: the README's code map). The recipe files never
import it; scalerl.py calls it. What ends a run early says why in one line on stderr (`fail`, `die`)."""
import os
import sys


def first_line(e):
    """An exception's first line, at most 300 characters: what a one-line error quotes of it."""
    return (str(e).strip().splitlines() or [""])[0][:300]


def fail(msg):
    """A user's mistake, before or between steps: one line an operator can act on, and exit code 2; under torchrun
    the line names the rank that stopped (a generator rank may fail where the trainer ranks do not)."""
    rank = f"rank {os.environ.get('RANK', '?')}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    print(f"error: {rank}{msg}", file=sys.stderr)
    raise SystemExit(2)


def die(msg):
    """A rank that cannot go on: one line, then exit at once (a thread stuck on a dead peer must not keep it alive)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    os._exit(1)


def print0(*args, **kw):
    """Print on global rank 0 only (every rank of a torchrun job runs this script)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kw)
