"""GPU figures for one model shape, random init, nothing downloaded: the trainer step, the PyTorch engine, the
behaviour/trainer logprob gap, the weight path's one-device half, and the --dry_run memory plan against each.

The model is a transformers Qwen3 of a infra/plan.py KNOWN_SHAPES shape (or --shape L,H,I,nq,nkv,hd,V,tied), its fp32
master weights on the device, wrapped as scalerl.py wraps it in one process (infra.run.policy): trainer.Policy through
FSDP2 mixed precision over a group of one, bf16 body, FP32 head. Parts (--parts, comma-separated):
  train     trainer.train_step on --prompts x --group completions of --seq tokens (random tokens, rewards 1, 0, ...:
            every group kept), micro-batches of --micro_batch_tokens; without and with activation checkpointing. Per
            setting: trained (loss) tokens/s over --steps steps after one warm-up step; the peak allocated memory in
            the steps; the peak above weights + AdamW state + gradients per micro-batch token; and the plan's
            (infra/plan.py trainer_rows) total for the same shape, dtype and micro-batch, against the peak.
  engine    engine.TorchEngine (--slots, FP32 head, bf16 body, weights from Policy.state() as the engines load them)
            against model.generate of an all-bf16 copy, same prompts, temperature 1, the full vocabulary, at most
            --new tokens: tokens/s of each, fastest of --repeats; the engine's weights + KV cache against the plan's.
  mismatch  mean and max |logp_gen - logp_train| on the engine's sampled tokens (trainer: the FSDP2 Policy).
            Random-init logits are nearly uniform; --sharpen multiplies the final norm's weight (confident logits).
  sync      what a torchrun weight update costs apart from the network: Policy.weights() gathered and cast in
            --bucket_mb buckets into the two reused staging buffers (infra.dist.new_bucket, as trainer rank 0), each
            copied into the engine's parameters where receive_weights lands it (TorchEngine.landing); median of
            --repeats updates, GB/s of body-dtype bytes, against one device copy of the same bytes.

    python bench/gpu.py                                                # Qwen3-0.6B shape, every part
    python bench/gpu.py --shape Qwen/Qwen3-8B --parts engine,mismatch,sync   # what fits one GPU at 8B (no AdamW)
    python bench/gpu.py --device cpu --shape 2,64,128,2,2,32,512,0 --seq 96 --new 16   # a CPU twin (tests)

Prints one line per figure and, with --json PATH, writes them as a JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import losses  # noqa: E402
import scalerl  # noqa: E402
import trainer  # noqa: E402
import engine  # noqa: E402
from engine import Sample, TorchEngine  # noqa: E402
from infra import dist  # noqa: E402
from infra import plan  # noqa: E402

GB = 1e9


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def mem(dev, peak=False):
    if dev.type != "cuda":
        return 0.0
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / GB


def build(shape, dev, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    L, H, I, nq, nkv, hd, V, tied = shape
    config = Qwen3Config(num_hidden_layers=L, hidden_size=H, intermediate_size=I, num_attention_heads=nq,
                         num_key_value_heads=nkv, head_dim=hd, vocab_size=V, tie_word_embeddings=bool(tied),
                         max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):  # initialised where it lives: an 8B model in seconds, no host copy
            return Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)


def batch(a, V, seed=0):
    """--prompts groups of --group completions of --seq tokens (a quarter prompt), rewards 1, 0, 1, ... per group."""
    g = torch.Generator().manual_seed(seed)
    P, n = a.seq // 4, a.seq - a.seq // 4
    out = []
    for i in range(a.prompts):
        prompt = torch.randint(8, V, (P,), generator=g).tolist()
        out.append([Sample(i, i, prompt, tokens=torch.randint(8, V, (n,), generator=g).tolist(),
                           logprobs=[-float(torch.log(torch.tensor(V)))] * n, versions=[0] * n, forced=[False] * n,
                           reward=float(j % 2)) for j in range(a.group)])
    return out


def part_train(a, cfg, policy, shape, dev, out):
    opt = trainer.optimizer(cfg, policy)
    groups = batch(a, shape[6])
    for ckpt in (False, True):
        lm = policy.lm
        if ckpt:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        else:
            lm.gradient_checkpointing_disable()
        trainer.train_step(policy, opt, groups, cfg, 0)  # warm-up: kernels, AdamW's state
        sync(dev)
        base = mem(dev)  # fp32 masters + AdamW m, v
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t, tokens = time.perf_counter(), 0
        for step in range(a.steps):
            tokens += trainer.train_step(policy, opt, groups, cfg, step + 1)["n_tokens"]
        sync(dev)
        dt = time.perf_counter() - t
        P = sum(p.numel() for p in policy.parameters())
        peak = mem(dev, peak=True)
        rows = plan.trainer_rows(cfg, shape, 1, a.seq)
        off = f"activations, act_ckpt {'off' if ckpt else 'on'}"
        # the allocator's peak against the plan's rows that it holds (not the CUDA context, nor NCCL's buffers)
        planned = sum(v for r, v in rows.items() if r not in (off, "CUDA context, this process", "NCCL buffers")) / GB
        mb_tokens = max(cfg.micro_batch_tokens, a.seq) // a.seq * a.seq
        per_token = (peak - base - 4 * P / GB) * GB / mb_tokens / 1e3 if dev.type == "cuda" else 0.0
        key = "ckpt" if ckpt else "no_ckpt"
        out[f"train_{key}"] = dict(tok_s=tokens / dt, step_s=dt / a.steps, peak_gb=peak, base_gb=base,
                                   act_kb_per_token=per_token, plan_gb=planned,
                                   plan_act_kb_per_token=rows[f"activations, act_ckpt {'on' if ckpt else 'off'}"]
                                   / mb_tokens / 1e3)
        r = out[f"train_{key}"]
        print(f"train, act_ckpt {'on ' if ckpt else 'off'}: {r['tok_s']:,.0f} trained tok/s ({r['step_s']:.2f} s a "
              f"step of {tokens // a.steps:,} loss tokens); peak {peak:.2f} GB (plan {planned:.2f} GB, "
              f"{(planned / peak - 1) * 100 if peak else 0:+.0f}%); above weights + AdamW + gradients "
              f"{per_token:.1f} KB per micro-batch token (plan {r['plan_act_kb_per_token']:.1f})", flush=True)
    lm.gradient_checkpointing_disable()
    del opt


def engine_model(policy, shape, dev):
    """The engine's copy, loaded from Policy.state() as the engines load it: bf16 body, an untied head in fp32."""
    state = policy.state()
    gm = build(shape, dev, torch.bfloat16)
    gm.load_state_dict(state, strict=False)
    if not shape[7]:
        gm.lm_head.weight.data = state["lm_head.weight"].to(torch.float32, copy=True)  # not the master
    return gm.eval()


