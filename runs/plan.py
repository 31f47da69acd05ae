"""runs/plan.py: what `python scalerl.py --dry_run` prints: the run's roles, steps, token budgets and memory per GPU,
from the config alone (shapes from a cached `config.json`, or the table below for the presets' model); nothing is
loaded or downloaded.

    python scalerl.py --config=8b --dry_run                 # the paper's 8B run on 80 GPUs
    python scalerl.py --config=8b --dry_run --plan_gpus=8   # the same recipe on one 8-GPU node
"""
import os
import sys

import pipeline_rl

# Shapes of hub models a plan may name while offline (their config.json values): layers, hidden, MLP, q heads,
# kv heads, head dim, vocabulary, tied embeddings.
KNOWN_SHAPES = {"Qwen/Qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, False),
                "Qwen/Qwen3-0.6B": (28, 1024, 3072, 16, 8, 128, 151936, True),
                "Qwen/Qwen3-1.7B": (28, 2048, 6144, 16, 8, 128, 151936, True)}


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
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
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
