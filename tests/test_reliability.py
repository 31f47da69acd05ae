"""Reliability: faults inside a run, bad invocations against an existing run, and real kills with --resume.

1. Non-finite loss or gradients (injected by wrapping `trainer.policy_gradient`): the optimizer step is skipped and
   logged; after --max_nonfinite in a row the run exits with one line and a checkpoint of the last good weights.
2. A reward verifier that raises (a monkeypatched `data.reward`) costs only that completion: reward -1, counted in
   `reward_errors`, one warning line naming the prompt; the run finishes.
3. A table of bad invocations (scalerl.main in-process) against a run directory the real command wrote: each exits
   with code 2 and one `error:` line and leaves every file of that directory byte-for-byte unchanged.
4. Real kills: SIGKILL the real command at seeded random points, --resume until it finishes; the log holds every
   step exactly once, and the rows written before the first kill agree with an uninterrupted run.

Runs 1-2 call scalerl.main in-process on the smoke preset; all runs share one base directory, so the supervised
warm start is computed once. Run: python -m pytest tests/test_reliability.py (about a minute on two CPU cores).
"""
import os
import random
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

import data
import pipeline_rl
import scalerl
import trainer
from infra import sources
from conftest import (ENV, ROOT, TIMING, copy_run, one_line_error, read_jsonl, refused, run_base, run_command,
                      scalerl_command, torchrun_command, tree_hashes)


def command(out, *args):
    return scalerl_command("--config", "smoke", "--threads=1", f"--out_dir={out}", *args)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return run_base(tmp_path_factory, "reliability")  # the session's warm-start cache


def main_smoke(out, *args):
    scalerl.main(scalerl.parse_args(["--config", "smoke", "--threads=1", f"--out_dir={out}", *args]))

# ---------------------------------------------------------------------------------------------------------------------
# 1. Non-finite loss or gradients


def alternate_rewards(monkeypatch):
    """Every group's rewards alternate +1/-1 (the smoke model rarely passes): every step has a learning signal."""
    def alternate(self, groups):
        for g in groups:
            for i, s in enumerate(g):
                s.reward = 1.0 if i % 2 else -1.0
    monkeypatch.setattr(pipeline_rl.Rollouts, "score", alternate)


