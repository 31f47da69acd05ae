"""The main job, in layers: config parsing in-process (infra/cli.py), then real `python scalerl.py` runs with
the `smoke` preset.

1. parse_args: every bad input exits with code 2 and one line naming the option; good inputs in both forms; --help
   lists every option with its default and its whole comment, by section.
2. A fresh smoke run: the metrics log, the config record and the checkpoint have the promised shape.
3. An existing run directory without --resume is refused and left byte-for-byte unchanged.
4. Resume: 2 steps, then --resume to 4 steps gives one seamless log; --resume without a checkpoint is refused.
5. A bad task source is a one-line error, not a traceback.

All runs share one temporary base directory, so the supervised warm start is computed once and then read from
its cache (`<base>/warmstart/`). Run: python -m pytest tests/test_scalerl.py (add `-m "not slow"` to skip the runs).
"""
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import data
import scalerl
import trainer
from infra import cli, sources
from conftest import (TIMING, copy_run, one_line_error, read_jsonl, refused, run_base, run_command, scalerl_command,
                      tree_hashes)

METRIC_NAMES = {"step", "device_hours", "policy_version", "reward", "loss", "clip_frac", "mismatch_kl", "lag_mean",
                "lag_max", "dropped_stale", "trunc_rate", "zero_var_frac", "npr_removed", "gen_tok_s", "train_tok_s",
                "dt", "logratio_sd", "dapo_clip_low", "dapo_clip_high", "dapo_grad_low", "dapo_grad_high", "grad_norm"}

# ---------------------------------------------------------------------------------------------------------------------
# 1. Config parsing (in-process)

