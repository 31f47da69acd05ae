"""scalerl.py: the ScaleRL recipe, top to bottom: its knobs, its presets, and the loop.

The paper's choices this run makes (sections are the paper's; each is implemented where the comment says):
  1. Loss: CISPO, truncated importance-sampling REINFORCE, eps_max 4 (Sec. 3.2; losses.py). DAPO, GRPO, GSPO by flag.
  2. Aggregation: prompt-level average of token losses (Sec. 3.2; losses.py). Sample and token averages by flag.
  3. Advantages: group mean subtracted, divided by the batch std (Sec. 3.2; losses.py). Per-prompt std or none.
  4. Zero-variance filtering: groups whose completions all got one reward leave the loss (Sec. 3.2; pipeline_rl.py).
  5. No-Positive-Resampling: prompts with pass rate >= 0.9 are retired from later epochs (Sec. 3.2; pipeline_rl.py).
  6. FP32 LM head on the generator and the trainer (Sec. 3.2, Fig. 5b; engine.py, trainer.py, losses.py).
  7. PipelineRL-k: streaming generation with in-flight weight updates, lag bounded by k (Sec. 3.1; pipeline_rl.py).
  8. Forced length interruption: thinking budget, "Okay, time is up..." and an answer budget (App. A.10; engine.py).
  9. AdamW with linear warm-up then constant LR, gradient clipping, no KL term (App. A.3; trainer.py).
 10. Progress is judged by the sigmoid fit of held-out pass rate against device-hours (Sec. 2.1; sigmoid_fit.py).
 11. Under torchrun: generator ranks and FSDP2 trainer ranks, full weights broadcast after every optimizer step
     (App. A.16: 64 generating and 16 FSDP training GPUs per run). Device-hours count every rank.

Read next: trainer.py, losses.py, pipeline_rl.py, engine.py, data.py, sigmoid_fit.py; the rest of a real run: infra/.
Run it: `python scalerl.py` (one CPU, minutes; --help lists every option); torchrun, GPUs and presets: the README.
"""
from dataclasses import dataclass
import os
import random
import sys

import numpy as np
import torch

import trainer
from infra import cli, dist, print0, run, rundir, sources


# Config: one dataclass (the recipe's knobs, then the run's options), presets as override dicts, then --key=value.
@dataclass
class Config:
    # model
    model: str = "tiny"                # "tiny" (a small Llama built in code, character tokenizer), or a hub name/path
    n_layer: int = 2                   # tiny model depth (2: the quick start in two minutes on a 2-core CPU)
    n_embd: int = 128                  # tiny model width
    n_head: int = 4                    # tiny model heads (head size n_embd/n_head = 32: vLLM CPU supports it)
    dtype: str = "float32"             # body precision on both sides: float32 | bfloat16 (trainer: fp32 masters)
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
    # off-policy pipeline
    off_policy: str = "pipeline"       # pipeline (PipelineRL-k) | ppo (PPO-off-policy-k)
    max_lag: int = 2                   # k: no trained token is more than k policy versions old
    decode_per_step: int = 12          # decode steps that overlap each optimizer step (generator/trainer speed ratio)
    # loss
    loss: str = "cispo"                # cispo | dapo | grpo | gspo | dppo (DPPO-Binary-TV; docs/metrics.md)
    eps_max: float = 4.0               # CISPO truncation cap
    eps_low: float = -1.0              # PPO/GSPO lower clip (-1: the loss's default: 0.2 dapo/grpo, 3e-3 gspo),
    eps_high: float = -1.0             # upper clip (-1: 0.28 dapo, 0.2 grpo, 5e-3 gspo); dppo: TV thresholds, 0.15
    is_correction: str = "none"        # none | tis (token: x min(rho, C)) | mis (drop a sequence: ratio off [1/C, C])
    is_cap: float = 2.0                # C of --is_correction (rho = pi_train / pi_gen)
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
    # run: where it is written, how long, how it is evaluated and kept
    out_dir: str = "out/tiny"          # run directory; default out/<preset> (a --model alone: out/hub), -s<rl_seed>
    seed: int = 0                      # seeds the task and held-out set, model init, warm start, and (rl_seed -1) RL
    rl_seed: int = -1                  # seeds RL alone (curriculum order, sampling, evaluation draws); -1: --seed.
                                       # Varying it keeps the task, held-out set and starting model: seed noise
    max_steps: int = 120               # optimizer steps of RL
    eval_every: int = 10               # held-out eval every N steps (and at step 0 and the end)
    eval_prompts: int = 96             # held-out prompts per eval (never trained on)
    eval_samples: int = 4              # completions per held-out prompt: pass rate is mean@eval_samples
    eval_share: float = 0.25           # torchrun: share of a generator's slots held-out groups may take beside rollouts
    ckpt_every: int = 50               # checkpoint every N steps (atomic) and at the end
    max_nonfinite: int = 3             # stop, checkpointing the last good weights, after N non-finite steps in a row
    resume: bool = False               # continue the run in out_dir from its checkpoint, with its own options
    eval_only: bool = False            # evaluate out_dir's checkpoint (or --model) on the held-out prompts; no training
    export: bool = False               # write out_dir's checkpoint as a Hugging Face model to out_dir/hf, then exit
    tracker: str = "none"              # also log metrics to: none | tensorboard | wandb (metrics.jsonl stays)
    # hardware: engines, memory, threads
    engine: str = "torch"              # generation engine: torch | vllm (infra/vllm_engine.py; requirements-vllm.txt)
    slots: int = 64                    # sequences decoded at once (continuous batching)
    max_prompt: int = 64               # longest prompt in tokens; longer items are skipped with a warning
    micro_batch_tokens: int = 8192     # trainer micro-batch size in tokens (gradients accumulate exactly)
    act_ckpt: bool = False             # activation checkpointing per decoder layer (recompute in backward, less memory)
    threads: int = 0                   # torch CPU threads; 0: two in one process (fewer cores: one), one per rank
    # torchrun (a plain `python scalerl.py` is one process doing everything)
    gen_ranks: int = 0                 # generator ranks (0: gen_share of the world); the others train, FSDP2 if > 1
    gen_share: float = 0.5             # generators' share of the world when gen_ranks is 0 (paper: 64 of 80 GPUs)
    dry_run: bool = False              # print the resolved plan (roles, memory per GPU, steps) and exit; loads nothing
    plan_gpus: int = 0                 # --dry_run: plan for this many GPUs (0: the torchrun world, else the paper's 80)
    dist_timeout: float = 60.0         # seconds a rank may be silent (no heartbeat) before a wait on it ends (0: 1800)
    sync_bucket_mb: int = 1024         # weight updates reach the generator ranks in buckets of at most this many MB
    gpu_memory_utilization: float = 0.9  # a vLLM generator rank's share of its GPU (KV cache: what weights leave)


