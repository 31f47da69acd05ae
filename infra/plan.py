"""infra/plan.py: what `python scalerl.py --dry_run` prints (docs/torchrun.md): the run's roles, steps, token budgets,
each GPU role's memory row by row with a verdict at 80 GB, and its time estimates, from the config alone (shapes from
a cached `config.json`, or the table below for the presets' model); nothing is loaded or downloaded."""
from dataclasses import replace
import functools
import inspect
import os

import losses
from infra import dist, fail

# Shapes of hub models a plan may name while offline (their config.json values): layers, hidden, MLP, q heads,
# kv heads, head dim, vocabulary, tied embeddings.
KNOWN_SHAPES = {"Qwen/Qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, False),
                "Qwen/Qwen3-0.6B": (28, 1024, 3072, 16, 8, 128, 151936, True),
                "Qwen/Qwen3-1.7B": (28, 2048, 6144, 16, 8, 128, 151936, True)}
GB, GPU_GB = 1e9, 80  # the GPUs planned for (80 GB: H100, A100)
CHUNK = inspect.signature(losses.token_logprobs).parameters["chunk"].default  # tokens per FP32-head chunk
# The time estimates (choice, until a GPU has measured the path): an H100 SXM's dense bf16 and fp32 peaks (no TF32: the
# FP32 head is true fp32 on both sides, Sec. 3.2; vLLM's VLLM_FLOAT32_MATMUL_PRECISION defaults to "highest") and HBM
# bandwidth, at a share typical of FSDP training (MFU) and of memory-bound decoding; a completion's mean length half
# its longest (the paper kept truncation under 5%).
BF16_FLOPS, FP32_FLOPS, HBM_BYTES_S, MFU, BW_UTIL, MEAN_LEN = 989e12, 67e12, 3.35e12, 0.4, 0.5, 0.5
SYNC, DEFERRED = "weight-sync buffers", "unsharded fp32 grads (deferred)"  # the last row before the total
# What only a GPU shows, until one measures it (docs/gpus.md): a CUDA context; an NCCL communicator's buffers with NVLS
# on (github.com/NVIDIA/nccl/issues/864); the allocator's fragmentation, a share of a trainer's rows (a choice, its
# segments expandable: infra.run.start); reduce-scatter bus bandwidth within a node of 8 (NVLink) and across (a 400 Gb/s
# NIC); a paused vLLM engine's reload rate (a choice: about 7 s an 8B version). FLOPs a token in the head (FP32 or not).
CUDA_CONTEXT, NCCL_COMM, FRAGMENTATION, NODE, NVLINK_BYTES_S, NIC_BYTES_S, RELOAD_BYTES_S, HEAD_FLOPS = \
    1 << 29, 1.6e9, 0.05, 8, 360e9, 45e9, 2.5e9, {True: 8, False: 6}
# Bytes a micro-batch's position hands to the device (trainer.NARROW: int32 ids, bool attention, loss mask and fresh
# flags, fp32 logprobs and weights) and holds there (int64 ids and attention, fp32 loss mask); a step's batch on a
# trainer rank's host (trainer.rollout_tensors), its completions as Python lists; a token on the wire (dist.pack)
TO_DEVICE, ON_DEVICE, HOST_BATCH, HOST_LISTS, WIRE = 15, 35, 18, 84, 12


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
    """(parameters, a decoder layer's, the root FSDP2 unit's (embeddings, final norm), body and head dtype bytes, KV
    cache bytes per token: keys and values of every layer, in the body dtype)."""
    L, H, I, nq, nkv, hd, V, tied = shape
    layer = 2 * H * nq * hd + 2 * H * nkv * hd + 3 * H * I + 2 * H  # attention, MLP, two norms
    b = 2 if cfg.dtype == "bfloat16" else 4
    P = L * layer + V * H * (1 if tied else 2) + H
    return P, layer, V * H + H, b, 4 if cfg.fp32_head else b, 2 * L * nkv * hd * b


