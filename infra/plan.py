"""infra/plan.py: what `python scalerl.py --dry_run` prints: the run's roles, steps, token budgets, and each GPU role's
memory row by row with a verdict at 80 GB, from the config alone (shapes from a cached `config.json`, or the table
below for the presets' model); nothing is loaded or downloaded.

    python scalerl.py --config=8b --dry_run                 # the paper's 8B run on 80 GPUs
    python scalerl.py --config=8b --dry_run --plan_gpus=8   # the same recipe on one 8-GPU node
"""
import inspect
import os
import sys

import losses
from infra import dist

# Shapes of hub models a plan may name while offline (their config.json values): layers, hidden, MLP, q heads,
# kv heads, head dim, vocabulary, tied embeddings.
KNOWN_SHAPES = {"Qwen/Qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, False),
                "Qwen/Qwen3-0.6B": (28, 1024, 3072, 16, 8, 128, 151936, True),
                "Qwen/Qwen3-1.7B": (28, 2048, 6144, 16, 8, 128, 151936, True)}
GB, GPU_GB, VLLM_SHARE = 1e9, 80, 0.9  # the GPUs planned for (80 GB: H100, A100); vLLM's gpu_memory_utilization
CHUNK = inspect.signature(losses.token_logprobs).parameters["chunk"].default  # tokens per FP32-head chunk


def model_shape(cfg):
    if cfg.model == "tiny":
        return cfg.n_layer, cfg.n_embd, 3 * cfg.n_embd, cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head, 40, False
    try:
        from transformers import AutoConfig
        c = AutoConfig.from_pretrained(cfg.model, local_files_only=True)  # never downloads
        return (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, c.vocab_size,
                c.tie_word_embeddings)
    except Exception:  # noqa: BLE001 -- offline and not cached: the built-in table, or no memory figures
        return KNOWN_SHAPES.get(cfg.model)


def sizes(cfg, shape):
    """(parameters, a decoder layer's, the root FSDP2 unit's (embeddings, final norm), body and head dtype bytes)."""
    L, H, I, nq, nkv, hd, V, tied = shape
    layer = 2 * H * nq * hd + 2 * H * nkv * hd + 3 * H * I + 2 * H  # attention, MLP, two norms
    b = 2 if cfg.dtype == "bfloat16" else 4
    return L * layer + V * H * (1 if tied else 2) + H, layer, V * H + H, b, 4 if cfg.fp32_head else b


def trainer_activations(shape, tokens, seq, ckpt, b, fp32_head=True):
    """Peak activation bytes of `tokens` tokens in sequences padded to `seq`, a body dtype of b bytes. Per token, a
    decoder layer keeps (transformers' Qwen3 layer, sdpa; counted with saved-tensor hooks) its RMSNorms' fp32 input,
    normed and output 2(4 + 2b)H, the q/k norms' (4 + b)(q + kv), sdpa's q, k, v (repeated to the q heads: a padded
    batch has a mask) and output 4bq, the MLP's gate, up, silu, product 4bI, the mask cast by sdpa b x seq; with
    checkpointing its input bH, one layer at a time recomputing all. bench/trainer_memory.py per layer, 8B shape:
    229-230 KB measured, 228-229 here, 8.0-8.2 checkpointed, 8.2 here. Fitted to it: a layer's backward working set,
    3(H + I). The FP32 head (losses.token_logprobs) reuses one (CHUNK, V) fp32 buffer for logits and their gradient,
    plus the hidden states' fp32 gradient (4 + b)H; a head in the body dtype makes (tokens, V) fp32 logits, 3 copies.
    The whole 0.6B model, 2 x 1024 tokens, with the head's fp32 weight and gradient: 6,109 / 1,956 MiB measured
    without / with checkpointing, 6,072 / 2,080 here (tests/test_plan.py)."""
    L, H, I, nq, nkv, hd, V, _ = shape
    q, kv = nq * hd, nkv * hd
    layer = 2 * (4 + 2 * b) * H + (4 + b) * (q + kv) + 4 * b * q + 4 * b * I + b * seq
    body = tokens * ((L * b * H + layer if ckpt else L * layer) + 3 * (H + I) + (4 + b) * H)
    return body + (CHUNK * V * 4 if fp32_head else 3 * tokens * V * 4)


def kv_token(cfg, shape):
    """KV cache bytes per token: keys and values of every layer, in the body dtype."""
    return 2 * shape[0] * shape[4] * shape[5] * sizes(cfg, shape)[3]


