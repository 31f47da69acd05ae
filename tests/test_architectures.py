"""Any causal LM: the decoder-only families people fine-tune with RL, each built from its transformers config with
random weights (nothing downloaded), through the trainer's Policy and the PyTorch engine as a run uses them.

- The trainer's logprobs equal the model's own forward (fp32, 1e-5): the model's own head, with GPT-2's tied
  embedding, Gemma 2's final soft cap and Granite's logit scaling, not a plain matmul of the last hidden state.
- The engine's behaviour logprobs equal the trainer's on the tokens it sampled (fp32, 1e-5), and stay close with a
  bf16 body through FSDP2's mixed precision and the FP32 head.
- Every family takes two train steps in one process as a run takes them (an fp32 body; a bf16 body through FSDP2's
  mixed precision with the FP32 head) on the engine's own completions; its export loads with from_pretrained and
  generates, with the trained model's logits in fp32.
- GPT-2 (absolute positions, fused QKV, no num_key_value_heads) trains from the command line and its export loads.
"""
import copy
import json
import math

import pytest
import torch
import transformers as T

import data
import losses
import scalerl
import trainer
from conftest import refused, run_command, scalerl_command, torchrun_command
from engine import Sample, TorchEngine
from infra import dist, run, rundir

V = 300
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V)
KV = dict(num_key_value_heads=2)
CONFIGS = {
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=256, resid_pdrop=0,
                                 embd_pdrop=0, attn_pdrop=0),
    "gpt_neox": lambda: T.GPTNeoXConfig(**BASE, max_position_embeddings=256),
    "llama": lambda: T.LlamaConfig(**BASE, **KV),
    "mistral": lambda: T.MistralConfig(**BASE, **KV, sliding_window=4),
    "qwen2": lambda: T.Qwen2Config(**BASE, **KV),
    "qwen3": lambda: T.Qwen3Config(**BASE, **KV, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**BASE, **KV, head_dim=16, final_logit_softcapping=3.0, sliding_window=4,
                                     tie_word_embeddings=False),
    "gemma3": lambda: T.Gemma3TextConfig(**BASE, **KV, head_dim=16, final_logit_softcapping=3.0),
    "phi3": lambda: T.Phi3Config(**BASE, **KV, pad_token_id=0),
    "olmo2": lambda: T.Olmo2Config(**BASE, **KV),
    "granite": lambda: T.GraniteConfig(**BASE, **KV, logits_scaling=4.0),
}


def build(name, seed=0):
    config = CONFIGS[name]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    head = model.get_output_embeddings()
    if head.weight is not model.get_input_embeddings().weight:  # (a tied head is the input embedding too)
        with torch.no_grad():  # confident logits, as a trained model's: the soft cap and the scale then matter
            head.weight.mul_(20)
    return model


def sampled(model, head_dtype=torch.float32):
    eng = TorchEngine(model, slots=4, max_prompt=6, think_budget=(8, 10), answer_budget=3, eos_id=1,
                      think_close_ids=[2], head_dtype=head_dtype, seed=0)
    return [s for g in eng.generate([Sample(i, i, [5 + i, 6, 7 + i][:2 + i % 2]) for i in range(3)], 2) for s in g]


