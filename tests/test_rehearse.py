"""runs/rehearse.py: the run's own scheduling code in virtual time at the plan's rates. It catches the faults a review
found in the 8b schedule when their old code is put back, passes with the fixes, and names what fails. Small step
counts and batches: each rehearsal takes a few seconds of CPU."""
import io
import os
import sys

from conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, "runs"))
import rehearse  # noqa: E402
from infra import dist  # noqa: E402
from infra.vllm_engine import VLLMEngine  # noqa: E402
from pipeline_rl import admission_limit  # noqa: E402

# 8b's model and rates on one node of 8 GPUs, at a small batch; slot-bound: (k+1) B G / 5 generators = 794 > 64 slots
SLOT_BOUND = ["--config", "8b", "--plan_gpus=8", "--batch_prompts=8", "--slots=64", "--max_lag=30", "--eval_prompts=8",
              "--eval_every=10", "--ckpt_every=10", "--steps=21", "--every=10", "--interrupted=0"]


def rehearse_(args):
    out = io.StringIO()
    return rehearse.main(args, out), out.getvalue()


def old_admit(job, rollouts, held_out, next_group, *, mode, k, batch_prompts, group_size, dropped, stop):
    """The admission before the fix: training groups take any room above 0, so a slot-bound generator's room never
    climbs back to a held-out group's."""
    engine = rollouts.engine
    held_out.start(engine, everything=stop > 0)
    while engine.room > 0 and not stop:
        if next_group is None:
            next_group = dist.counter(job, "admitted", 1) - 1
        if next_group >= admission_limit(mode, engine.version, k, batch_prompts, dropped):
            break
        engine.add(rollouts.next_template(next_group), group_size)
        next_group = None
    return next_group


def test_evaluation_starving_on_a_slot_bound_generator(monkeypatch):
    code, out = rehearse_(SLOT_BOUND)
    assert code == 0, out
    assert "step    20" in out and "eval lag" in out
    monkeypatch.setattr(dist, "admit", old_admit)
    code, out = rehearse_(SLOT_BOUND)
    assert code == 1, out
    failure = out.splitlines()[-1]
    assert failure.startswith("FAILED at step 10") and "evaluation of step 0 (policy version 0)" in failure, out


def test_resubmissions_at_the_back_of_the_queue(monkeypatch):
    """vLLM's queue holds what the KV cache cannot run (45 of 256 slots): an interrupted request resubmitted at its
    back waits behind every later one, and its group is dropped stale."""
    args = ["--config", "8b", "--plan_gpus=16", "--batch_prompts=16", "--eval_prompts=32", "--steps=30", "--every=10",
            "--interrupted=0.2"]
    code, out = rehearse_(args)
    assert code == 0, out
    submit = VLLMEngine._submit
    # a resubmission as a new request, the rule before the fix: its place is the back of the queue
    monkeypatch.setattr(VLLMEngine, "_submit", lambda self, run, computed=0, order=None: submit(self, run, computed))
    code, out = rehearse_(args)
    assert code == 1 and "dropped stale" in out and "over 5%" in out, out


def test_a_small_evaluation_share_fails_naming_the_evaluation():
    code, out = rehearse_(["--config", "8b", "--plan_gpus=80", "--eval_share=0.01", "--steps=5"])
    assert code == 1 and "FAILED" in out and "held-out evaluation" in out, out


def test_a_gpu_column_that_does_not_fit_fails_naming_it():
    # the PyTorch engine allocates its KV cache for every slot: 256 full-length 8B sequences are 620 GB
    code, out = rehearse_(["--config", "8b", "--plan_gpus=8", "--engine=torch", "--steps=3"])
    assert code == 1 and "memory" in out and "does not fit' for generators" in out, out