def trainer_rows(cfg, shape, T, seq):
    """A trainer GPU (infra.dist.shard: FSDP2 over T ranks, or over one for the mixed precision of a body below fp32).
    A sequence longer than the micro-batch is a micro-batch of its own (trainer.micro_batches)."""
    P, layer, root, b, hb = sizes(cfg, shape)
    fsdp, tokens, VH = T > 1 or b < 4, max(cfg.micro_batch_tokens, seq), shape[6] * shape[1]
    return {"parameters (fp32 master)": 4 * P / T, "gradients (fp32)": 4 * P / T,  # sharded, as AdamW's m, v
            "optimizer state (AdamW m, v)": 8 * P / T,
            # a unit computing (a decoder layer, or the root) unsharded in the body dtype, two at once (prefetch);
            # the head (its own unit, or the tied embedding upcast by token_logprobs) and its gradient, head dtype
            "unsharded units (FSDP2)": fsdp * 2 * b * max(layer, root) + (1 + fsdp) * hb * VH,
            "activations, act_ckpt on": trainer_activations(shape, tokens, seq, True, b, cfg.fp32_head),
            "activations, act_ckpt off": trainer_activations(shape, tokens, seq, False, b, cfg.fp32_head)}


def engine_rows(cfg, shape, seq):
    """An engine (infra.run.make_engine): the body dtype, an untied FP32 head in fp32; the KV cache it allocates for
    --slots full-length sequences (TorchEngine's SlotCache; VLLMEngine's kv_cache_memory_bytes, 128 more each)."""
    P, _, _, b, hb = sizes(cfg, shape)
    kv_len = seq + 1 + 128 * (cfg.engine == "vllm")
    return {"engine weights": b * P + (hb - b) * shape[6] * shape[1] * (not shape[7]),
            "KV cache": cfg.slots * kv_token(cfg, shape) * kv_len}


def sync_rows(cfg, shape, world):
    """Weight-sync buffers as built. In one process the engines load the trainer's weights (trainer.Policy.state, as
    the engines hold them; an fp32 body is not copied). Under torchrun trainer rank 0 casts the weights into two
    reused --sync_bucket_mb buffers, one in flight while the other is packed, beside one FSDP2-gathered parameter; a
    generator's PyTorch engine receives each bucket straight into its parameters, vLLM (and a PPO-off-policy version
    that is not loaded) into one reused bucket buffer (infra.dist.receive_weights)."""
    P, _, _, b, hb = sizes(cfg, shape)
    model = engine_rows(cfg, shape, 0)["engine weights"]
    if world == 1:
        return {"trainer 0": {"weight-sync buffers": model * (b < 4)}, "generator": {"weight-sync buffers": 0.0}}
    bucket = min(cfg.sync_bucket_mb * 2 ** 20, model)
    largest = max(shape[6] * shape[1], 3 * shape[1] * shape[2]) * b  # a gathered embedding, or a layer's MLP
    return {"trainer 0": {"weight-sync buffers": 2 * bucket + largest},
            # a bucket holds whole units: the head (fp32 when untied, 2.49 GB at 8B) is one of its own; vLLM takes
            # each from a fresh copy on the GPU (infra/vllm_engine.ipc_bucket), beside the receive buffer
            "generator": {"weight-sync buffers": max(bucket, shape[6] * shape[1] * (b if shape[7] else hb)) * (
                2 if cfg.engine == "vllm" else cfg.off_policy == "ppo")}}


