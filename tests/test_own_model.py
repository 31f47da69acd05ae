"""Bring your own model and data, as a user would from the command line, with real parts, made and run as
docs/own-model-and-data.md says ("Try it"): a small Qwen2 model (random weights from a config, tied embeddings) saved
with `save_pretrained`, a byte-level BPE tokenizer trained there with `tokenizers` (no `</think>` token of its own),
and a GSM8K-format jsonl whose answers are worked solutions ending in `#### 1,234`.

1. A few steps run; `<think>`/`</think>` are added to the tokenizer; the policy comes out as `hf/`, which
   `from_pretrained` loads and which gives the trainer's logprobs.
2. `--eval_only` on the run gives its last evaluation exactly; `--export` rewrites `hf/` from the checkpoint.
3. `--resume` keeps the run's own options, takes the ones a run may change, refuses the others in one line.
4. `--help` lists every option with its default.

Run: python -m pytest tests/test_own_model.py
"""
from dataclasses import fields
import json
import os

import pytest
import torch

import scalerl
import trainer
from infra import sources
from conftest import (ROOT, one_line_error, python_blocks, read_jsonl, refused, run_command, scalerl_command,
                      scalerl_commands, tree_hashes)

pytestmark = pytest.mark.slow


DOC = os.path.join(ROOT, "docs", "own-model-and-data.md")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(model dir, GSM8K-format jsonl, base dir): what a user brings, made by docs/own-model-and-data.md's script."""
    base = tmp_path_factory.mktemp("own")
    script, = python_blocks(DOC)
    here = os.getcwd()
    try:  # the script writes ./my_model and my_prompts.jsonl where it runs
        os.chdir(base)
        exec(compile(script, DOC, "exec"), {})
    finally:
        os.chdir(here)
    from transformers import AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(base / "my_model")("</think>")["input_ids"]) > 1  # the case to handle
    return base / "my_model", base / "my_prompts.jsonl", base


def command(own, out, *args):
    """The page's training command, its files found in `own`, into `out` on one thread, then `args`."""
    model, rows, _ = own
    words = next(argv for _, argv in scalerl_commands(DOC) if "--max_steps=5" in argv)
    words = [w.replace("./my_model", str(model)).replace("my_prompts.jsonl", str(rows)) for w in words]
    return scalerl_command(*words, f"--out_dir={out}", "--threads=1", *args)


def doc_command(flag):
    """The page's command with `flag` (--max_steps=5: the training one; --eval_only; --export), as it is written."""
    return scalerl_command(*next(argv for _, argv in scalerl_commands(DOC) if flag in argv and "--slots=16" in argv
                                 or argv == ["--model=./my_model", flag]))


@pytest.fixture(scope="module")
def run(own):
    """The page's training command where its script wrote the files: the run lands in out/hub (one thread here)."""
    p = run_command(doc_command("--max_steps=5") + ["--threads=1"], timeout=300, cwd=own[2])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return own[2] / "out" / "hub", p