def part_engine(a, cfg, policy, shape, dev, out):
    V, P = shape[6], a.seq // 4
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(8, V, (P,), generator=g).tolist() for _ in range(a.slots // a.group)]
    eos, close = 2, 3  # ids a random-init model almost never samples: every completion runs to --new tokens
    gm = engine_model(policy, shape, dev)
    # model.generate on an all-bf16 copy (its head in the body dtype: generate computes the head as the model does)
    plain = build(shape, dev, torch.bfloat16).eval()
    plain.load_state_dict(gm.state_dict(), strict=False)
    ids = torch.tensor([p for p in prompts for _ in range(a.group)], device=dev)
    times = []
    for _ in range(a.repeats):
        sync(dev)
        t = time.perf_counter()
        with torch.no_grad():
            seqs = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=a.new, min_new_tokens=a.new, eos_token_id=eos,
                                  pad_token_id=0)
        sync(dev)
        times.append(time.perf_counter() - t)
    gen_tokens = (seqs.shape[1] - P) * seqs.shape[0]
    del plain, seqs
    before = mem(dev)
    eng = TorchEngine(gm, slots=a.slots, max_prompt=P, think_budget=(a.new, a.new), answer_budget=1,
                      eos_id=eos, think_close_ids=[close], head_dtype=torch.float32, seed=0)
    sync(dev)
    held = mem(dev) - before + sum(p.numel() * p.element_size() for p in gm.parameters()) / GB
    rows = plan.engine_rows(cfg, shape, P + a.new)
    planned = sum(rows.values()) / GB
    out["engine"] = dict(slots=a.slots, new=a.new, generate_tok_s=gen_tokens / min(times), engine_gb=held,
                         plan_gb=planned)
    ours = engine.decode_attention
    for attention in a.attention.split(","):  # the decode attention: the engine's, or the SDPA path it replaced
        engine.decode_attention = ours if attention == "engine" else sdpa_decode
        etimes = []
        for r in range(a.repeats):
            eng.stats["tokens"] = 0
            eng.rng.manual_seed(r)
            sync(dev)
            t = time.perf_counter()
            samples = [s for grp in eng.generate([Sample(i, r * len(prompts) + i, p) for i, p in enumerate(prompts)],
                                                 a.group) for s in grp]
            sync(dev)
            etimes.append(time.perf_counter() - t)
        out["engine"][f"engine_tok_s_{attention}"] = tok_s = eng.stats["tokens"] / min(etimes)
        print(f"engine: TorchEngine ({attention} decode attention) {tok_s:,.0f} tok/s, model.generate "
              f"{out['engine']['generate_tok_s']:,.0f} tok/s (x{tok_s / out['engine']['generate_tok_s']:.2f}; "
              f"{a.slots} sequences, {P}-token prompts, {a.new} new tokens); engine weights + KV cache {held:.2f} GB "
              f"(plan {planned:.2f} GB)", flush=True)
    engine.decode_attention = ours
    return eng, samples