def trainer_activations(shape, tokens, seq, ckpt, b, fp32_head=True):
    """Peak activation bytes of `tokens` tokens in sequences padded to `seq`, a body dtype of b bytes. Per token, a
    decoder layer keeps (transformers' Qwen3 layer, sdpa; counted with saved-tensor hooks) its RMSNorms' fp32 input,
    normed and output 2(4 + 2b)H, the q/k norms' (4 + b)(q + kv), sdpa's q, k, v (repeated to the q heads: a padded
    batch has a mask) and output 4bq, the MLP's gate, up, silu, product 4bI, the mask cast by sdpa b x seq; with
    checkpointing its input bH, one layer at a time recomputing all. Fitted to bench/trainer_memory.py (its figures:
    docs/measurements.md): a layer's backward working set, 3(H + I). The FP32 head (losses.token_logprobs) reuses one
    (CHUNK, V) fp32 buffer for logits and their gradient, plus the hidden states' fp32 gradient (4 + b)H; a head in
    the body dtype makes (tokens, V) fp32 logits, 3 copies."""
    L, H, I, nq, nkv, hd, V, _ = shape
    q, kv = nq * hd, nkv * hd
    layer = 2 * (4 + 2 * b) * H + (4 + b) * (q + kv) + 4 * b * q + 4 * b * I + b * seq
    body = tokens * ((L * b * H + layer if ckpt else L * layer) + 3 * (H + I) + (4 + b) * H)
    return body + (CHUNK * V * 4 if fp32_head else 3 * tokens * V * 4)


def trainer_rows(cfg, shape, T, seq, comms=0, defer=False):
    """A trainer GPU (infra.dist.shard: FSDP2 over T ranks, or over one for the mixed precision of a body below fp32),
    `comms` NCCL communicators, `defer`: dist.shard's. A longer sequence is a micro-batch of its own (micro_batches)."""
    P, layer, root, b, hb, _ = sizes(cfg, shape)
    fsdp, tokens, VH = T > 1 or b < 4, max(cfg.micro_batch_tokens, seq), shape[6] * shape[1]
    return {"parameters (fp32 master)": 4 * P / T, "gradients (fp32)": 4 * P / T,  # sharded, as AdamW's m, v
            "optimizer state (AdamW m, v)": 8 * P / T,
            # a unit computing (a decoder layer, or the root) unsharded in the body dtype, two at once (prefetch);
            # the head (its own unit, or the tied embedding upcast by token_logprobs) and its gradient, head dtype
            "unsharded units (FSDP2)": fsdp * 2 * b * max(layer, root) + (1 + fsdp) * hb * VH,
            "activations, act_ckpt on": trainer_activations(shape, tokens, seq, True, b, cfg.fp32_head),
            "activations, act_ckpt off": trainer_activations(shape, tokens, seq, False, b, cfg.fp32_head),
            # the largest unit's gradient in reduce-scatter's fp32 input and output while the next layer is gathered
            # (torch 2.13 distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_reduce, foreach_all_gather)
            "FSDP2 gather/reduce staging": fsdp * (4 * max(layer, root, VH * (not shape[7])) * (1 + 1 / T) + b * layer),
            DEFERRED: defer * 4 * P,  # every unit's gradient unsharded in fp32 until the last micro-batch
            "batch tensors (a micro-batch)": tokens * ON_DEVICE,
            "CUDA context, this process": CUDA_CONTEXT, "NCCL buffers": comms * NCCL_COMM}


def engine_rows(cfg, shape, seq):
    """An engine (infra.run.make_engine): the body dtype, an untied FP32 head in fp32; the KV cache it allocates for
    --slots full-length sequences (TorchEngine's SlotCache; VLLMEngine's kv_cache_memory_bytes, 128 more each)."""
    P, _, _, b, hb, kv = sizes(cfg, shape)
    kv_len = seq + 1 + 128 * (cfg.engine == "vllm")
    return {"engine weights": b * P + (hb - b) * shape[6] * shape[1] * (not shape[7]),
            "KV cache": cfg.slots * kv * kv_len}