def test_own_model_and_data_train_and_export(own, run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, p = run
    assert "</think> added to the tokenizer" in p.stdout and "72 train / 8 held-out" in p.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval" not in r] == [1, 2, 3, 4, 5]
    # a random model never passes: the run says that nothing is learned, and why
    assert "warning: no learning signal for 5 steps" in p.stdout and "length budget" in p.stdout
    meta = json.load(open(out / "config.json"))
    assert meta["config"]["lr"] == scalerl.HUB["lr"]  # a hub model starts from the hub preset, not tiny's budgets
    tok = AutoTokenizer.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    assert len(tok("</think>", add_special_tokens=False)["input_ids"]) == 1 and len(tok) == meta["vocab"]
    # the export gives the trainer's logprobs (FP32 head) on a real sequence
    ids = torch.tensor([tok("Q: Tom has 3 apples <think> 3 + 4 = 7 </think> 7")["input_ids"]])
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    mine, _ = sources.load_model(scalerl.Config(**{**meta["config"], "model": str(own[0])}), ["math"])  # ./my_model
    mine.load_state_dict(ckpt["model"])
    want = trainer.Policy(mine, 1.0, torch.float32)(ids, torch.ones_like(ids))
    got = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (got - want).abs().max() < 1e-5


def test_eval_only_repeats_the_last_evaluation_and_export_on_demand(own, run):
    out, _ = run
    last = [r for r in read_jsonl(out / "metrics.jsonl") if "eval" in r][-1]
    p = run_command(doc_command("--eval_only"), timeout=300, cwd=own[2])  # out/hub, found by the same --model
    assert p.returncode == 0, p.stderr[-3000:]
    row = read_jsonl(out / "evals.jsonl")[-1]
    assert row["step"] == 5 and (row["pass_rate"], row["eval_len"]) == (last["pass_rate"], last["eval_len"])
    before = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    os.rename(out / "hf", out / "hf_old")
    p = run_command(doc_command("--export"), timeout=300, cwd=own[2])
    assert p.returncode == 0 and "written to" in p.stdout, p.stderr[-3000:]
    from safetensors.torch import load_file
    weights = load_file(out / "hf" / "model.safetensors")
    assert all(torch.equal(weights[k], before[k]) for k in weights)


def test_resume_keeps_the_runs_options(own, run, capsys):
    out, _ = run
    before = tree_hashes(out)
    line = refused(capsys, f"--out_dir={out}", "--resume", "--loss=dapo")  # refused before the prompts are read
    assert "--loss=dapo does not fit this run" in line and "--max_steps" in line
    assert tree_hashes(out) == before
    p = run_command(scalerl_command(f"--out_dir={out}", "--resume", "--max_steps=6"), timeout=300, cwd=own[2])
    assert p.returncode == 0, p.stderr[-3000:]
    meta = json.load(open(out / "config.json"))
    assert meta["config"]["max_steps"] == 6 and meta["config"]["task"] == "my_prompts.jsonl"  # its own options, one changed
    assert [h["step"] for h in meta["history"]] == [0, 5]  # the start and the resume, both recorded
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "eval" not in r] == [1, 2, 3, 4, 5, 6]


def test_help_lists_every_option():
    p = run_command(scalerl_command("--help"))
    assert p.returncode == 0 and not p.stderr
    for f in fields(scalerl.Config):
        assert f"--{f.name}=" in p.stdout, f.name
    assert "gsm8k_0.6b" in p.stdout


def test_tracker(own, tmp_path):
    """--tracker=tensorboard writes event files beside metrics.jsonl; without the package it is a one-line error
    before anything is written."""
    import importlib.util
    out = tmp_path / "tb"
    p = run_command(command(own, out, "--tracker=tensorboard", "--max_steps=2"), timeout=300)
    if importlib.util.find_spec("tensorboard") is None:
        assert "pip install tensorboard" in one_line_error(p) and not out.exists()
    else:
        assert p.returncode == 0, p.stderr[-3000:]
        assert any(name.startswith("events.") for name in os.listdir(out / "tensorboard"))


def test_data_from_the_command_line(own, tmp_path, capsys):
    """reasoning-gym options from --task_options reach the task; a named dataset offline without a local copy, an
    unknown option and an unknown dataset name are one line each, naming the fix or the choices."""
    model, rows, _ = own
    p = run_command(command(own, tmp_path / "rg", "--task=rg:chain_sum", '--task_options={"min_terms": 3}',
                            "--prompt_key=", "--max_steps=1", "--eval_every=1"), timeout=300)
    assert p.returncode == 0 and "rg:chain_sum: " in p.stdout, p.stderr[-3000:]
    for args, needle in ((["--task=gsm8k", "--prompt_key="], "--data_path"),
                         (["--task=rg:chain_sum", '--task_options={"nope": 1}', "--prompt_key="], "nope"),
                         (["--task=gsm8", "--prompt_key="], "gsm8k"),
                         (["--task=rg:chain_sum", "--task_options=[1]"], "JSON object")):
        line = refused(capsys, *command(own, tmp_path / "bad", *args)[2:])  # in this process: a refusal
        assert needle in line, line
        assert not (tmp_path / "bad").exists()