def sdpa_decode(q, k, v, mask, scaling):
    """The decode attention engine.decode_attention replaced: SDPA on K and V repeated to the query heads."""
    from transformers.integrations.sdpa_attention import repeat_kv
    n = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask,
                                                            scale=scaling).transpose(1, 2)


def part_mismatch(a, policy, eng, samples, dev, out):
    """The trainer's logprobs, and the engine's own model run over each whole sequence at once (no KV cache), against
    the behaviour logprobs: the second splits the gap into decode-against-prefill kernels and the rest."""
    ids, att, tmask, gen_logp, _ = (t.to(dev) for t in trainer.rollout_tensors(samples, 0))
    gaps, own = [], []
    with torch.no_grad():
        for i in range(0, len(samples), 8):
            b, mask = slice(i, i + 8), tmask[i:i + 8].bool()
            gaps.append((policy(ids[b], att[b]) - gen_logp[b])[mask].abs().float())
            hidden = eng.model.model(input_ids=ids[b], attention_mask=att[b]).last_hidden_state
            logp = losses.head_logprobs(hidden[:, :-1], eng.model.lm_head.weight, ids[b, 1:])
            own.append((logp - gen_logp[b])[mask].abs().float())
    gap, own = torch.cat(gaps), torch.cat(own)
    out["mismatch"] = dict(mean=gap.mean().item(), max=gap.max().item(), tokens=gap.numel(), sharpen=a.sharpen,
                           mean_logp=gen_logp[tmask.bool()].mean().item(), prefill_mean=own.mean().item(),
                           prefill_max=own.max().item())
    r = out["mismatch"]
    print(f"mismatch: |logp_gen - logp_train| mean {r['mean']:.2e}, max {r['max']:.2e} over {r['tokens']:,} tokens "
          f"(mean logp {r['mean_logp']:.2f}; final norm x{a.sharpen:g}); the engine's model over whole sequences "
          f"against its decode: mean {r['prefill_mean']:.2e}, max {r['prefill_max']:.2e}", flush=True)


