"""What one weight update costs under torchrun: trainer rank 0 gathers the policy in the body dtype and broadcasts it
in buckets (infra.dist.TrainerLink.push_weights), a generator rank receives each bucket and loads it into its
engine as it lands (infra.dist.receive_weights; --engine vllm: one vLLM reload for the version, its engine core a
child process), against a raw broadcast of the same bytes as one tensor between the same two processes, in the same
run. Also the generator's peak extra resident memory during an update (the goal: about one bucket, never the whole
model; the PyTorch engine only: vLLM's core is another process).

Two processes on CPU over gloo; random-init models, nothing downloaded:

    torchrun --standalone --nproc_per_node=2 bench/weight_sync.py                        # the tiny model, fp32
    torchrun --standalone --nproc_per_node=2 bench/weight_sync.py --shape Qwen/Qwen3-0.6B --dtype bfloat16
    torchrun --standalone --nproc_per_node=2 bench/weight_sync.py --engine vllm --dtype bfloat16

Prints, from rank 0: model bytes, bucket size, the median of --repeats updates on the trainer's side (until the
generator took the last bucket) and on the generator's (until its engine loaded the last: the update's cost), the raw
broadcast's median, their ratios, and the generator's peak extra memory.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import scalerl  # noqa: E402
import trainer  # noqa: E402
from infra import run  # noqa: E402
from infra.dist import TrainerLink, counter, dist_init, receive_weights  # noqa: E402
from infra.plan import KNOWN_SHAPES  # noqa: E402


def build(args):
    """(model, tokenizer, cfg): the tiny model, or a random-init Qwen3 of a known shape (a small vocabulary's worth of
    tokenizer is not needed: the engine only holds the weights)."""
    cfg = scalerl.Config(dtype=args.dtype, slots=4, sync_bucket_mb=args.bucket_mb, engine=args.engine)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    if args.shape == "tiny":
        return trainer.tiny_model(cfg, len(tok)), tok, cfg
    from transformers import Qwen3Config, Qwen3ForCausalLM
    L, H, I, nq, nkv, hd, V, tied = KNOWN_SHAPES[args.shape]
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                                        num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
                                        tie_word_embeddings=tied, max_position_embeddings=4096)), tok, cfg


def rss_mb(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=["tiny", *KNOWN_SHAPES])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--bucket_mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    job = dist_init(gen_ranks=1, timeout=600)
    model, tok, cfg = build(args)
    bucket = cfg.sync_bucket_mb << 20
    if job.rank == 0:  # the trainer: fp32 masters, weights gathered in the body dtype, bucketed broadcasts
        policy = trainer.Policy(model, 1.0, torch.float32, 0, getattr(torch, cfg.dtype))
        link = TrainerLink(job, k=1, batch_prompts=1, bucket_bytes=bucket)
        nbytes = sum(t.numel() * d.itemsize for _, t, d in policy.weights())
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            link.push_weights(policy)
            link._land()  # until the generator took the last bucket
            times.append(time.perf_counter() - t)
    else:  # the generator: an engine in the body dtype, loading each bucket as it lands
        engine, loads = run.make_engine(cfg, model, tok, seed=0), []
        del model
        base, peak = rss_mb(), 0.0
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident memory (VmHWM) to the current
        for v in range(1, args.repeats + 1):
            while counter(job, "version") < v:
                time.sleep(1e-4)  # (a longer sleep would time the poll, not the update)
            t = time.perf_counter()
            receive_weights(job, engine, v, bucket)
            loads.append(time.perf_counter() - t)
        peak = rss_mb("VmHWM") - base
    dist.barrier()
    raw = torch.empty(int(nbytes) if job.rank == 0 else 0, dtype=torch.uint8)  # the same bytes, one tensor
    size = torch.tensor([raw.numel()])
    dist.broadcast(size, src=0)
    raw = raw if job.rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    raw_times = []
    for _ in range(args.repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.broadcast(raw, src=0)
        raw_times.append(time.perf_counter() - t)
    extra = torch.tensor([peak, statistics.median(loads)] if job.rank == 1 else [0.0, 0.0], dtype=torch.float64)
    dist.all_reduce(extra)
    if job.rank == 0:
        upd, base, load = statistics.median(times), statistics.median(raw_times), float(extra[1])
        print(f"{args.shape} ({args.dtype}, {args.engine}): {nbytes / 1e6:.1f} MB of weights, {args.bucket_mb} MB "
              f"buckets | update {upd * 1e3:.1f} ms (trainer), {load * 1e3:.1f} ms with the engine's load "
              f"(generator); raw broadcast {base * 1e3:.1f} ms: x{upd / base:.2f}, x{load / base:.2f} | generator "
              f"peak extra {float(extra[0]):.1f} MB", flush=True)
    os._exit(0)  # TrainerLink's receiver thread waits for rollouts that never come


if __name__ == "__main__":
    main()