@functools.lru_cache(maxsize=4)
def meta_model(tiny, shape, dtype, fp32_head):
    """A model of `shape` on the meta device, in the dtypes an engine holds it (an untied FP32 head in fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    L, H, I, nq, nkv, hd, V, tied = shape
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config((LlamaConfig if tiny else Qwen3Config)(
            vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=nq,
            num_key_value_heads=nkv, head_dim=hd, tie_word_embeddings=tied), dtype=getattr(torch, dtype))
    if fp32_head and not tied:
        model.get_output_embeddings().float()
    return model


def vllm_offshare_rows(cfg, shape):
    """What a vLLM generator rank puts on its GPU beside vLLM's share (infra.vllm_engine.outside_share)."""
    from infra.vllm_engine import outside_share
    return outside_share(meta_model(cfg.model == "tiny", shape, cfg.dtype, cfg.fp32_head), cfg.sync_bucket_mb << 20)


def bucket_bytes(cfg, shape):
    """The bytes of each weight bucket, in order (infra.dist.buckets over the parameters in the engine's dtypes)."""
    model = meta_model(cfg.model == "tiny", shape, cfg.dtype, cfg.fp32_head)
    return [sum(t.numel() * d.itemsize for _, t, d in run) for run in dist.buckets(
        ((n, p, p.dtype) for n, p in model.named_parameters()), cfg.sync_bucket_mb << 20)]


def vllm_share(cfg, shape):
    """vLLM's share of a planned GPU, as infra.vllm_engine.vllm_share computes it at start."""
    return min(cfg.gpu_memory_utilization * GPU_GB * GB, GPU_GB * GB - sum(vllm_offshare_rows(cfg, shape).values()))


def margin(cfg, rows):  # the allocator's, for the trainer's rows (an engine allocates its own once)
    trainer = {r: v for r, v in rows.items() if r not in ("engine weights", "KV cache")}
    return {**rows, "margin": FRAGMENTATION * counted(cfg, trainer)}


def columns(cfg, shape, world, T, seq, defer=None):
    """{GPU role: {row: bytes}}: one process holds the trainer and both engines (trainer.Policy.state: an fp32 body is
    not copied); under torchrun the generators evaluate, weights travel in buckets (docs/torchrun.md). `defer` None:
    the plan's choice, gradients reduce-scattered once a step where trainer rank 0 holds them unsharded too."""
    (P, _, _, b, hb, _), (_, H, I, _, _, _, V, tied) = sizes(cfg, shape), shape
    if defer is None:
        defer = T > 1 and counted(cfg, columns(cfg, shape, world, T, seq, True)["trainer 0"]) <= GPU_GB * GB
    # NCCL communicators: the trainer group's on every trainer rank, the weights group's on trainer rank 0
    train, engine = trainer_rows(cfg, shape, T, seq, T > 1, defer), engine_rows(cfg, shape, seq)
    if world == 1:
        return {"GPU 0": margin(cfg, {**train, **{k: 2 * v for k, v in engine.items()},
                                      SYNC: engine["engine weights"] * (b < 4)})}
    # trainer rank 0 packs bucket i into reused buffer i % 2, each as large as the largest it held (an untied fp32
    # head's, 2.49 GB at 8B), beside the largest tensor gathered in its dtype (that head, or an embedding or MLP)
    runs = bucket_bytes(cfg, shape)
    largest = max(V * H * (b if tied else hb), 3 * H * I * b)
    cols = {"trainer 0": margin(cfg, {**train, "NCCL buffers": (1 + (T > 1)) * NCCL_COMM,
                                      SYNC: max(runs[::2]) + max(runs[1::2] or [0]) + largest})}
    if T > 1:
        cols[f"trainer{'s 1-' if T > 2 else ' '}{T - 1}"] = margin(cfg, {**train, SYNC: 0.0})
    # the PyTorch engine receives each bucket into its parameters; a PPO-off-policy version that is not loaded, into
    # one buffer as large as the largest bucket (whole units: the fp32 head is one of its own, 2.49 GB at 8B)
    cols["generators"] = {**engine, SYNC: max(runs) * (cfg.off_policy == "ppo")}
    if cfg.engine == "vllm":
        # vLLM's share holds its weights in the body dtype and the KV cache; beside it, a row for each allocation
        # infra.vllm_engine.outside_share counts (its receive buffer among them)
        cols["generators"] = {"engine weights": b * P, "KV cache": max(0.0, vllm_share(cfg, shape) - b * P),
                              **vllm_offshare_rows(cfg, shape)}
    return cols


