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


@pytest.mark.slow
def test_a_two_process_run_goes_through_torchrun(tmp_path):
    """The off-policy comparison where generation and training overlap: a generator rank and a trainer rank."""
    p = ablations(tmp_path, "--only", "pipeline_2proc", *SMOKE)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "torch.distributed.run --standalone --nproc_per_node=2" in p.stdout
    log = open(tmp_path / "pipeline_2proc" / "stdout.log").read()
    assert "torchrun: 2 ranks | trainer ranks [0] | generator ranks [1]" in log, log[-2000:]
    assert os.path.exists(tmp_path / "pipeline_2proc" / "ckpt.pt") and os.path.exists(tmp_path / "results.md")


def test_unknown_run_is_refused(tmp_path):
    p = ablations(tmp_path, "--only", "scalerl,nonsense")
    assert p.returncode == 2 and "unknown run(s) nonsense" in p.stderr