def poison(monkeypatch, steps, what):
    """Wrap policy_gradient so that the call for each optimizer step in `steps` returns a NaN loss ("loss") or leaves
    an inf in one gradient ("grad"). Returns the list of model weights seen at the start of each call. With
    alternating rewards every step calls it."""
    real, seen = trainer.policy_gradient, []
    alternate_rewards(monkeypatch)

    def wrapped(policy, samples, *a, **kw):
        seen.append({k: v.detach().clone() for k, v in policy.lm.state_dict().items()})
        loss, sums, ratio_max = real(policy, samples, *a, **kw)
        if len(seen) in steps:
            if what == "loss":
                loss = float("nan")
            else:
                next(p for p in policy.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        return loss, sums, ratio_max
    monkeypatch.setattr(trainer, "policy_gradient", wrapped)  # trainer.train_step looks it up there
    return seen


def test_nonfinite_loss_step_is_skipped(base, monkeypatch, capsys):
    out = base / "nan_once"
    seen = poison(monkeypatch, {2}, "loss")  # every step calls policy_gradient
    main_smoke(out, "--zero_var_filter=false")
    assert len(seen) == 4
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" not in r]
    assert [r["skipped_nonfinite"] for r in train] == [0, 1, 0, 0]
    assert "step skipped (1 in a row)" in capsys.readouterr().out
    # the skipped step left the weights as they were: what step 3 started from is what step 2 started from
    assert all(torch.equal(seen[1][k], seen[2][k]) for k in seen[1])
    assert not all(torch.equal(seen[0][k], seen[1][k]) for k in seen[0])  # while a normal step changes them
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert {float(s["step"]) for s in ck["opt"]["state"].values()} == {3.0}  # Adam took 3 of the 4 steps


def test_nonfinite_in_a_row_stops_with_last_good_checkpoint(base, monkeypatch, capsys):
    out = base / "nan_stop"
    seen = poison(monkeypatch, {2, 3, 4, 5}, "grad")
    with pytest.raises(SystemExit) as e:
        main_smoke(out, "--zero_var_filter=false", "--max_steps=6", "--max_nonfinite=2")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 2 steps in a row had non-finite") and "--resume" in err[0]
    assert len(seen) == 3  # steps 1 (good), 2 and 3 (skipped), then the stop
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" not in r]
    assert [(r["step"], r["skipped_nonfinite"]) for r in train] == [(1, 0), (2, 1), (3, 1)]
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 3
    assert all(torch.equal(ck["model"][k], seen[1][k]) for k in seen[1])  # the weights after step 1, the last good
    assert all(torch.isfinite(v).all() for v in ck["model"].values())
    # and the run continues from there once the fault is gone
    monkeypatch.undo()
    main_smoke(out, "--zero_var_filter=false", "--max_steps=4", "--resume")
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" not in r]
    assert [(r["step"], r["skipped_nonfinite"]) for r in train] == [(1, 0), (2, 1), (3, 1), (4, 0)]


def test_bf16_mixed_precision_run_resumes_its_fp32_masters_and_adam(base, monkeypatch):
    """--dtype=bfloat16 in one process: FSDP2 mixed precision over a group of one; ckpt.pt holds fp32 masters and the
    full AdamW state, and a resumed run continues Adam's step count."""
    out = base / "bf16"
    alternate_rewards(monkeypatch)
    main_smoke(out, "--dtype=bfloat16", "--max_steps=2")
    main_smoke(out, "--resume", "--max_steps=4")
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert {v.dtype for v in ck["model"].values()} == {torch.float32}
    assert {float(s["step"]) for s in ck["opt"]["state"].values()} == {4.0}  # 2 steps, then 2 more after the resume
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" not in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["train_tokens"] > 0 for r in train)

# ---------------------------------------------------------------------------------------------------------------------
# 2. A failing reward


def test_reward_errors_are_counted_not_fatal(base, monkeypatch, capsys):
    out = base / "bad_reward"
    real_reward, real_record, raised, recorded = data.reward, pipeline_rl.PromptPool.record, [], []

    def flaky(problem, completion, **kw):
        if problem.id % 3 == 0:
            raised.append(problem.id)
            raise ZeroDivisionError("verifier bug")
        return real_reward(problem, completion, **kw)

    def record(pool, prompt_id, rewards):
        recorded.append((prompt_id, list(rewards)))
        return real_record(pool, prompt_id, rewards)
    monkeypatch.setattr(data, "reward", flaky)
    monkeypatch.setattr(pipeline_rl.PromptPool, "record", record)
    main_smoke(out)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "pass_rate" not in r] == [1, 2, 3, 4]  # the run finished
    assert raised, "no item hit the fault: pick another id rule"
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: reward failed")]
    assert len(warnings) == len(raised)  # each failure logged once, naming its prompt
    assert sorted(int(re.search(r"on prompt (\d+)", w).group(1)) for w in warnings) == sorted(raised)
    assert all("ZeroDivisionError: verifier bug" in w and "counted as -1" in w for w in warnings)
    assert all(rw == [-1.0] * len(rw) for pid, rw in recorded if pid % 3 == 0)  # failures scored -1
    assert any(pid % 3 for pid, _ in recorded)
    counts = [r["reward_errors"] for r in rows if "pass_rate" not in r]
    assert counts == sorted(counts) and counts[-1] > 0  # cumulative
    assert torch.load(out / "ckpt.pt", weights_only=True)["generating"]["reward_errors"] == len(raised)  # evals too


