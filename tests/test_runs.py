"""runs/ablations.py, as a user runs it: launches runs into their own directories, passes extra flags to every run,
skips finished ones, and writes its report even when the runs are too short to fit."""
import os
import sys

import pytest

from conftest import ROOT, run_command
SMOKE = ["--max_steps=2", "--eval_every=1", "--eval_prompts=8", "--eval_samples=2", "--n_train=200", "--sft_steps=20",
         "--batch_prompts=4", "--group_size=4", "--slots=16", "--ckpt_every=1"]


def ablations(out, *args):
    return run_command([sys.executable, os.path.join(ROOT, "runs", "ablations.py"), "--out", str(out), *args])


@pytest.mark.slow
def test_launch_skip_resume_and_report(tmp_path):
    p = ablations(tmp_path, "--only", "scalerl,dapo", "--jobs", "2", *SMOKE)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for name in ("scalerl", "dapo"):
        assert os.path.exists(tmp_path / name / "ckpt.pt") and os.path.exists(tmp_path / name / "stdout.log")
    assert '"loss": "dapo"' in open(tmp_path / "dapo" / "config.json").read()
    assert os.path.exists(tmp_path / "results.md")  # written even though 2 steps are too few to fit
    # a second launch skips both finished runs and leaves them untouched
    before = open(tmp_path / "scalerl" / "metrics.jsonl").read()
    p = ablations(tmp_path, "--only", "scalerl,dapo", *SMOKE)
    assert p.returncode == 0 and p.stdout.count("finished, skipped") == 2
    assert open(tmp_path / "scalerl" / "metrics.jsonl").read() == before


def test_unknown_run_is_refused(tmp_path):
    p = ablations(tmp_path, "--only", "scalerl,nonsense")
    assert p.returncode == 2 and "unknown run(s) nonsense" in p.stderr