@pytest.mark.parametrize("name", CONFIGS)
def test_trainer_and_engine_compute_the_models_own_logprobs(name):
    model = build(name)
    policy = trainer.Policy(model, 1.0)
    ids, att, tmask, gen_logp, _ = trainer.rollout_tensors(sampled(model), 0)
    with torch.no_grad():
        logp = policy(ids, att)
        own = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits.float(), -1)
    own = own[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    m = tmask.bool()
    assert (logp - own)[m].abs().max() < 1e-5  # the model's own head, soft cap and scale included
    assert (logp - gen_logp)[m].abs().max() < 1e-5  # the engine samples from the same logits
    assert m.sum() >= 6 * 8


def test_a_plain_matmul_head_would_miss_the_soft_cap_and_the_scale():
    """What the model's own head changes: without its finish, Gemma 2's and Granite's logprobs differ by nats."""
    for name in ("gemma2", "granite"):
        model = build(name)
        ids = torch.randint(5, V, (2, 12))
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
            plain = losses.token_logprobs(hidden, model.get_output_embeddings().weight, ids[:, 1:])
            own = trainer.Policy(model, 1.0)(ids, torch.ones_like(ids))
        assert (plain - own).abs().max() > 0.1, name


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "gemma2", "granite", "phi3"])
def test_bf16_body_and_fp32_head_agree_across_families(name):
    """FSDP2 mixed precision over a group of one (bf16 body, the model's own head in fp32) against an engine holding
    the bf16 body and the fp32 head, as infra.run.make_engine casts them."""
    model = build(name)
    gm = copy.deepcopy(model)
    head = {id(p) for p in gm.get_output_embeddings().parameters()}
    tied = id(gm.get_input_embeddings().weight) in head
    for p in gm.parameters():
        p.data = p.data.to(torch.float32 if id(p) in head and not tied else torch.bfloat16)
    ids, att, tmask, gen_logp, _ = trainer.rollout_tensors(sampled(gm), 0)
    policy = trainer.Policy(model, 1.0, torch.float32, 0, torch.bfloat16)
    dist.shard(policy, trainer.decoder_layers(model), dist.local_group(), torch.bfloat16)
    with torch.no_grad():
        gap = (policy(ids, att) - gen_logp)[tmask.bool()].abs()
    assert gap.mean() < 0.02, (name, gap.mean().item())
    dtypes = {n: dtype for n, _, dtype in policy.weights()}  # what the engines load: the head in fp32 unless tied
    assert dtypes.keys() == dict(model.named_parameters()).keys()
    assert {n for n, d in dtypes.items() if d == torch.float32} == (set() if tied else {
        n for n, p in model.named_parameters() if id(p) in {id(q) for q in model.get_output_embeddings().parameters()}})


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(base dir, a byte-level BPE tokenizer, a GSM8K-format file): what a user brings besides the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    base = tmp_path_factory.mktemp("arch")
    rows = [dict(question=f"What is {a} plus {a + 3}?", answer=f"{a} + {a + 3} = {2 * a + 3}\n#### {2 * a + 3}")
            for a in range(2, 60)]
    (base / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([r["question"] + r["answer"] for r in rows], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return base, T.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>"), base / "rows.jsonl"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_two_steps_in_one_process_then_the_export_loads_and_generates(own, tmp_path, name, dtype):
    """infra.run's one-process pieces: the engine (make_engine's cast), the policy and AdamW (run.policy: FSDP2 mixed
    precision for a bf16 body, the FP32 head), two train steps on the engine's completions with the first step's
    weights loaded before the second, the export (rundir.export_hf of policy.weights(), as run.finish writes it)."""
    tok = copy.deepcopy(own[1])
    tok.pad_token = tok.eos_token  # as sources.load_model sets it
    cfg = scalerl.Config(dtype=dtype, out_dir=str(tmp_path), lr=1e-3, warmup_steps=0, slots=4, max_prompt=6,
                         think_min=8, think_max=10, answer_budget=3, interrupt=False)
    model = build(name)
    eng = run.make_engine(cfg, model, tok, 0)
    policy, opt = run.policy(cfg, dist.Dist(), model, tok)
    params = dict(model.named_parameters()).keys()
    before = {k: v.clone() for k, v in dist.full_state_dict(model).items() if k in params}
    for step in range(2):
        if step:
            eng.load_weights(policy.state(), step)
        groups = eng.generate([Sample(i, i, [5 + i, 6, 7 + i]) for i in range(3)], 2)
        for g in groups:
            for j, s in enumerate(g):
                s.reward = float(j % 2)  # every group has variance: every completion has an advantage
        stats = trainer.train_step(policy, opt, groups, cfg, step)
        assert stats["finite"] and math.isfinite(stats["loss"]) and stats["n_tokens"] >= 6 * 8, stats
    after = dist.full_state_dict(model)
    assert all(after[k].dtype == torch.float32 for k in before)  # the fp32 masters
    assert [k for k in before if torch.equal(after[k], before[k])] == []  # every parameter moved

    final = {n: t.to(d).cpu() for n, t, d in policy.weights()}
    path = rundir.export_hf(cfg, model, tok, final)
    hf = T.AutoModelForCausalLM.from_pretrained(path)
    ids = T.AutoTokenizer.from_pretrained(path)("What is 2 plus 5?", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 and torch.equal(out[:, :ids.shape[1]], ids)
    loaded = hf.state_dict()
    for n, t in final.items():  # the trained weights as export_hf writes them, in the body dtype (and loaded as saved)
        assert torch.equal(loaded[n], t.to(getattr(torch, dtype)).to(loaded[n].dtype)), n
    ids, att, tmask, *_ = trainer.rollout_tensors([s for g in groups for s in g], tok.pad_token_id)
    policy.eval()
    with torch.no_grad():
        mine, theirs = policy(ids, att), hf(input_ids=ids, attention_mask=att).logits.float()
        if dtype == "float32":  # the same weights through the same model code: the trained model's own logits
            assert torch.equal(theirs, model(input_ids=ids, attention_mask=att).logits)
    theirs = torch.log_softmax(theirs, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    gap = (mine - theirs)[tmask.bool()].abs()
    # fp32: the trainer's chunked FP32 head against the export's full log_softmax, 1.1e-6 at most (olmo2); a bf16 body
    # against the export's bf16-rounded weights computed as loaded: a mean of 0.004 to 0.013 nats (0.0004 for GPT-2)
    assert gap.max() < 1e-5 if dtype == "float32" else gap.mean() < 0.03, (gap.max().item(), gap.mean().item())


def saved(own, name, model, tokenizer=True):
    """`model` (and the tokenizer) written with save_pretrained into a folder of the base dir."""
    base, tok, _ = own
    model.save_pretrained(base / name)
    if tokenizer:
        tok.save_pretrained(base / name)
    return base / name


def gpt2(tok, **kw):
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tok),
                                                    n_positions=512, bos_token_id=tok.eos_token_id,
                                                    eos_token_id=tok.eos_token_id), **kw}))