def test_prompts_that_cannot_be_built_are_skipped_and_counted(base, monkeypatch, capsys):
    """A data item whose prompt cannot be built (format_prompt raises on it) or is longer than --max_prompt is
    skipped with one warning naming it, counted in bad_prompts, kept in the checkpoint, and the run finishes."""
    real, raised = data.format_prompt, set()

    def broken(question, tokenizer=None):
        if sum(map(ord, question)) % 4 == 0:
            raised.add(question)
            raise UnicodeError("cannot encode this item")
        return real(question, tokenizer)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    train, val = sources.load_problems("arith", n_val=8, n_train=200)
    lengths = sorted(len(data.encode(tok, real(p.question, tok))) for p in train + val)
    limit = lengths[len(lengths) * 3 // 4]  # a quarter of the items are too long
    # the warm start (its built-in traces) cached first, as in any later run: the patch is for RL's prompts
    cfg = scalerl.parse_args(["--config", "smoke"])
    trainer.warm_start(cfg, *sources.load_model(cfg, ["arith"]), str(base))
    monkeypatch.setattr(data, "format_prompt", broken)
    out = base / "bad_prompts"
    main_smoke(out, f"--max_prompt={limit}")
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and raised
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: skipped prompt")]
    assert len(warnings) == len(set(warnings)) == rows[-1]["bad_prompts"]  # each item once, every one counted
    assert any("UnicodeError: cannot encode this item" in w for w in warnings)
    assert any(f"over --max_prompt={limit}" in w for w in warnings)
    assert len(torch.load(out / "ckpt.pt", weights_only=True)["generating"]["bad_prompts"]) == rows[-1]["bad_prompts"]

# ---------------------------------------------------------------------------------------------------------------------
# 3. Bad invocations against an existing run directory

BAD_RUNS = [  # (name, run dir to use, extra argv, text the error line must contain)
    ("unknown preset", "run", ["--config=nope"], "--config: invalid choice: 'nope'"),
    ("unknown key", "run", ["--max_step=5"], "did you mean --max_steps"),
    ("wrong type", "run", ["--max_steps=abc"], "--max_steps: invalid int value"),
    ("float for int", "run", ["--batch_prompts=2.5"], "--batch_prompts"),
    ("zero batch", "run", ["--batch_prompts=0"], "must be positive"),
    ("zero group", "run", ["--group_size=0"], "--group_size"),
    ("zero slots", "run", ["--slots=0"], "--slots"),
    ("negative k", "run", ["--max_lag=-1"], "--max_lag"),
    ("ppo with k=0", "run", ["--off_policy=ppo", "--max_lag=0"], "--max_lag=0 is invalid for --off_policy=ppo"),
    ("think range", "run", ["--think_min=50", "--think_max=40"], "--think_max"),
    ("heads", "run", ["--n_embd=130", "--n_head=4"], "divisible"),
    ("nan lr", "run", ["--lr=nan"], "--lr"),
    ("zero max_nonfinite", "run", ["--max_nonfinite=0"], "--max_nonfinite"),
    ("stray word", "run", ["resume"], "unexpected argument"),
    ("existing dir without --resume", "run", [], "pass --resume"),
    ("another dataset", "run", ["--resume", "--task=/nonexistent/prompts.jsonl"], "--task=/nonexistent/prompts.jsonl "
     "does not fit this run"),
    ("another model", "run", ["--resume", "--model=no-such-org/no-such-model"], "does not fit this run"),
    ("model shape differs", "run", ["--resume", "--n_embd=64", "--sft_steps=0"], "does not fit this run"),
    ("no checkpoint", "no_ckpt", ["--resume"], "no checkpoint"),
    ("corrupt checkpoint", "garbage", ["--resume"], "unreadable"),
    ("truncated checkpoint", "truncated", ["--resume"], "unreadable"),
    ("foreign checkpoint", "foreign", ["--resume"], "not a scalerl checkpoint"),
    ("checkpoint needing unsafe unpickling", "unsafe", ["--resume"], "unreadable"),
    ("missing dataset, fresh dir", "fresh", ["--task=/nonexistent/prompts.jsonl"], "does not exist"),
    ("hub name offline, fresh dir", "fresh", ["--model=no-such-org/no-such-model"], "cannot load --model"),
]


class Unsafe:  # an arbitrary class: torch.load(weights_only=True) must refuse to build it
    pass


@pytest.fixture(scope="module")
def bad_runs(base, finished_run):
    """An existing 2-step run (the real command's) and damaged copies of it, with every file's hash."""
    run = copy_run(finished_run, base / "existing")
    dirs = {"run": run}
    for name in ("no_ckpt", "garbage", "truncated", "foreign", "unsafe"):
        dirs[name] = base / f"existing_{name}"
        shutil.copytree(run, dirs[name])
    ck = dirs["no_ckpt"] / "ckpt.pt"
    os.remove(ck)
    (dirs["garbage"] / "ckpt.pt").write_bytes(random.Random(0).randbytes(4096))
    blob = (run / "ckpt.pt").read_bytes()
    (dirs["truncated"] / "ckpt.pt").write_bytes(blob[:len(blob) // 2])
    torch.save({"model": torch.zeros(3), "step": 5}, dirs["foreign"] / "ckpt.pt")
    torch.save({"model": Unsafe()}, dirs["unsafe"] / "ckpt.pt")
    return dirs, {k: tree_hashes(v) for k, v in dirs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_RUNS, ids=[c[0] for c in BAD_RUNS])
def test_bad_invocation_one_line_dir_untouched(bad_runs, case, capsys):
    """Each bad invocation in this process (scalerl.main), the run directories made by the real command."""
    dirs, before = bad_runs
    name, where, argv, needle = case
    out = dirs["run"].parent / f"fresh_{BAD_RUNS.index(case)}" if where == "fresh" else dirs[where]
    line = refused(capsys, "--config", "smoke", "--threads=1", f"--out_dir={out}", *argv)
    assert needle in line, line
    if where == "fresh":
        assert not os.path.exists(out)  # nothing created
    else:
        assert tree_hashes(dirs[where]) == before[where]


# ---------------------------------------------------------------------------------------------------------------------
# 4. Real kills and --resume


def kill_when_under_way(proc, out, resume, delay, kill, wait=180, new_steps=0):
    """Once the run has a checkpoint and has started its log (a resume rewrites the log, a new file, before its
    steps), and then logged `new_steps` more steps, kill it `delay` seconds later, at a random moment of the next
    steps. Returns 1 if it was killed."""
    log, t_end = out / "metrics.jsonl", time.time() + wait
    stamp, started = os.stat(log).st_ino if resume else None, None
    while proc.poll() is None and time.time() < t_end:
        if os.path.exists(out / "ckpt.pt") and os.path.exists(log) and os.stat(log).st_ino != stamp:
            steps = sum('"pass_rate"' not in line for line in open(log))
            started = steps if started is None else started
            if steps >= started + new_steps:
                break
        time.sleep(0.05)
    time.sleep(delay)
    if proc.poll() is not None:
        return 0
    kill()
    return 1


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_sigkill_and_resume_until_done(base, k):
    """k=0: nothing is in flight at a checkpoint, so a resumed run must equal the uninterrupted one exactly. k=2:
    groups in flight at the checkpoint are regenerated after a resume from new prompts and sampling positions."""
    args = ("--max_steps=12", "--ckpt_every=2", "--zero_var_filter=false", f"--max_lag={k}")
    ref, out = base / f"uninterrupted_k{k}", base / f"killed_k{k}"
    # the uninterrupted run beside the killed ones: each takes one thread, the machine has two cores
    err_log = base / f"uninterrupted_k{k}.err"
    uninterrupted = subprocess.Popen(command(ref, *args), env=ENV, stdout=subprocess.DEVNULL, stderr=open(err_log, "w"))
    rng, kills, first_ck_step, attempts = random.Random(9 + k), 0, None, 0
    while True:
        attempts += 1
        assert attempts <= 8, "the run never finished"
        resume = ("--resume",) if os.path.exists(out / "ckpt.pt") else ()
        proc = subprocess.Popen(command(out, *args, *resume), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if kills < 3:
            kills += kill_when_under_way(proc, out, resume, rng.uniform(0.0, 1.0),
                                         lambda: proc.send_signal(signal.SIGKILL))
        _, err = proc.communicate(timeout=600)
        if first_ck_step is None:
            first_ck_step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
            first_rows = [r for r in read_jsonl(out / "metrics.jsonl", torn_ok=True) if r["step"] <= first_ck_step]
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert kills >= 2
    assert uninterrupted.wait(timeout=600) == 0, err_log.read_text()[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")  # no torn line left behind
    train = [r["step"] for r in rows if "pass_rate" not in r]
    evals = [r["step"] for r in rows if "pass_rate" in r]
    assert train == list(range(1, 13))  # every step exactly once, in order
    assert evals == [0, 2, 4, 6, 8, 10, 12]
    assert [r["policy_version"] for r in rows if "pass_rate" not in r] == train
    hours = [r["device_hours"] for r in rows]
    assert hours == sorted(hours)
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 12
    # the computation is deterministic up to the first checkpoint: those rows match the uninterrupted run's exactly
    ref_rows = read_jsonl(ref / "metrics.jsonl")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(first_rows) == strip(ref_rows[:len(first_rows)])
    # after a resume, in-flight completions are regenerated from another sampling position: measure how close
    a = {(r["step"], "eval" in r): r for r in strip(rows)}
    b = {(r["step"], "eval" in r): r for r in strip(ref_rows)}
    same = [s for s in range(1, 13) if a[s, False] == b[s, False]]
    w, w_ref = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (out, ref))
    gap = max(((w[k] - w_ref[k]).abs().max() / w_ref[k].abs().max()).item() for k in w)
    print(f"\nkills {kills}, first checkpoint at step {first_ck_step}; training rows identical to the uninterrupted "
          f"run at steps {same}; final weights: largest difference {gap:.2e} of the tensor's largest entry")
    assert set(range(1, first_ck_step + 1)) <= set(same)
    if k == 0:
        assert same == list(range(1, 13)) and gap == 0.0
        assert [r for r in strip(rows) if "eval" in r] == [r for r in strip(ref_rows) if "eval" in r]


@pytest.mark.slow
def test_torchrun_sigkill_and_resume_until_done(base):
    """torchrun with 3 ranks (2 FSDP2 trainers, 1 generator): SIGKILL the whole job at random moments and --resume it
    with the same layout until it finishes. Generation runs asynchronously beside training, so a resumed job is not
    bit-identical to an uninterrupted one; what must hold is the log: every step once and in order, evals on
    schedule (less any a resume names lost: asked before a checkpoint, ended after it), the policy version equal to
    the step, the compute axis never going back, the generator's curriculum saved beside the checkpoint."""
    out, rng, kills, lost = base / "torchrun_killed", random.Random(5), 0, set()
    args = ("--max_steps=10", "--ckpt_every=2", "--gen_ranks=1", "--zero_var_filter=false")
    for attempt in range(8):
        resume = ("--resume",) if os.path.exists(out / "ckpt.pt") else ()
        cmd = torchrun_command("--standalone", "--nproc_per_node=3", *command(out, *args, *resume)[1:])
        proc = subprocess.Popen(cmd, env={**ENV, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if kills < 2:  # the launcher and every rank at once, as a lost node would, a step into the (re)start: the
            # steps are fast enough that a kill timed from the start alone can land after the run's end
            kills += kill_when_under_way(proc, out, resume, rng.uniform(0.0, 0.5),
                                         lambda: os.killpg(proc.pid, signal.SIGKILL), new_steps=1)
        text, err = proc.communicate(timeout=600)
        # an evaluation asked before a checkpoint may end after it: a kill then loses its row, and a resume names it
        lost |= {int(n) for x in re.findall(r"held-out rows lost: steps \[([\d, ]*)\]", text) for n in x.split(",")}
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert proc.returncode == 0 and kills == 2
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "pass_rate" not in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert [r["step"] for r in rows if "pass_rate" in r] == [s for s in (0, 2, 4, 6, 8, 10) if s not in lost]
    assert all(r["policy_version"] == r["step"] and r["lag_max"] <= 2 for r in train)
    for kind in (True, False):  # evaluations run on the generator ranks and land in the log a little later
        hours = [r["device_hours"] for r in rows if ("pass_rate" in r) == kind]
        assert hours == sorted(hours) and hours[-1] > 0
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 10 and ck["world"] == 3 and ck["generators"] == [2]
    assert "model" not in ck and sorted(os.listdir(out / ck["shards"])) == [".metadata", "__0_0.distcp",
                                                                            "__1_0.distcp"]  # each trainer's shard
    gen = torch.load(out / "generator2.pt", weights_only=True)
    assert gen["version"] >= 8 and gen["pool"]["position"] > 0  # pipeline_rl.Rollouts.state_dict() and the version
    assert {"engine", "reward_errors", "bad_prompts"} <= set(gen)
    # a resume with another layout is refused in one line, and leaves the run directory as it was
    before = tree_hashes(out)
    line = one_line_error(run_command(command(out, *args, "--resume"), timeout=300))
    assert line.startswith("error: checkpoint") and "same torchrun" in line and tree_hashes(out) == before


# 5. Before the first step: a hub that cannot be reached, and own data used up by the held-out split
def closed_port():
    """A local port nothing listens on: a connection to it is refused at once, on any machine, networked or not."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, needle", [(["--model=assets/nope"], "no folder 'assets/nope' exists here"),
                                          (["--task=gsm8k", "--model=assets/nope"], "--data_path=FILE")])
def test_a_hub_that_cannot_be_reached_is_one_line_naming_offline_mode(tmp_path, monkeypatch, capsys, argv, needle):
    """Online mode and no hub: one line at once (the libraries would retry for a minute), saying what to do."""
    import datasets.config
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    line = refused(capsys, *argv, f"--out_dir={tmp_path / 'run'}")
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line and needle in line, line
    assert not (tmp_path / "run").exists()


def test_offline_a_missing_folder_says_so_beside_the_hubs_answer(tmp_path, capsys):
    line = refused(capsys, "--model=assets/nope", f"--out_dir={tmp_path / 'run'}")
    assert "no folder 'assets/nope' exists here, and the hub answered: " in line, line


@pytest.mark.slow
def test_the_real_command_without_offline_mode_fails_in_one_line(tmp_path):
    """The real command with HF_HUB_OFFLINE unset and the hub's address a closed local port: one line, no retries;
    the time it took is printed (the goal is seconds, not the minute of retries)."""
    env = {k: v for k, v in ENV.items() if not k.endswith("_OFFLINE")}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
    t0 = time.time()
    p = subprocess.run(scalerl_command("--model=Qwen/Qwen3-0.6B", f"--out_dir={tmp_path / 'run'}"), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    print(f"refused in {time.time() - t0:.1f}s")
    line = one_line_error(p)
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line and "Retrying" not in p.stdout, line


def test_a_prompt_set_used_up_by_the_held_out_split_is_a_warning_naming_the_flags(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"problem": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(300)))
    train, val, _ = sources.load_data(scalerl.parse_args(["--model=./mine", f"--task={rows}"]))  # the hub preset
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning:"))
    assert (len(train), len(val)) == (44, 256) and "44 training prompts" in line and "256 held out" in line
    assert "4 steps of --batch_prompts=32" in line and "--eval_prompts" in line
    sources.load_data(scalerl.parse_args([f"--task={rows}", "--model=./mine", "--eval_prompts=160"]))
    assert "fewer than held out" in capsys.readouterr().out  # 140 left: 4 steps, but fewer than held out
    sources.load_data(scalerl.parse_args([]))  # the default run: no warning
    assert "warning" not in capsys.readouterr().out