# The paper's 8B run (App. A.3, A.10, A.16). The paper's model is unnamed: Qwen3-8B is a public 8B reasoning
# model with a <think> section (choice). The step count is ours too: the paper reports GPU-hours, not steps.
PAPER_8B = dict(model="Qwen/Qwen3-8B", task="polaris", n_train=60000, eval_prompts=1000, eval_samples=16,
                eval_every=100, max_steps=8000, ckpt_every=100, sft_steps=0, dtype="bfloat16", fp32_head=True,
                engine="vllm", batch_prompts=48, group_size=16, max_prompt=2048, think_min=10240, think_max=12288,
                answer_budget=2048, slots=256, off_policy="pipeline", max_lag=8, decode_per_step=0, loss="cispo",
                lr=5e-7, warmup_steps=100, adam_eps=1e-15, weight_decay=0.01, micro_batch_tokens=32768, act_ckpt=True,
                gen_share=0.8, dist_timeout=0.0)

# A hub model or path starts from these, not the tiny model's budgets (ours, not the paper's: choice): Qwen3-style
# thinking cut to what one GPU makes in minutes, an LR between the paper's 5e-7 at 8B and small models', no warm start.
HUB = dict(sft_steps=0, dtype="bfloat16", max_prompt=512, think_min=768, think_max=1024, answer_budget=256,
           batch_prompts=32, group_size=8, slots=64, lr=1e-6, warmup_steps=10, adam_eps=1e-15, max_steps=200,
           eval_every=20, ckpt_every=20, eval_prompts=256, eval_samples=4, n_train=100000, decode_per_step=0,
           micro_batch_tokens=8192, max_lag=4, plan_gpus=1)

PRESETS = {
    "tiny": {},
    "smoke": dict(max_steps=4, eval_every=2, eval_prompts=8, eval_samples=2, n_train=200, sft_steps=20,
                  batch_prompts=4, group_size=4, slots=16, ckpt_every=2),
    # the paper in miniature (runs/ablations.py): levels 7-8 outgrow the thinking budget (ceiling near 0.64,
    # data.feasible_share); 2 layers learn in ~30 steps, 300 reach 10 x C_mid; 192 prompts halve the noise
    "miniature": (MINIATURE := dict(levels="1,2,3,4,5,6,7,8", n_layer=2, lr=1.5e-4, max_steps=300, eval_prompts=192)),
    # lag 8, where the trust region against stale samples decides; a 64-72 token budget that every level fits
    "miniature_stale": {**MINIATURE, "max_lag": 8, "decode_per_step": 96},
    "miniature_long": {**MINIATURE, "think_min": 64, "think_max": 72},
    "hub": HUB,                                                              # any --model other than tiny
    "gsm8k_0.6b": {**HUB, "model": "Qwen/Qwen3-0.6B", "task": "gsm8k"},      # one GPU, grade-school math
    "math_1.7b": {**HUB, "model": "Qwen/Qwen3-1.7B", "task": "math", "think_min": 1536, "think_max": 2048,
                  "act_ckpt": True, "slots": 44},                           # fits one 80 GB GPU (--dry_run)
    "8b": PAPER_8B,                                                          # 48 x 16, 14k generation (Table 1)
    "8b_32k": {**PAPER_8B, "think_min": 26624, "think_max": 28672,          # 32k generation length (Table 1);
               "micro_batch_tokens": 40960},                                # a micro-batch holds a full sequence
    "8b_batch2048": {**PAPER_8B, "batch_prompts": 2048, "max_steps": 1200},  # the 100k GPU-hour run (Fig. 1)
}