def part_sync(a, policy, eng, dev, out):
    want = policy.state()
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    bufs, times = {}, []
    for _ in range(a.repeats):
        for p in eng.model.parameters():
            p.data.zero_()
        sync(dev)
        t = time.perf_counter()
        for i, run in enumerate(dist.buckets(policy.weights(), a.bucket_mb << 20)):
            flat, parts = dist.new_bucket(run, dev, bufs, i % 2)
            for x, (_, w, _) in zip(parts, run):
                x.copy_(w.reshape(-1))
            eng.landing(run).copy_(flat)
        sync(dev)
        times.append(time.perf_counter() - t)
    for n, p in eng.model.named_parameters():  # every parameter arrived, cast as the engines load it
        assert torch.equal(p, want[n]), n
    del bufs
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(a.repeats):
        sync(dev)
        t = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        copies.append(time.perf_counter() - t)
    s, c = statistics.median(times), statistics.median(copies)
    out["sync"] = dict(gb=nbytes / GB, seconds=s, gb_s=nbytes / GB / s, copy_seconds=c, copy_gb_s=nbytes / GB / c,
                       bucket_mb=a.bucket_mb)
    print(f"sync: {nbytes / GB:.2f} GB in {a.bucket_mb} MB buckets, gathered, cast and loaded in {s:.3f} s "
          f"({nbytes / GB / s:.0f} GB/s); one device copy of the same bytes {c:.4f} s ({nbytes / GB / c:.0f} GB/s), "
          f"x{s / c:.1f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="Qwen/Qwen3-0.6B", help="a infra/plan.py KNOWN_SHAPES name, or L,H,I,nq,nkv,"
                    "hd,V,tied")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    ap.add_argument("--parts", default="train,engine,mismatch,sync")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per training sequence (a quarter prompt)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro_batch_tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--new", type=int, default=512, help="new tokens per completion (engine, generate)")
    ap.add_argument("--sharpen", type=float, default=1.0, help="final norm weight factor (mismatch: confident logits)")
    ap.add_argument("--attention", default="engine", help="decode attention(s) to time: engine, sdpa (the old path)")
    ap.add_argument("--bucket_mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args(argv)
    shape = plan.KNOWN_SHAPES.get(a.shape) or tuple(int(x) for x in a.shape.split(","))
    if a.layers:
        shape = (a.layers, *shape[1:])
    dev = torch.device(a.device)
    parts = a.parts.split(",")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    out = dict(device=name, torch=torch.__version__, shape=shape, parts=parts)
    print(f"{a.shape} shape {shape} on {name}, torch {torch.__version__}: bf16 body, FP32 head", flush=True)
    cfg = scalerl.Config(model=a.shape, dtype="bfloat16", fp32_head=True, micro_batch_tokens=a.micro_batch_tokens,
                         slots=a.slots, lr=1e-6, warmup_steps=0, engine="torch", sync_bucket_mb=a.bucket_mb)
    lm = build(shape, dev)
    if a.sharpen != 1:
        with torch.no_grad():
            lm.model.norm.weight *= a.sharpen
    policy = trainer.Policy(lm, 1.0, torch.float32, 0, torch.bfloat16)
    dist.shard(policy, lm.model.layers, dist.local_group(), torch.bfloat16)
    try:
        if "train" in parts:
            part_train(a, cfg, policy, shape, dev, out)
        if {"engine", "mismatch", "sync"} & set(parts):
            eng, samples = part_engine(a, cfg, policy, shape, dev, out)
            if "mismatch" in parts:
                part_mismatch(a, policy, eng, samples, dev, out)
            if "sync" in parts:
                part_sync(a, policy, eng, dev, out)
    except Exception as e:  # noqa: BLE001 -- the figures so far are still written
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if "error" in out:
        raise SystemExit(1)
    return out


if __name__ == "__main__":
    main()