def defers(cfg, world, T):  # T trainer ranks reduce-scatter their gradients once a step (columns' choice)
    shape = model_shape(cfg)
    return bool(shape and T > 1 and columns(cfg, shape, world, T, seq_len(cfg))["trainer 0"][DEFERRED])


def counted(cfg, rows):
    """A column's total: every row but the activations of the --act_ckpt setting not taken (shown, not counted)."""
    return sum(v for r, v in rows.items() if r != "activations, act_ckpt " + ("off" if cfg.act_ckpt else "on"))


def seq_len(cfg):
    return cfg.max_prompt + cfg.think_max + 24 + cfg.answer_budget  # 24: the interruption phrase, generously


def fitting_gen_ranks(cfg, world, gpu_gb=GPU_GB):
    """Generator ranks for `world` GPUs of gpu_gb each: --gen_ranks or --gen_share's split, or fewer where trainer
    rank 0 (which holds the most) would not fit (0: no split fits; None: the model's shape is unknown)."""
    shape, gens = model_shape(cfg), len(dist.roles(world, cfg.gen_ranks, cfg.gen_share)[1])
    if shape is None:
        return None
    return next((g for g in range(gens, 0, -1) if counted(
        cfg, columns(cfg, shape, world, world - g, seq_len(cfg))["trainer 0"]) <= gpu_gb * GB), 0)