BAD = [  # (argv, text the single error line must contain)
    (["--max_step=5"], "did you mean --max_steps"),
    (["--max_step", "5"], "did you mean --max_steps"),
    (["--max_steps=abc"], "--max_steps"),
    (["--max_steps=1.5"], "--max_steps"),
    (["--lr=fast"], "--lr"),
    (["--npr=maybe"], "--npr"),
    (["--config", "nope"], "nope"),
    (["--config=nope"], "smoke"),  # the message lists the presets there are
    (["--loss=ppo"], "--loss"),
    (["--agg=mean"], "--agg"),
    (["--adv_norm=std"], "--adv_norm"),
    (["--is_correction=both"], "--is_correction"),
    (["--is_cap=0"], "--is_cap"),
    (["--off_policy=async"], "--off_policy"),
    (["--engine=sglang"], "--engine"),
    (["--dtype=float16"], "--dtype"),
    (["--max_steps=0"], "--max_steps"),
    (["--batch_prompts=-4"], "--batch_prompts"),
    (["--group_size=0"], "--group_size"),
    (["--group_size=1"], "--group_size"),
    (["--n_layer=0"], "--n_layer"),
    (["--slots=0"], "--slots"),
    (["--eval_every=0"], "--eval_every"),
    (["--micro_batch_tokens=-1"], "--micro_batch_tokens"),
    (["--sft_steps=-1"], "--sft_steps"),
    (["--threads=-1"], "--threads"),
    (["--rl_seed=-2"], "--rl_seed"),
    (["--lr=0"], "--lr"),
    (["--lr=-1e-3"], "--lr"),
    (["--lr=nan"], "--lr"),
    (["--temperature=0"], "--temperature"),
    (["--max_lag=-1"], "--max_lag"),
    (["--off_policy=ppo", "--max_lag=0"], "--max_lag"),
    (["--think_min=50", "--think_max=40"], "--think_max"),
    (["--n_embd=130", "--n_head=4"], "--n_embd"),
    (["--npr_threshold=1.5"], "--npr_threshold"),
    (["--sft_error_rate=1"], "--sft_error_rate"),
    (["--levels=abc"], "--levels"),  # else main() dies in int() with a traceback
    (["--max_steps"], "--max_steps"),  # value missing at the end
    (["--config"], "--config"),
    (["max_steps=5"], "max_steps=5"),  # a stray word, not an option
    (["--max_nonfinite=0"], "--max_nonfinite"),
    (["--ckpt_every=0"], "--ckpt_every"),
    (["--eval_samples=-1"], "--eval_samples"),
    (["--dist_timeout=-1"], "--dist_timeout"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_exits_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        scalerl.parse_args(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]


def test_good_options_both_forms():
    assert scalerl.parse_args([]) == scalerl.Config()  # the default preset changes nothing
    for argv in (["--max_steps=7"], ["--max_steps", "7"], ["--max-steps=7"]):
        assert scalerl.parse_args(argv).max_steps == 7, argv
    cfg = scalerl.parse_args(["--lr", "0.25", "--loss=dapo", "--out_dir", "x/y", "--npr=false", "--interrupt=0"])
    assert (cfg.lr, cfg.loss, cfg.out_dir, cfg.npr, cfg.interrupt) == (0.25, "dapo", "x/y", False, False)
    assert type(cfg.lr) is float and type(scalerl.parse_args(["--seed=3"]).seed) is int
    for text, want in (("true", True), ("1", True), ("yes", True), ("False", False), ("no", False)):
        assert scalerl.parse_args([f"--resume={text}"]).resume is want
    assert scalerl.parse_args(["--resume"]).resume is True  # a bare flag sets a bool
    assert scalerl.parse_args(["--npr=false", "--npr"]).npr is True  # the last word wins
    cfg = scalerl.parse_args(["--zero_var_filter", "--max_steps=3"])  # a bare bool does not eat the next option
    assert cfg.zero_var_filter is True and cfg.max_steps == 3


def test_an_option_newer_than_the_run_counts_as_its_default(tmp_path, capsys):
    """A run started before --rl_seed existed ran with its default: --resume refuses another value, takes the same."""
    saved = asdict(scalerl.Config())
    del saved["rl_seed"]
    (tmp_path / "config.json").write_text(json.dumps({"config": saved}))
    with pytest.raises(SystemExit):
        cli.restore_options(scalerl.Config(), tmp_path / "config.json", {"rl_seed": 1})
    assert "--rl_seed=1 does not fit this run (it was started with -1" in capsys.readouterr().err
    assert cli.restore_options(scalerl.Config(), tmp_path / "config.json", {"rl_seed": -1}).rl_seed == -1


@pytest.mark.parametrize("preset", list(scalerl.PRESETS))
def test_every_preset_passes_the_option_checks(preset):
    # --dry_run: every check but whether this machine has the preset's engine (the next test)
    cli.validate(scalerl.parse_args(["--config", preset, "--dry_run"]))


def test_without_vllm_a_vllm_run_is_refused_in_one_line_and_its_help_and_plan_work(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        scalerl.parse_args(["--config=8b"])
    line = capsys.readouterr().err.strip()
    assert e.value.code == 2 and line.startswith("error: --engine=vllm needs vLLM") and "requirements-vllm.txt" in line
    with pytest.raises(SystemExit) as e:
        scalerl.parse_args(["--config=8b", "--help"])
    assert e.value.code == 0 and "default from preset '8b'" in capsys.readouterr().out
    assert scalerl.parse_args(["--config=8b", "--dry_run"]).engine == "vllm"


def test_preset_then_overrides():
    smoke = scalerl.PRESETS["smoke"]
    base = asdict(scalerl.Config())
    cfg = asdict(scalerl.parse_args(["--config", "smoke"]))
    assert cfg == {**base, **smoke, "out_dir": "out/smoke"}  # exactly the preset's fields change, and its run directory
    assert any(base[k] != v for k, v in smoke.items())  # and the preset does change something
    key = "max_steps"
    assert key in smoke
    for argv in (["--config", "smoke", f"--{key}=3"], [f"--{key}=3", "--config=smoke"]):  # overrides win, any order
        cfg = scalerl.parse_args(argv)
        assert cfg.max_steps == 3
        assert all(getattr(cfg, k) == v for k, v in smoke.items() if k != key)


def test_each_preset_and_rl_seed_has_its_own_run_directory_and_is_found_by_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, want in (([], "out/tiny"), (["--config=smoke"], "out/smoke"), (["--model=./mine"], "out/hub"),
                       (["--config=gsm8k_0.6b"], "out/gsm8k_0.6b"), (["--config=miniature", "--rl_seed=2"],
                                                                      "out/miniature-s2"), (["--out_dir=x"], "x")):
        assert scalerl.parse_args(argv + ["--dry_run"]).out_dir == want, argv
    # --resume, --eval_only and --export read the run that the same --config wrote
    run = asdict(scalerl.parse_args(["--config=smoke"]))
    os.makedirs("out/smoke")
    (tmp_path / "out/smoke/config.json").write_text(json.dumps({"config": {**run, "lr": 0.5}}))
    for flag in ("--resume", "--eval_only", "--export"):
        assert scalerl.parse_args(["--config=smoke", flag]).lr == 0.5
    assert scalerl.parse_args(["--resume"]).lr == scalerl.Config().lr  # out/tiny: no run there


@dataclass
class Toy:
    """A config for the --help reader: two sections and a comment continued on the next line."""
    # first section
    a: int = 1             # the a,
                           # continued here
    b: str = "x"           # the b
    # second section
    c: bool = False        # the c


def test_help_reads_sections_and_continued_comments(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--help"], Toy, {"tiny": {}, "hub": {}})
    assert e.value.code == 0
    out = capsys.readouterr().out
    order = ["# first section", "--a=1", "the a, continued here", '--b="x"', "the b", "# second section",
             "--c=False", "the c"]
    assert [out.index(text) for text in order] == sorted(out.index(text) for text in order), out
    assert out.count("\n# ") == 2 and "A config" not in out  # the docstring is no option and no section


@pytest.mark.parametrize("argv, preset", [([], "tiny"), (["--model=my/model"], "hub"), (["--config=8b"], "8b"),
                                          (["--config", "math_1.7b", "--model=./m"], "math_1.7b")])
def test_help_shows_the_defaults_this_command_line_starts_from(capsys, argv, preset):
    """--help given --model or --config shows the preset's defaults (a --model other than tiny: 'hub'), and
    the run's header names the preset (cfg.preset)."""
    with pytest.raises(SystemExit):
        scalerl.parse_args(argv + ["--help"])
    out = capsys.readouterr().out
    want = {**scalerl.PRESETS[preset], **{a.split("=")[0][2:]: a.split("=")[1] for a in argv if "--model=" in a}}
    assert f"default from preset '{preset}'" in out
    for key in ("think_max", "lr", "batch_prompts", "model", "dtype"):
        value = want.get(key, getattr(scalerl.Config, key))
        assert f"--{key}={json.dumps(value) if isinstance(value, str) else value} " in out, key
    assert scalerl.parse_args(argv + ["--dry_run"]).preset == preset  # --dry_run: 8b's vLLM need not be installed


def test_help_lists_every_option_with_its_comment(capsys):
    """--help (in-process) names every preset and every Config field with its default and its whole comment,
    the comment-only lines that continue it included."""
    with pytest.raises(SystemExit) as e:
        scalerl.parse_args(["--help"])
    assert e.value.code == 0
    # long comments wrap in the help
    out = " ".join(capsys.readouterr().out.split())
    # each field's whole comment, read here from the source: its line's, then the comment-only lines indented under it
    docs, name = {}, None
    for line in inspect.getsource(scalerl.Config).splitlines():
        if line.startswith(" " * 8) and line.strip().startswith("#"):
            docs[name] += " " + line.strip()[1:].strip()
        elif ":" in line and "#" in line and not line.strip().startswith("#"):
            name = line.split(":")[0].strip()
            docs[name] = line.split("#", 1)[1].strip()
    assert sum(" " in doc for doc in docs.values()) and any(d.endswith("seed noise") for d in docs.values())
    for f in fields(scalerl.Config):
        assert docs[f.name] and f"--{f.name}=" in out and docs[f.name] in out, f.name
    assert all(name in out for name in scalerl.PRESETS)

# ---------------------------------------------------------------------------------------------------------------------
# Subprocess runs of the real command


def run(*args, timeout=600):
    """`python scalerl.py --config smoke --threads=1 ARGS`, offline, output captured."""
    return run_command(scalerl_command("--config", "smoke", "--threads=1", *args), timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One base directory for every run: the warm start is cached in <base>/warmstart/ (the session's) and shared."""
    return run_base(tmp_path_factory, "runs")


@pytest.fixture(scope="module")
def smoke_run(runs):
    out = runs / "smoke"
    p = run(f"--out_dir={out}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p

# ---------------------------------------------------------------------------------------------------------------------
# 2. A fresh smoke run


@pytest.mark.slow
def test_smoke_run_metrics(smoke_run):
    out, p = smoke_run
    assert "Traceback" not in p.stderr
    meta = json.load(open(out / "config.json"))
    cfg = scalerl.Config(**meta["config"])
    assert meta["config"] == asdict(scalerl.parse_args(["--config", "smoke", "--threads=1", f"--out_dir={out}"]))
    assert set(meta["versions"]) >= {"python", "torch", "transformers"} and meta["versions"]["torch"] == torch.__version__
    assert "git" in meta

    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "pass_rate" not in r]
    evals = [r for r in rows if "pass_rate" in r]
    assert [r["step"] for r in train] == list(range(1, cfg.max_steps + 1))
    for r in train:
        assert METRIC_NAMES <= set(r), METRIC_NAMES - set(r)
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in METRIC_NAMES), r
        assert 0 <= r["lag_mean"] <= r["lag_max"] <= cfg.max_lag
        assert r["policy_version"] == r["step"]  # one published version per optimizer step
        assert -1 <= r["reward"] <= 1 and 0 <= r["trunc_rate"] <= 1 and 0 <= r["zero_var_frac"] <= 1
        assert r["dt"] > 0 and r["gen_tok_s"] > 0 and r["train_tok_s"] >= 0
        assert r["fresh_mismatch"] is None or r["fresh_mismatch"] >= 0  # None: no token sampled by these weights
    want_evals = sorted({0, cfg.max_steps} | set(range(cfg.eval_every, cfg.max_steps + 1, cfg.eval_every)))
    assert [r["step"] for r in evals] == want_evals
    assert all(0 <= r["pass_rate"] <= 1 for r in evals)
    # the built-in task's ceiling under the thinking budget, printed with the fit
    bound = data.feasible_share(sources.load_data(cfg)[1], (cfg.think_min, cfg.think_max))
    assert f"holds the error-free thinking of {bound:.3f} of the held-out problems" in p.stdout

    # the compute axis: 0 before RL, then the sum of the step times (one device), never decreasing
    assert rows[0]["step"] == 0 and "pass_rate" in rows[0] and rows[0]["device_hours"] == 0.0
    hours = [r["device_hours"] for r in rows]
    assert hours == sorted(hours)
    total = 0.0
    for r in train:
        total += r["dt"] / 3600
        assert r["device_hours"] == pytest.approx(total, rel=1e-9)
    for a, b in zip([0] + [r["dropped_stale"] for r in train], [r["dropped_stale"] for r in train]):
        assert b >= a  # a cumulative counter

    # the checkpoint: plain tensors and containers, and it restores the model and optimizer it came from
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert {"model", "opt", "generating", "step"} <= set(ck) and ck["step"] == cfg.max_steps
    vocab = ck["model"]["model.embed_tokens.weight"].shape[0]
    model = trainer.tiny_model(cfg, vocab)
    model.load_state_dict(ck["model"])  # strict: the same architecture as the config says
    torch.optim.AdamW(model.parameters()).load_state_dict(ck["opt"])
    gen = ck["generating"]  # one process: the generating side's state (pipeline_rl.Rollouts.state_dict)
    assert set(gen) == {"pool", "engine", "reward_errors", "bad_prompts"}
    assert set(gen["engine"]) == {"rng", "budget_rng"}
    assert isinstance(gen["pool"], dict) and gen["pool"]["groups_seen"] == cfg.max_steps * cfg.batch_prompts
    assert not os.path.exists(str(out / "ckpt.pt") + ".tmp")

# ---------------------------------------------------------------------------------------------------------------------
# 3. An existing run directory is never overwritten


@pytest.mark.slow
def test_existing_run_dir_refused_and_untouched(smoke_run):
    out, _ = smoke_run
    before = tree_hashes(out)
    assert {"metrics.jsonl", "config.json", "ckpt.pt"} <= set(before)
    p = run(f"--out_dir={out}", "--max_steps=1")
    assert "--resume" in one_line_error(p)
    assert tree_hashes(out) == before

# ---------------------------------------------------------------------------------------------------------------------
# 4. Resume


@pytest.mark.slow
def test_resume_continues_the_log(runs, finished_run):
    # 2 steps with zero_var_filter off: every step takes an optimizer step whatever the rewards (the optimizer state
    # matters)
    out = copy_run(finished_run, runs / "resume")
    first = read_jsonl(out / "metrics.jsonl")
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 2

    p = run(f"--out_dir={out}", "--resume", "--max_steps=4", "--zero_var_filter=false")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resumed" in p.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[:len(first)] == first  # the old rows are kept as they were
    train = [r for r in rows if "pass_rate" not in r]
    evals = [r["step"] for r in rows if "pass_rate" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert evals.count(0) == 1 and evals.count(4) == 1 and len(evals) == len(set(evals))
    assert [r["policy_version"] for r in train] == [1, 2, 3, 4]
    hours = [r["device_hours"] for r in rows]
    assert hours == sorted(hours) and train[2]["device_hours"] > train[1]["device_hours"]
    cfg = scalerl.Config(**json.load(open(out / "config.json"))["config"])
    assert cfg.resume and cfg.max_steps == 4
    for r in train:  # every group kept (a step whose groups all have equal rewards makes no update), with the
        assert r["zero_var_frac"] == 0  # warm-up schedule counted from the first step across the resume
        assert r["lr"] == pytest.approx(cfg.lr * min(1.0, r["step"] / max(cfg.warmup_steps, 1)))
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 4 and ck["version"] == 4


@pytest.mark.slow
def test_rl_seed_varies_rl_alone(runs, smoke_run):
    """--rl_seed reseeds what RL draws (curriculum order, sampling, evaluation draws) and nothing the run starts from:
    the same warm start is loaded; --rl_seed equal to --seed is the default run, row for row."""
    strip = lambda path: [{k: v for k, v in r.items() if k not in TIMING} for r in read_jsonl(path)]  # noqa: E731
    loaded = set()
    with ThreadPoolExecutor(2) as pool:  # side by side: each run takes one thread, the machine has two cores
        done = list(pool.map(lambda s: run(f"--out_dir={runs / f'rl_seed{s}'}", f"--rl_seed={s}"), (0, 1)))
    for p in done:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        loaded |= {line for line in p.stdout.splitlines() if line.startswith("warm start: loaded")}
    assert len(loaded) == 1  # both from the smoke run's warm start
    base = strip(smoke_run[0] / "metrics.jsonl")
    assert strip(runs / "rl_seed0" / "metrics.jsonl") == base
    other = strip(runs / "rl_seed1" / "metrics.jsonl")
    assert len(other) == len(base) and other != base


def test_resume_without_checkpoint_refused(runs, capsys):
    out = runs / "empty"
    out.mkdir()
    line = refused(capsys, "--config", "smoke", f"--out_dir={out}", "--resume")
    assert "checkpoint" in line and str(out) in line
    assert os.listdir(out) == []

@pytest.mark.slow
def test_failed_start_folder(runs, smoke_run, capsys):
    """A folder whose run stopped before its first checkpoint (here: an empty log and a config, as a kill during the
    step-0 evaluation leaves it) cannot be resumed, and starts afresh without --resume."""
    out = runs / "failed_start"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "config.json").write_text(json.dumps(dict(config=asdict(scalerl.parse_args(["--config", "smoke"])))))
    assert "no checkpoint" in refused(capsys, "--config", "smoke", f"--out_dir={out}", "--resume")
    p = run(f"--out_dir={out}", "--max_steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "eval" not in r] == [1, 2]


@pytest.mark.slow
def test_a_start_that_failed_after_its_step_0_checkpoint_starts_afresh(runs, finished_run, capsys):
    """A torchrun start whose generator rank failed after trainer rank 0 wrote the step-0 checkpoint holds nothing to
    continue: a fresh start goes over it. A checkpoint past step 0 is still refused, its log lost or not."""
    out = copy_run(finished_run, runs / "step0")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    (out / "metrics.jsonl").write_text("")
    assert "already holds a run" in refused(capsys, "--config", "smoke", f"--out_dir={out}")  # step 2's checkpoint
    torch.save(dict(ckpt, step=0), out / "ckpt.pt")
    p = run(f"--out_dir={out}", "--max_steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "eval" not in r] == [1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# 5. Bad task sources


@pytest.mark.parametrize("case", ["missing", "too_few", "no_answer_column"])
def test_bad_task_source(runs, case, capsys):
    d = runs / f"task_{case}"
    d.mkdir()
    path, needle = {"missing": ("/nonexistent/file.jsonl", "does not exist"),
                    "too_few": (d / "few.jsonl", "usable prompts"),
                    "no_answer_column": (d / "noans.jsonl", "no column 'answer'")}[case]
    if case != "missing":
        rows = [{"problem": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(3)]
        if case == "no_answer_column":
            rows = [{"problem": r["problem"], "solution": r["answer"]} for r in rows]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = refused(capsys, "--config", "smoke", f"--out_dir={d / 'run'}", f"--task={path}", "--eval_prompts=8")
    assert str(path) in line and needle in line, line
    assert not os.path.exists(d / "run" / "metrics.jsonl")


@pytest.mark.parametrize("load, world, want", [(0.1, None, 2), (1.2, None, 1), (0.0, "2", 1)])
def test_threads_follow_the_cores_left_idle(monkeypatch, load, world, want):
    """--threads=0: two threads in one process on an idle machine; one when another job keeps a core busy (two
    threads on a shared core wait on each other) or under torchrun."""
    from infra import run
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(run, "busy_cores", lambda: load)
    if world:
        monkeypatch.setenv("WORLD_SIZE", world)
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        run.set_threads(scalerl.Config())
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_busy_cores_sees_a_busy_process_now():
    """What set_threads reads: the cores busy right now (not the load average's last minute), one spinning process
    counting about one core."""
    from infra import run
    quiet = run.busy_cores()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = run.busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert 0 <= quiet <= os.cpu_count() and busy >= 0.6, (quiet, busy)