def vllm_offshare_rows(cfg, shape):
    """What a vLLM generator rank puts on its GPU beside vLLM's share (infra.vllm_engine.outside_share), for a model
    of `shape` built on the meta device in the dtypes the engine holds (infra.run.make_engine)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    from infra.vllm_engine import outside_share
    L, H, I, nq, nkv, hd, V, tied = shape
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config((LlamaConfig if cfg.model == "tiny" else Qwen3Config)(
            vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=nq,
            num_key_value_heads=nkv, head_dim=hd, tie_word_embeddings=tied), dtype=getattr(torch, cfg.dtype))
    if cfg.fp32_head and not tied:
        model.get_output_embeddings().float()
    return outside_share(model, cfg.sync_bucket_mb << 20)


def columns(cfg, shape, world, T, seq):
    """{GPU role: {row: bytes}}. One process holds the trainer, the rollout engine and the evaluation engine; under
    torchrun the generators evaluate, and vLLM takes what is left of its gpu_memory_utilization for the KV cache."""
    train, engine = trainer_rows(cfg, shape, T, seq), engine_rows(cfg, shape, seq)
    sync = sync_rows(cfg, shape, world)
    if world == 1:
        return {"GPU 0": {**train, **{k: 2 * v for k, v in engine.items()}, **sync["trainer 0"]}}
    cols = {"trainer 0": {**train, **sync["trainer 0"]}}
    if T > 1:
        cols[f"trainer{'s 1-' if T > 2 else ' '}{T - 1}"] = {**train, "weight-sync buffers": 0.0}
    cols["generators"] = {**engine, **sync["generator"]}
    if cfg.engine == "vllm":
        # vLLM's share holds its weights in the body dtype and the KV cache; outside it: an untied head made fp32 after
        # (infra/vllm_engine.fp32_head_in_worker), the generator process's receive buffer and its CUDA context
        # (vllm_share leaves 1 GiB and that head of what is free)
        P, _, _, b, _ = sizes(cfg, shape)
        cols["generators"]["KV cache"] = max(0.0, VLLM_SHARE * GPU_GB * GB - b * P)
        cols["generators"]["CUDA context"] = 0.5 * GB
    return cols


def trainers_fit(cfg, shape, world, T, seq, gpu_gb=GPU_GB):
    """Whether every trainer GPU's total fits gpu_gb with T trainer ranks."""
    off = "activations, act_ckpt " + ("off" if cfg.act_ckpt else "on")
    return all(sum(v for r, v in rows.items() if r != off) <= gpu_gb * GB
               for c, rows in columns(cfg, shape, world, T, seq).items() if c.startswith("trainer"))


def seq_len(cfg):
    return cfg.max_prompt + cfg.think_max + 24 + cfg.answer_budget  # 24: the interruption phrase, generously


def fitting_gen_ranks(cfg, world, gpu_gb=GPU_GB):
    """Generator ranks for `world` GPUs of gpu_gb each: --gen_ranks, or --gen_share's split, or fewer generators
    where the trainer ranks would not fit beside them (0: no split fits; None: the model's shape is unknown)."""
    shape, gens = model_shape(cfg), len(dist.roles(world, cfg.gen_ranks, cfg.gen_share)[1])
    if shape is None:
        return None
    return next((g for g in range(gens, 0, -1) if trainers_fit(cfg, shape, world, world - g, seq_len(cfg), gpu_gb)), 0)


def memory_lines(cfg, shape, world, T, seq, flight):
    """The table: a row per use, a column per role, the total and the verdict at GPU_GB; then what it assumes."""
    cols, ckpt = columns(cfg, shape, world, T, seq), cfg.act_ckpt
    off = "activations, act_ckpt " + ("off" if ckpt else "on")  # shown, not counted
    full = kv_token(cfg, shape) * seq  # a full-length sequence's KV cache
    totals = {c: sum(v for r, v in rows.items() if r != off) for c, rows in cols.items()}
    fits = [totals[c] <= GPU_GB * GB and rows.get("KV cache", full) >= full for c, rows in cols.items()]  # + 1 seq
    unit, u = ("GB", GB) if max(totals.values()) >= GB else ("MB", 1e6)
    out = [f"  memory per GPU, {unit} ({GPU_GB} GB each)".ljust(40) + "".join(f"{c:>15}" for c in cols)]
    sync = "weight-sync buffers"  # the last row before the total
    for r in [*dict.fromkeys(r for rows in cols.values() for r in rows if r != sync), sync, "total"]:
        out.append(f"    {r}{' *' * (r.startswith('activations') and r != off)}".ljust(40) + "".join(
            f"{(totals[c] if r == 'total' else rows[r]) / u:>15.1f}" if r in rows or r == "total" else f"{'-':>15}"
            for c, rows in cols.items()))
    kv = cols[list(cols)[-1]]["KV cache"]
    one_bucket = cfg.engine == "vllm" or cfg.off_policy == "ppo"
    return out + [
        "    verdict".ljust(40) + "".join(f"{'fits' if f else 'does not fit':>15}" for f in fits),
        f"  * counted (--act_ckpt={ckpt}); micro-batches of {max(cfg.micro_batch_tokens, seq):,} tokens" + (
            f"\n    (--micro_batch_tokens={cfg.micro_batch_tokens:,} holds no full sequence: a longer one is a "
            "micro-batch of its own)" if cfg.micro_batch_tokens < seq else ""),
        f"  KV cache {full / u:.2f} {unit} per full-length sequence: " + (
            f"a generator's holds {kv / full:.0f} (vLLM's {VLLM_SHARE:.0%} less its weights) of its "
            f"{flight}\n    completions in flight; vLLM pages the cache, queues the rest" if world > 1 and
            cfg.engine == "vllm" else f"each engine allocates --slots={cfg.slots}"),
        "  weight sync: " + (f"{cfg.sync_bucket_mb:,} MB buckets, two on trainer 0 (one packed, one in flight); a "
                              "generator " + ("receives one at a time,\n    and copies it to hand it to vLLM"
                                              if cfg.engine == "vllm" else "receives one at a time" if one_bucket
                                              else "receives them into its engine's parameters")
                              if world > 1 else "the engines load the gathered weights")]