def timing(cfg, shape, world, T, G):
    """Estimated seconds of the work the job's waits cover (a trainer step and its head's part, one step's generation,
    the first group's, a held-out evaluation), and the completions one generator may hold at once (`flight`)."""
    (P, _, _, b, _, kv_token), (L, H, _, nq, _, hd, V, tied) = sizes(cfg, shape), shape
    BG, gen_len = cfg.batch_prompts * cfg.group_size, MEAN_LEN * (cfg.think_max + 24 + cfg.answer_budget)
    seq = MEAN_LEN * cfg.max_prompt + gen_len  # a completion's tokens, on average, and its prompt's
    # trainer: 6 FLOPs a parameter a token (8 recomputing the forward), causal attention over half the sequence, the
    # head's in its own precision: 8VH for the FP32 head (losses._FP32HeadLogprobs: the forward's logits, their
    # recomputation in the backward, the hidden states' and the weight's gradients), 6VH for autograd's
    passes = 3 + cfg.act_ckpt
    body = 2 * passes * (P - V * H * (1 + (not tied))) + passes * 4 * L * nq * hd * seq / 2
    tokens = BG * seq / T
    head = tokens * HEAD_FLOPS[cfg.fp32_head] * V * H / ((FP32_FLOPS if cfg.fp32_head else BF16_FLOPS) * MFU)
    step = tokens * body / (BF16_FLOPS * MFU) + head
    # FSDP2's reduce-scatter of the fp32 gradients, after each micro-batch or once a step: overlaps the backward
    scatter = 4 * P * (T - 1) / T / (NVLINK_BYTES_S if T <= NODE else NIC_BYTES_S)
    # a generator's engine step reads its weights and the running sequences' KV cache: memory-bound decoding
    flight = min(cfg.slots, -(-(cfg.max_lag + 1) * BG // G))
    running = flight if world > 1 else min(cfg.slots, BG)
    if world > 1 and cfg.engine == "vllm":  # as many as vLLM's KV cache holds
        running = max(1.0, min(running, (vllm_share(cfg, shape) - b * P) / (kv_token * seq)))
    weights = engine_rows(cfg, shape, 0)["engine weights"]
    tick = (weights + running * seq * kv_token) / (HBM_BYTES_S * BW_UTIL)
    # tokens a second over the generators; under torchrun an evaluation takes --eval_share of them, rollouts the rest
    rate, share = G * running / tick, cfg.eval_share
    first_group, generation = (cfg.think_max + 24 + cfg.answer_budget) * tick, BG * gen_len / (rate * (1 - share))
    return dict(step=step, head=head, tick=tick, first_group=first_group, generation=generation,
                scatter=scatter, micro_batches=-(-tokens // max(cfg.micro_batch_tokens, seq_len(cfg))),
                # the first batch: a step's generation from cold, then the tail of its longest completion
                first_batch=generation + first_group, pause=sum(bucket_bytes(cfg, shape)) / RELOAD_BYTES_S,
                # host memory: trainer rank 0's inbox holds at most what the lag bound admits, a prompt once a group
                inbox=(cfg.max_lag + 1) * BG * (gen_len + MEAN_LEN * cfg.max_prompt / cfg.group_size) * WIRE,
                batch=BG * (seq_len(cfg) * HOST_BATCH + seq * HOST_LISTS),
                evaluation=cfg.eval_prompts * cfg.eval_samples * gen_len / (rate * share), flight=flight)


def settle(cfg, world, gpu_gb=GPU_GB):
    """Trainer rank 0 at a GPU job's start (infra.run.start), as --dry_run plans it: generator ranks (0: --gen_share's
    split), --dist_timeout (0: 30 min of a rank's silence; a wait on a live rank has no time-out), and why --eval_every
    cannot hold this job, or None. A split that leaves no trainer raises ValueError."""
    shape, g = model_shape(cfg), cfg.gen_ranks or fitting_gen_ranks(cfg, world, gpu_gb) or 0
    trainers, gens = dist.roles(world, g, cfg.gen_share)
    timeout = cfg.dist_timeout or 1800.0
    t = shape and timing(cfg, shape, world, len(trainers), len(gens))
    if not t or t["evaluation"] <= (cycle := cfg.eval_every * max(t["step"], t["generation"])):
        return g, timeout, None
    return g, timeout, (f"a held-out evaluation (estimated {t['evaluation']:,.0f} s with --eval_share={cfg.eval_share} "
                        f"of {len(gens)} generators' slots) outlasts --eval_every={cfg.eval_every} steps "
                        f"({cycle:,.0f} s): evaluations would queue up; raise --eval_share or --eval_every, or lower "
                        "--eval_prompts")


def plan(cfg):
    """--dry_run: what the run would do where, and the memory it needs per GPU, without loading anything."""
    shape = model_shape(cfg)
    world = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 0)) or (1 if cfg.model == "tiny" else 80)
    # the split and time-out the run takes (infra.run.start, through settle)
    g, problem = 0, None
    try:
        if world > 1:
            g, timeout, problem = settle(cfg, world)
            cfg = replace(cfg, dist_timeout=timeout)
        trainers, gens = dist.roles(world, g, cfg.gen_share)
    except ValueError as e:
        fail(str(e))
    T, G, seq, BG = len(trainers), max(len(gens), 1), seq_len(cfg), cfg.batch_prompts * cfg.group_size
    out = [f"plan for --model={cfg.model} on {world} GPU(s): trainer ranks {trainers[0]}-{trainers[-1]} "
           f"({T}, FSDP2{' over ' + str(T) if T > 1 else ' off'}), generator ranks "
           f"{f'{gens[0]}-{gens[-1]} ({len(gens)}, engine {cfg.engine})' if gens else 'none (one process does both)'}",
           f"  steps {cfg.max_steps} x {cfg.batch_prompts} prompts x {cfg.group_size} completions = {BG} completions "
           f"per step, {cfg.max_steps * cfg.batch_prompts:,} prompts drawn from --task={cfg.task}",
           f"  sequence <= {seq:,} tokens ({cfg.max_prompt} prompt + {cfg.think_min}-{cfg.think_max} thinking, then "
           f"the interruption + {cfg.answer_budget} answer); <= {BG * seq / 1e6:.1f}M tokens per step",
           f"  {cfg.loss}, {'PipelineRL' if cfg.off_policy == 'pipeline' else 'PPO-off-policy'}-{cfg.max_lag}, "
           f"lr {cfg.lr:g} ({cfg.warmup_steps} warm-up), eps {cfg.adam_eps:g}, body {cfg.dtype}, head "
           f"{'fp32' if cfg.fp32_head else cfg.dtype}; eval every {cfg.eval_every} steps on {cfg.eval_prompts} "
           f"prompts x {cfg.eval_samples}"]
    if shape is None:
        return "\n".join(out + [f"  memory: shape of {cfg.model} unknown offline (cache its config.json to see it)"])
    (L, H, I, nq, nkv, hd, V, tied), (P, _, _, _, _, kv) = shape, sizes(cfg, shape)
    t, cols = timing(cfg, shape, world, T, G), columns(cfg, shape, world, T, seq)
    out.append(f"  model {P / 1e9:.2f}B parameters ({L} layers, hidden {H}, {nq}/{nkv} q/kv heads "
               f"x {hd}, vocab {V:,}{', tied' if tied else ''})")
    full, taken = kv * seq, f"activations, act_ckpt {'on' if cfg.act_ckpt else 'off'}"
    totals = {c: counted(cfg, rows) for c, rows in cols.items()}
    # an engine holds at least one full-length sequence
    fits = [totals[c] <= GPU_GB * GB and rows.get("KV cache", full) >= full for c, rows in cols.items()]
    unit, u = ("GB", GB) if max(totals.values()) >= 2 * GB else ("MB", 1e6)  # a CUDA context alone: MB
    out.append(f"  memory per GPU, {unit} ({GPU_GB} GB each)".ljust(40) + "".join(f"{c:>15}" for c in cols))
    for r in [*dict.fromkeys(r for rows in cols.values() for r in rows if r != SYNC), SYNC, "total"]:
        out.append(f"    {r}{' *' * (r == taken)}".ljust(40) + "".join(
            f"{(totals[c] if r == 'total' else rows[r]) / u:>15.1f}" if r in rows or r == "total" else f"{'-':>15}"
            for c, rows in cols.items()))
    out.append("    verdict".ljust(40) + "".join(f"{'fits' if f else 'does not fit':>15}" for f in fits))
    out.append(f"  * counted (--act_ckpt={cfg.act_ckpt}); micro-batches of {max(cfg.micro_batch_tokens, seq):,} tokens"
               + (f"\n    (--micro_batch_tokens={cfg.micro_batch_tokens:,} holds no full sequence: a longer one is a "
                  "micro-batch of its own)" if cfg.micro_batch_tokens < seq else "")
               + f"\n    the verdict counts a margin of {FRAGMENTATION:.0%} of a trainer's rows for the allocator")
    if T > 1:  # FSDP2's reduce-scatters: every micro-batch, or deferred to the last at the memory it takes
        deferred = counted(cfg, columns(cfg, shape, world, T, seq, True)["trainer 0"]) / GB
        out.append(f"  gradient sync: reduce-scatters of {4 * P / GB:.1f} GB every micro-batch "
                   f"({t['micro_batches']:.0f} a step, {t['scatter']:.2f} s each), or once a step\n    (trainer 0 "
                   f"{deferred:.1f} of {GPU_GB} GB): "
                   + ("once a step" if cols["trainer 0"][DEFERRED] else "every micro-batch") + ", chosen")
    if world > 1:
        out.append(f"  host memory: trainer rank 0's inbox up to {t['inbox'] / GB:.1f} GB ({WIRE} bytes a token), a "
                   f"step's batch {t['batch'] / GB:.1f} GB on each trainer rank")
    if g and not cfg.gen_ranks and g != len(dist.roles(world, 0, cfg.gen_share)[1]):
        out.append(f"  generator ranks: {g}, not --gen_share's: the most whose trainer ranks fit {GPU_GB} GB GPUs")
    elif world > 1 and not all(fits[:-1]):  # a trainer column does not fit
        g = fitting_gen_ranks(replace(cfg, gen_ranks=0), world)
        out.append(f"  the trainer ranks do not fit: --gen_ranks={g} gives {world - g} trainer ranks, which do" if g
                   else "  the trainer ranks do not fit with any split of this world: more GPUs, or a smaller "
                        "--micro_batch_tokens")
    elif world == 1 and not fits[0]:
        out.append("  GPU 0 does not fit: lower --slots or --micro_batch_tokens, or set --act_ckpt")
    out.append(f"  KV cache {full / u:.2f} {unit} per full-length sequence: " + (
        f"a generator's holds {cols['generators']['KV cache'] / full:.0f} (vLLM's share less its weights) of its "
        f"{t['flight']}\n    completions in flight; vLLM pages the cache, queues the rest; vLLM's share "
        f"{vllm_share(cfg, shape) / GB:.1f} GB\n    (--gpu_memory_utilization={cfg.gpu_memory_utilization}, less where "
        f"the rows beside it need more), {GPU_GB - totals['generators'] / GB:.2f} GB of {GPU_GB} to spare"
        if world > 1 and cfg.engine == "vllm" else f"each engine allocates --slots={cfg.slots}"))
    receive = ("receives one at a time,\n    into a buffer vLLM's engine core shares; one reload of its weights per "
               "version" if cfg.engine == "vllm" else "receives one at a time" if cfg.off_policy == "ppo"
               else "receives them into its engine's parameters")
    out.append("  weight sync: " + (f"{cfg.sync_bucket_mb:,} MB buckets, two on trainer 0 (one packed, one in flight); "
                                    f"a generator {receive}" if world > 1 else "the engines load the gathered weights"))
    if world > 1 and cfg.engine == "vllm":  # paused for a version's reload, or a version's buffer off the KV cache
        pause = t["pause"] / max(t["step"], t["generation"])
        lost = t["pause"] * RELOAD_BYTES_S / cols["generators"]["KV cache"]
        out.append(f"  vLLM paused {t['pause']:.1f} s a version ({pause:.1%} of a step), or a whole version's buffer "
                   f"({lost:.0%} of the KV cache): " + ("paused, chosen" if pause <= lost else "a buffer costs less"))
    if cfg.engine == "vllm" and cfg.interrupt:  # vLLM cannot append to a running request (infra/vllm_engine.py)
        n = cfg.max_prompt + cfg.think_max
        out.append(f"  interruption: vLLM resubmits the request with the phrase; after a weight update its up to {n:,} "
                   f"tokens are\n    prefilled again, about {2 * P * n / (BF16_FLOPS * MFU):.2f} s of a generator "
                   "each (counted: the engine's reprefill_tokens)")
    out.append(f"  time (estimated: H100 peaks at {MFU:.0%} MFU, decoding at {BW_UTIL:.0%} of HBM bandwidth, mean "
               f"completion {MEAN_LEN:.0%} of the longest):\n    trainer step {t['step']:,.0f} s, of which the "
               f"{'FP32' if cfg.fp32_head else 'LM'} head {t['head']:,.0f} s ({t['head'] / t['step']:.0%} of the "
               f"step's time, {HEAD_FLOPS[cfg.fp32_head]}VH FLOPs a token)")
    if world > 1:  # a preempted run finishes its step, then every trainer rank writes its shard (infra/rundir.py)
        want = (cfg.max_lag + 1) * BG / G  # completions the lag bound lets into a generator
        out += [f"    generation {t['generation']:,.0f} s a step over {G} generators, first group "
                f"{t['first_group']:,.0f} s, held-out evaluation {t['evaluation']:,.0f} s\n    (--eval_share="
                f"{cfg.eval_share} of the slots, interleaved with rollouts; every {cfg.eval_every} steps = "
                f"{cfg.eval_every * max(t['step'], t['generation']):,.0f} s)",
                f"    first batch {t['first_batch']:,.0f} s (a step's generation from cold, then its longest "
                "completion), which trainer ranks 1.. wait for at a gate in the store",
                f"  time-outs: a wait ends once a rank has been silent (no heartbeat) for --dist_timeout="
                f"{cfg.dist_timeout:,.0f} s, never on a live one" + (f"; refused at start: {problem}" if problem
                                                                     else ""),
                f"  preemption: a checkpoint is {12 * P / 1e9:.0f} GB (fp32 weights and AdamW's m, v), "
                f"{12 * P / T / 1e9:.1f} GB per trainer rank; give torchrun\n    --shutdown-timeout one step and "
                "that write (its default: 30 s, then SIGKILL), and\n    "
                "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 to forward SIGUSR1 (by default it kills "
                "torchrun itself)",
                # slot-bound: the lag bound lets in more than the slots hold, training groups take every slot that
                # frees but the room kept for a held-out group (infra.dist.admit); else lag-bound
                f"  generators {'slot' if want > cfg.slots else 'lag'}-bound: the lag bound lets {want:,.0f} "
                f"completions into each, {cfg.slots} slots;\n    held-out groups keep --eval_share={cfg.eval_share} "
                f"of them ({round(cfg.eval_share * cfg.slots)}): an evaluation {t['evaluation']:,.0f} s"]
    return "\n".join(out)