def command(own, model, out, *args):
    return scalerl_command(
        f"--model={model}", "--task=gsm8k", f"--data_path={own[2]}", f"--out_dir={out}", "--dtype=float32",
        "--threads=1", "--max_steps=2", "--eval_every=2", "--eval_prompts=4", "--eval_samples=2", "--batch_prompts=2",
        "--group_size=4", "--think_min=8", "--think_max=12", "--answer_budget=6", "--max_prompt=128", "--slots=8",
        "--zero_var_filter=false", *args)


@pytest.mark.slow
def test_gpt2_trains_from_the_command_line_and_its_export_loads(own, tmp_path):
    """GPT-2 saved with save_pretrained and a byte-level BPE tokenizer, a GSM8K-format file: two steps, the export."""
    out = tmp_path / "run"
    p = run_command(command(own, saved(own, "gpt2", gpt2(own[1])), out), timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    model = T.AutoModelForCausalLM.from_pretrained(out / "hf")
    export_tok = T.AutoTokenizer.from_pretrained(out / "hf")
    ids = export_tok("What is 2 plus 5?", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
    # the export's chat template writes the prompt the policy was trained on: plain Q/A, the instruction, <think>
    prompt = export_tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 5?"}],
                                            add_generation_prompt=True, tokenize=False)
    assert prompt == data.PLAIN_TEMPLATE.format(question="What is 2 plus 5?" + data.MATH_INSTRUCTION) + data.THINK_OPEN


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such directory"),
    ("no_tokenizer", "holds no tokenizer"),
    ("small_vocab", "ids but the model embeds"),
    ("positions", "over the 64 positions"),
    ("recurrent", "keeps a recurrent state"),
])
def test_a_model_the_recipe_cannot_serve_is_refused_in_one_line(own, tmp_path, case, expected, capsys):
    tok = own[1]
    model = {"missing": lambda: own[0] / "nowhere" / "model",
             "no_tokenizer": lambda: saved(own, "bare", gpt2(tok), tokenizer=False),
             "small_vocab": lambda: saved(own, "small", gpt2(tok, vocab_size=len(tok) - 20)),
             "positions": lambda: saved(own, "short", gpt2(tok, n_positions=64)),
             "recurrent": lambda: saved(own, "mamba", T.MambaForCausalLM(T.MambaConfig(
                 vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, state_size=4)))}[case]()
    out = tmp_path / "run"
    line = refused(capsys, *command(own, model, out)[2:])  # in this process: a refusal
    assert expected in line, line
    assert not out.exists()  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks", [("gpt2", 2), ("gpt_neox", 3)])
def test_two_families_run_under_torchrun(own, tmp_path, name, ranks):
    """GPT-2 with a generator rank, GPT-NeoX with two FSDP2 trainer ranks: weight buckets named by each family's
    layers (transformer.h.N, gpt_neox.layers.N), the evaluation on the generator rank, the export."""
    tok = own[1]
    model = gpt2(tok) if name == "gpt2" else T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        **{**BASE, "vocab_size": len(tok)}, max_position_embeddings=512, eos_token_id=tok.eos_token_id))
    out = tmp_path / "run"
    cmd = torchrun_command("--standalone", f"--nproc_per_node={ranks}",
                           *command(own, saved(own, name, model), out, "--gen_ranks=1")[1:])
    p = run_command(cmd, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2] and any("pass_rate" in r for r in rows)
    assert T.AutoModelForCausalLM.from_pretrained(out / "hf").config.model_type == name
