"""Shared test setup: run fully offline, import the flat modules from the project root, small threads; and the
helpers several test files use (import them with `from conftest import ROOT, read_jsonl, ...`: pytest puts tests/
on sys.path).

Run the whole suite with `python -m pytest` from the project root.
"""
import hashlib
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.set_num_threads(1)  # the test models are tiny: one thread is deterministic and fair to a shared machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the environment of every subprocess the tests start: offline, whatever the caller's shell says
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


TIMING = {"dt", "device_hours", "cpu_hours", "gen_tok_s", "train_tok_s", "gen_busy", "train_busy",
          "sync_s"}  # wall-clock fields of a metrics row: the rest of a run repeats exactly


def scalerl_command(*args):
    """The real command line: `python scalerl.py ARGS`."""
    return [sys.executable, os.path.join(ROOT, "scalerl.py"), *args]


def torchrun_command(*args):
    """`torchrun ARGS` through this interpreter (no reliance on a torchrun script on PATH)."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_command(cmd, timeout=600, env=None):
    """Run `cmd` from the project root with ENV (plus `env`), its text output captured; the CompletedProcess."""
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def one_line_error(p):
    """A failed run's stderr is exactly one `error: ...` line (no traceback); returns that line."""
    assert p.returncode != 0, p.stdout[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    return lines[0]


def read_jsonl(path, torn_ok=False):
    """The rows of a JSONL file. torn_ok: leave out a last line without its newline (a run still writing, or killed
    mid-write); otherwise such a line fails to parse, as a finished log must not hold one."""
    with open(path) as f:
        return [json.loads(line) for line in f if not torn_ok or line.endswith("\n")]


def tree_hashes(d):
    """{relative path: sha256} of every file under directory `d`: compare before and after to prove it untouched."""
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, d)] = hashlib.sha256(f.read()).hexdigest()
    return out