def parse_args(argv):
    return cli.parse_args(argv, Config, PRESETS)


# The recipe: set up (one line each; infra/ keeps the bookkeeping), then one loop for one process or any trainer rank.
def main(cfg):
    if cfg.dry_run or cfg.eval_only or cfg.export:
        return run.tool(cfg)
    # the run directory checked, roles under torchrun, the checkpoint and where it resumes
    job, ckpt, resume = run.start(cfg)
    log, preempt = rundir.Log(cfg, job), rundir.Preemption()
    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    train, val, tasks = sources.load_data(cfg)
    model, tok = sources.load_model(cfg, tasks)
    # the tiny model's supervised warm start, like the paper's SFT starting point; a resumed run has its weights
    with log.timer("warm_start"):
        if cfg.model == "tiny" and not resume and job.rank == 0:
            trainer.warm_start(cfg, model, tok, os.path.dirname(os.path.normpath(cfg.out_dir)) or ".")
    # the checkpoint's weights on a resume, rank 0's on every rank, each rank's device
    run.place(cfg, job, model, ckpt, resume)
    # from here on RL's own randomness: every draw has its own generator, seeded from it
    seed = cfg.seed if cfg.rl_seed < 0 else cfg.rl_seed
    if job.rank in job.generators:
        # a generator rank's whole job; its engine holds its own copy of the weights
        rollouts = run.rollouts(cfg, job, model, tok, train, tasks, seed)
        del model
        return run.generator_rank(cfg, job, rollouts, val, resume)
    # batches: one process's engine (Scheduler), or the generator ranks' (TrainerLink); held-out evaluation
    source = run.batch_source(cfg, job, model, tok, train, tasks, seed)
    evaluate = run.Evaluator(cfg, job, model, tok, val, tasks, seed, source, log)
    policy, opt = run.policy(cfg, job, model, tok)
    step, clock = run.restore(cfg, ckpt, resume, job, policy, opt, source)
    log.open(step, clock, model, tok, train, val, tasks)
    comm = dist.TrainerComm(job)
    # a resume has its step's evaluation logged already, unless a kill tore that row
    if step == 0 and not cfg.resume:
        print0(f"step    0 | {evaluate(step, policy)} (before RL: R0)")
        rundir.save_checkpoint(cfg, step, log.clock, source, job, policy, opt)
    elif log.lost_eval:
        print0(f"step {step:4d} | {evaluate(step, policy)} (again: the row was lost)")

    # -- the loop ---------------------------------------------------------------------------------------------------
    # a stop (SIGTERM, SIGUSR1, ...: trainer rank 0's word) is read before each wait on a generator rank, then kept
    bad_run, stop, saved = 0, None, True
    while step < cfg.max_steps and not (stop := comm.share(preempt.signal)):
        log.begin(source)
        # B groups, scored; the kept ones passed the zero-variance filter (Sec. 3.2)
        batch = source.next_batch()
        with log.timer("training"):
            stats = trainer.train_step(policy, opt, batch.kept, cfg, step, comm)
        step, stop = step + 1, comm.share(preempt.signal)
        # in flight to the engine(s) (PipelineRL-k), or every k steps (PPO-off-policy-k); not once a stop is read
        with log.timer("sync_s"):
            source.push_weights(policy, publish=not stop)
        bad_run = 0 if stats["finite"] else bad_run + 1
        line = log.step(step, batch, stats, source, bad_run)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            line += " | " + evaluate(step, policy)
        print0(line, flush=True)
        saved = not stop and (step % cfg.ckpt_every == 0 or step == cfg.max_steps or bad_run >= cfg.max_nonfinite)
        # the checkpoint before any wait, so no wait loses the training (after skipped steps: the last good weights)
        if saved:
            rundir.save_checkpoint(cfg, step, log.clock, source, job, policy, opt)
        # under torchrun, then the rows of evaluations asked --eval_every steps before it or more; a later one runs on
        # beside the pipeline. A row a dead rank or a kill loses is named, and --resume reports it (docs/torchrun.md)
        evaluate.collect(until=step - cfg.eval_every + 1 if saved else 0)
        if bad_run >= cfg.max_nonfinite or stop:
            break
    # a stop's checkpoint, or the policy exported, the summary, the sigmoid fit of this run's curve (Sec. 2.1)
    run.finish(cfg, job, step, bad_run, stop, saved, source, evaluate, policy, opt, model, tok, log)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
    dist.leave()