def plan(cfg):
    """--dry_run: what the run would do where, and the memory it needs per GPU, without loading anything."""
    shape = model_shape(cfg)
    world = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 0)) or (1 if cfg.model == "tiny" else 80)
    try:
        trainers, gens = dist.roles(world, cfg.gen_ranks, cfg.gen_share) if world > 1 else ([0], [])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    T, G_ = len(trainers), max(len(gens), 1)
    seq = seq_len(cfg)
    BG = cfg.batch_prompts * cfg.group_size
    out = [f"plan for --model={cfg.model} on {world} GPU(s): trainer ranks {trainers[0]}-{trainers[-1]} "
           f"({T}, FSDP2{' over ' + str(T) if T > 1 else ' off'}), generator ranks "
           f"{f'{gens[0]}-{gens[-1]} ({len(gens)}, engine {cfg.engine})' if gens else 'none (one process does both)'}",
           f"  steps {cfg.max_steps} x {cfg.batch_prompts} prompts x {cfg.group_size} completions = {BG} completions "
           f"per step, {cfg.max_steps * cfg.batch_prompts:,} prompts drawn from --task={cfg.task}",
           f"  sequence <= {seq:,} tokens ({cfg.max_prompt} prompt + {cfg.think_min}-{cfg.think_max} thinking, then "
           f"the "
           f"interruption + {cfg.answer_budget} answer); <= {BG * seq / 1e6:.1f}M tokens per step",
           f"  {cfg.loss}, {'PipelineRL' if cfg.off_policy == 'pipeline' else 'PPO-off-policy'}-{cfg.max_lag}, "
           f"lr {cfg.lr:g} ({cfg.warmup_steps} warm-up), eps {cfg.adam_eps:g}, body {cfg.dtype}, head "
           f"{'fp32' if cfg.fp32_head else cfg.dtype}; eval every {cfg.eval_every} steps on {cfg.eval_prompts} "
           f"prompts x {cfg.eval_samples}"]
    if shape is None:
        return "\n".join(out + [f"  memory: shape of {cfg.model} unknown offline (cache its config.json to see it)"])
    L, H, I, nq, nkv, hd, V, tied = shape
    flight = min(cfg.slots, -(-(cfg.max_lag + 1) * BG // G_))  # completions one generator may hold at once
    P = sizes(cfg, shape)[0]
    out.append(f"  model {P / 1e9:.2f}B parameters ({L} layers, hidden {H}, {nq}/{nkv} q/kv heads "
               f"x {hd}, vocab {V:,}{', tied' if tied else ''})")
    out += memory_lines(cfg, shape, world, T, seq, flight)
    if world > 1:  # a preempted run finishes its step, then every trainer rank writes its shard (infra/rundir.py)
        out.append(f"  preemption: a checkpoint is {12 * P / 1e9:.0f} GB (fp32 weights and AdamW's m, v), "
                   f"{12 * P / T / 1e9:.1f} GB per trainer rank; give torchrun\n    --shutdown-timeout one step and "
                   "that write (its default: 30 s, then SIGKILL), and\n    "
                   "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 to forward SIGUSR1 (by default it kills "
                   "torchrun itself)")
    if world > 1 and not trainers_fit(cfg, shape, world, T, seq):  # fewer generators, more trainer ranks to shard
        g = fitting_gen_ranks(cfg, world)
        out.append(f"  the trainer ranks do not fit: --gen_ranks={g} gives {world - g} trainer ranks, which do" if g
                   else "  the trainer ranks do not fit with any split of this world: more GPUs, or a smaller "
                        "--micro_batch_tokens")
    return "\n".join(out)
