"""Held-out evaluation under torchrun never stalls the pipeline: the generator ranks run the held-out groups within
--eval_share of their slots, interleaved with rollouts, while weights keep landing.

A tiny `torchrun --nproc_per_node=2` run (1 generator, 1 trainer) whose step-0 evaluation takes longer than its
--dist_timeout: it finishes, every evaluation row is logged, and training steps went on while the evaluation ran (the
trainer, waiting for rollouts, would give up after --dist_timeout were they held up). A checkpoint's wait on an
evaluation asked --eval_every steps before it outlasts --dist_timeout and the run goes on (waits end on a silent
rank, not on duration). A checkpoint is written before that wait: a generator killed in it loses the rows it owed,
named in one line, not the training. A slot-bound generator starts its held-out groups within a few engine steps.
Run: python -m pytest tests/test_torchrun_eval.py (a few minutes on 2 CPU cores).
"""
import re
import subprocess
import time

import pytest
import torch

from conftest import ROOT, TORCHRUN_ENV as ENV, kill, nodes, read_jsonl, torchrun_command as torchrun, wait_for_steps, \
    worker_pids


@pytest.mark.slow
def test_an_evaluation_longer_than_the_time_out_runs_beside_the_rollouts(tmp_path):
    timeout, out = 5, tmp_path / "run"
    p = subprocess.run(torchrun("--standalone", "--nproc_per_node=2", "scalerl.py", "--config", "smoke", "--threads=1",
                                f"--out_dir={out}", "--max_steps=120", "--eval_every=1000", "--eval_prompts=200",
                                "--eval_samples=16", f"--dist_timeout={timeout}"),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "pass_rate" in r]
    assert [r["step"] for r in evals] == [0, 120] and all(0 <= r["pass_rate"] <= 1 for r in evals)
    # the step-0 evaluation came back after training steps that together outlasted the time-out: rollouts flowed
    before = rows[:rows.index(evals[0])]
    assert before and all("pass_rate" not in r for r in before)
    assert sum(r["dt"] for r in before) > timeout, [r["dt"] for r in before]
    # weights landed while it ran: its tokens came from the asked version or later ones (a generator takes every
    # version published by its poll before it starts groups, so on a fast machine the first may already be 1)
    lo, hi = evals[0]["eval_versions"]
    assert 0 <= lo < hi, (lo, hi)


