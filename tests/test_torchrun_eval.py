"""Held-out evaluation under torchrun never stalls the pipeline: the generator ranks run the held-out groups within
--eval_share of their slots, interleaved with rollouts, while weights keep landing.

A tiny `torchrun --nproc_per_node=2` run (1 generator, 1 trainer) whose step-0 evaluation takes longer than its
--dist_timeout: it finishes, every evaluation row is logged, and training steps went on while the evaluation ran (the
trainer, waiting for rollouts, would give up after --dist_timeout were they held up). Run: python -m pytest
tests/test_torchrun_eval.py (a minute or two on 2 CPU cores).
"""
import os
import subprocess

import pytest

from conftest import ENV, ROOT, read_jsonl, torchrun_command as torchrun

ENV = {**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, ENV.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_an_evaluation_longer_than_the_time_out_runs_beside_the_rollouts(tmp_path):
    timeout, out = 8, tmp_path / "run"
    p = subprocess.run(torchrun("--standalone", "--nproc_per_node=2", "scalerl.py", "--config", "smoke", "--threads=1",
                                f"--out_dir={out}", "--max_steps=80", "--eval_every=1000", "--eval_prompts=200",
                                "--eval_samples=4", f"--dist_timeout={timeout}"),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "pass_rate" in r]
    assert [r["step"] for r in evals] == [0, 80] and all(0 <= r["pass_rate"] <= 1 for r in evals)
    # the step-0 evaluation came back after training steps that together outlasted the time-out: rollouts flowed
    before = rows[:rows.index(evals[0])]
    assert before and all("pass_rate" not in r for r in before)
    assert sum(r["dt"] for r in before) > timeout, [r["dt"] for r in before]
    # weights landed while it ran: its tokens came from the asked version and later ones
    lo, hi = evals[0]["eval_versions"]
    assert lo == 0 and hi > 0
