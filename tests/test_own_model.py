"""Bring your own model and data, as a user would from the command line, with real parts: a small Qwen2 model (random
weights from a config, tied embeddings) saved with `save_pretrained`, a byte-level BPE tokenizer trained here with
`tokenizers` (no `</think>` token of its own), and a GSM8K-format jsonl whose answers are worked solutions ending in
`#### 1,234`.

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
import random

import pytest
import torch

import scalerl
import trainer
from infra import sources
from conftest import one_line_error, read_jsonl, refused, run_command, scalerl_command, tree_hashes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(model dir, GSM8K-format jsonl, base dir): what a user brings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    base = tmp_path_factory.mktemp("own")
    rng, rows = random.Random(0), []
    for _ in range(80):
        a, b = rng.randint(2, 600), rng.randint(2, 600)
        rows.append(dict(question=f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                         answer=f"He has {a} + {b} = {a + b} apples.\n#### {a + b:,}"))
    (base / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([r["question"] + " " + r["answer"] for r in rows], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    assert len(tok("</think>")["input_ids"]) > 1  # the case to handle: the thinking close is several tokens
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(base / "model")
    tok.save_pretrained(base / "model")
    return base / "model", base / "gsm8k.jsonl", base


def command(own, out, *args):
    model, rows, _ = own
    return scalerl_command(f"--model={model}", "--task=gsm8k", f"--data_path={rows}", f"--out_dir={out}",
                           "--dtype=float32", "--threads=1", "--max_steps=5", "--eval_every=5", "--eval_prompts=8",
                           "--eval_samples=2", "--batch_prompts=4", "--group_size=4", "--think_min=16",
                           "--think_max=24", "--answer_budget=8", "--max_prompt=256", "--slots=16", *args)


@pytest.fixture(scope="module")
def run(own):
    out = own[2] / "run"
    p = run_command(command(own, out), timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p


def test_own_model_and_data_train_and_export(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, p = run
    assert "</think> added to the tokenizer" in p.stdout and "gsm8k: 72 train / 8 held-out" in p.stdout
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
    mine, _ = sources.load_model(scalerl.Config(**meta["config"]), ["math"])
    mine.load_state_dict(ckpt["model"])
    want = trainer.Policy(mine, 1.0, torch.float32)(ids, torch.ones_like(ids))
    got = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (got - want).abs().max() < 1e-5


def test_eval_only_repeats_the_last_evaluation_and_export_on_demand(own, run):
    out, _ = run
    last = [r for r in read_jsonl(out / "metrics.jsonl") if "eval" in r][-1]
    p = run_command(scalerl_command(f"--out_dir={out}", "--eval_only"), timeout=300)  # the run's own options
    assert p.returncode == 0, p.stderr[-3000:]
    row = read_jsonl(out / "evals.jsonl")[-1]
    assert row["step"] == 5 and (row["pass_rate"], row["eval_len"]) == (last["pass_rate"], last["eval_len"])
    before = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    os.rename(out / "hf", out / "hf_old")
    p = run_command(scalerl_command(f"--out_dir={out}", "--export"), timeout=300)
    assert p.returncode == 0 and "written to" in p.stdout, p.stderr[-3000:]
    from safetensors.torch import load_file
    weights = load_file(out / "hf" / "model.safetensors")
    assert all(torch.equal(weights[k], before[k]) for k in weights)


def test_resume_keeps_the_runs_options(own, run, capsys):
    out, _ = run
    before = tree_hashes(out)
    line = refused(capsys, f"--out_dir={out}", "--resume", "--loss=dapo")
    assert "--loss=dapo does not fit this run" in line and "--max_steps" in line
    assert tree_hashes(out) == before
    p = run_command(scalerl_command(f"--out_dir={out}", "--resume", "--max_steps=6"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    meta = json.load(open(out / "config.json"))
    assert meta["config"]["max_steps"] == 6 and meta["config"]["task"] == "gsm8k"  # its own options, one changed
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
                            "--data_path=", "--max_steps=1", "--eval_every=1"), timeout=300)
    assert p.returncode == 0 and "rg:chain_sum: " in p.stdout, p.stderr[-3000:]
    for args, needle in ((["--task=gsm8k", "--data_path="], "--data_path"),
                         (["--task=rg:chain_sum", '--task_options={"nope": 1}', "--data_path="], "nope"),
                         (["--task=gsm8", "--data_path="], "gsm8k"),
                         (["--task=rg:chain_sum", "--task_options=[1]"], "JSON object")):
        line = refused(capsys, *command(own, tmp_path / "bad", *args)[2:])  # in this process: a refusal
        assert needle in line, line
        assert not (tmp_path / "bad").exists()