@pytest.mark.slow
def test_a_checkpoint_is_written_before_the_wait_on_evaluations(tmp_path):
    """Nothing trained is lost to a wait: two launches of one rank each (a trainer, a generator: a rank killed inside
    one launch would make torchrun end the other), evaluations and checkpoints every 3 steps. At step 6 the trainer
    writes its checkpoint, then waits for the step-3 evaluation (96 held-out prompts x 8); the generator is killed in
    that wait. The trainer ends within about --dist_timeout, naming in one line the rows it could not get, and the
    checkpoint holds step 6 (written after the wait, it stayed at step 3). --resume logs step 6's row again and names
    the row lost before it."""
    timeout, out = 10, tmp_path / "run"
    run = ("scalerl.py", "--config", "smoke", "--threads=1", f"--out_dir={out}", "--sft_steps=0", "--max_steps=6",
           "--eval_every=3", "--ckpt_every=3", "--eval_prompts=96", "--eval_samples=8", f"--dist_timeout={timeout}")
    procs = nodes(2, tmp_path / "node", *run)
    try:
        wait_for_steps(out / "metrics.jsonl", 6, procs)
        time.sleep(2)  # step 6's checkpoint is written, the wait has begun
        rows = read_jsonl(out / "metrics.jsonl", torn_ok=True)
        logged = {r["step"] for r in rows if "pass_rate" in r}
        assert all(p.poll() is None for p in procs) and 3 not in logged, rows  # still waiting for step 3's row
        ranks = worker_pids({p.pid for p in procs})
        elapsed = kill(ranks[1][0], procs)  # the generator
    finally:
        for p in procs:
            p.kill()
    log = (tmp_path / f"node{[p.pid for p in procs].index(ranks[0][1])}.log").read_text()
    assert all(p.returncode != 0 for p in procs) and elapsed < timeout + 30, elapsed  # the silence, room for a busy CPU
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 6, log[-3000:]
    logged = {r["step"] for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" in r}
    steps = lambda text: [sorted(map(int, re.findall(r"\d+", x))) for x in re.findall(  # noqa: E731
        r"held-out rows lost: steps \[([\d, ]*)\]", text)]
    line = [x for x in log.splitlines() if x.startswith("error: trainer rank 0 gave up waiting for the held-out")]
    assert logged == {0} and len(line) == 1 and steps(log) == [[3, 6]], log[-3000:]
    p = subprocess.run(torchrun("--standalone", "--nproc_per_node=2", *run, "--resume"), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert steps(p.stdout) == [[3]], p.stdout[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" in r] == [0, 6]


@pytest.mark.slow
def test_a_checkpoint_waits_for_an_evaluation_longer_than_the_time_out(tmp_path):
    """The wait before a checkpoint on an evaluation asked --eval_every steps before it gives up on silence, not on
    duration: its evaluation outlasts --dist_timeout while the generator is alive and busy, and the run finishes with
    every row (a flat time-out ended it at the first such wait)."""
    timeout, out = 8, tmp_path / "run"
    p = subprocess.Popen(torchrun("--standalone", "--nproc_per_node=2", "scalerl.py", "--config", "smoke",
                                  "--threads=1", f"--out_dir={out}", "--eval_prompts=400", "--eval_samples=16",
                                  f"--dist_timeout={timeout}"),  # 4 steps, evaluations and checkpoints every 2
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = {}  # the progress lines' first words (and whether they log a row) -> when they came
    for line in p.stdout:
        seen.setdefault((line[:10], "pass rate" in line), time.time())
    assert p.wait(timeout=600) == 0 and ("step    0 ", True) in seen, seen
    # the checkpoint at step 2 waited for the step-0 row longer than the time-out, before step 3
    assert seen[("step    0 ", True)] - seen[("step    2/", False)] > timeout, seen
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "pass_rate" in r] == [0, 2, 4]
    assert [(r["step"], "pass_rate" in r) for r in rows][:4] == [(1, False), (2, False), (0, True), (3, False)]


def test_held_out_groups_keep_their_share_of_the_slots_and_come_back_whole():
    """infra.dist.HeldOut on a real engine beside training groups: at most `cap` held-out completions run at once
    (every slot once training is over), two overlapping evaluations keep their groups apart, each comes back whole,
    and a rank with no held-out prompt answers at once."""
    import data
    import pipeline_rl
    import scalerl
    import trainer
    from infra import dist
    from infra.run import make_engine
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    cfg = scalerl.Config(slots=8, think_min=8, think_max=12, answer_budget=5, max_prompt=64)
    engine = make_engine(cfg, trainer.tiny_model(cfg, len(tok)), tok, 0)
    rollouts = pipeline_rl.Rollouts(engine, pipeline_rl.PromptPool(data.arith_problems(40), seed=0), tok, 64)
    templates = [rollouts.template(p, -1 - i) for i, p in enumerate(data.arith_problems(5, seed=1))]
    held = dist.HeldOut(rollouts, templates, 2, cap=4)
    held.ask(0), held.ask(1)
    train, complete, most = [], [], 0
    for g in range(3):
        engine.add(rollouts.next_template(g), 2)
    while len(complete) < 2:
        held.start(engine, everything=len(train) == 3)
        most = max(most, 2 * len(held.running)) if len(train) < 3 else most
        taken = held.take(engine.step())  # [(None, training groups)], then [(version, its groups)]
        train += [g for v, gs in taken if v is None for g in gs]
        complete += [(v, gs) for v, gs in taken if v is not None]
    assert most <= 4 and len(train) == 3 and all(g[0].group >= 0 for g in train)
    assert [v for v, _ in complete] == [0, 1] and all(len(gs) == 5 and all(len(g) == 2 for g in gs) for _, gs in complete)
    assert {g[0].group for _, gs in complete for g in gs} == set(range(-1, -11, -1))  # ten groups, none shared
    result = held.score(complete[0][1])
    assert len(result["results"]) == 10 and result["versions"] == (0, 0)
    nothing = dist.HeldOut(rollouts, [], 2, cap=4)
    nothing.ask(3)
    assert nothing.take([]) == [(3, [])] and nothing.score([]) == dict(results=[], versions=None)


def test_a_slot_bound_generator_still_starts_its_held_out_groups():
    """infra.dist.admit, the generator's per-turn starts, on a real engine that training groups alone would keep full
    (slot-bound: the lag bound admits 36 groups of 4 into 16 slots): the asked evaluation starts within a few engine
    steps and completes while training groups are still admitted beside it. Under the old rule (a training group
    whenever any room is free) a held-out group starts only when a group's room happens to free in one engine
    step."""
    import data
    import pipeline_rl
    import scalerl
    import torch
    import trainer
    from infra import dist
    from infra.run import make_engine
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    cfg = scalerl.Config(slots=16, think_min=4, think_max=40, answer_budget=5, max_prompt=64)
    engine = make_engine(cfg, trainer.tiny_model(cfg, len(tok)), tok, 0)
    rollouts = pipeline_rl.Rollouts(engine, pipeline_rl.PromptPool(data.arith_problems(200), seed=0), tok, 64)
    job = dist.Dist(rank=1, world=2, generators=[1], store=torch.distributed.HashStore())
    held = dist.HeldOut(rollouts, [rollouts.template(p, -1 - i) for i, p in enumerate(data.arith_problems(5, seed=1))],
                        4, cap=8)
    turn = dict(mode="pipeline", k=8, batch_prompts=4, group_size=4, dropped=0, stop=0)
    limit, next_group, steps, started, complete = (8 + 1) * 4, None, 0, None, []
    while not complete and steps < 2000:
        if steps == 10:
            held.ask(0)  # the slots are full of training groups by now
        next_group = dist.admit(job, rollouts, held, next_group, **turn)
        if held.running and not started:  # (engine step, groups admitted) when the evaluation started
            started = steps, job.store.add("admitted", 0)
        complete += [v for v, _ in held.take(engine.step()) if v is not None]
        steps += 1
    # measured: asked at engine step 10, started at 16 (6 groups admitted), complete at 108 (22 admitted); the old rule
    # started it at step 62, when 4 slots happened to free at once
    assert complete == [0] and started[0] < 10 + 20 and started[1] < limit, (steps, started)
    assert job.store.add("admitted", 0) > started[1]  # training admission went on beside the evaluation
