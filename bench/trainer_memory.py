"""Activation memory of one trainer micro-batch: the measurements behind infra/plan.py's activation rows.

Builds a random-init model of a infra/plan.py KNOWN_SHAPES shape (Qwen3-0.6B by default; a transformers Qwen3Config,
nothing downloaded) with its body parameters in bfloat16, and runs one forward + backward of one micro-batch as the
trainer does: hidden states from model.model(...) with a padding mask, the LM head in FP32 through
losses.token_logprobs (head weight upcast), once without and once with activation checkpointing per decoder layer
(gradient_checkpointing_enable, use_reentrant=False). Each configuration runs in a fresh subprocess. "peak" is the
peak memory above the weights + gradients baseline (gradients are allocated first): torch.cuda.max_memory_allocated
on CUDA; on CPU the peak resident memory (Linux VmHWM, reset after set-up; ru_maxrss before/after where it cannot
be), with glibc's mmap threshold fixed at 64 KiB so that freed tensors leave the resident set at once.

    python bench/trainer_memory.py                      # 0.6B shape, 2 and 4 layers, 2 x 1024 tokens (3 minutes)
    python bench/trainer_memory.py --layers 28          # the whole 0.6B model (3.5 minutes on 2 cores)
    python bench/trainer_memory.py --shape Qwen/Qwen3-8B --layers 1,2 --vocab 1024   # an 8B layer, a small head

--batch 1 runs one unpadded sequence (no mask: sdpa's GQA path); --vocab shrinks the head to see the body alone.
Prints a row per configuration: peak MiB, KB (1e3 bytes) per token, and infra/plan.py's figure for the same peak (its
activations plus the FP32 head's weight and gradient, which the plan counts with the FSDP2 units); then the
per-layer slope, KB per token per layer, from the two smallest layer counts: the constant infra/plan.py calibrates.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from infra.plan import KNOWN_SHAPES, trainer_activations  # noqa: E402


def worker(shape, layers, batch, tokens, ckpt):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from losses import token_logprobs
    torch.set_num_threads(1)
    _, H, I, nq, nkv, hd, V, tied = shape
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy raises the peak before the baseline
    model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, hidden_size=H, intermediate_size=I, head_dim=hd,
                                         num_attention_heads=nq, num_key_value_heads=nkv, vocab_size=V,
                                         tie_word_embeddings=tied, attn_implementation="sdpa"))
    cuda = torch.cuda.is_available()
    model.to("cuda" if cuda else "cpu", torch.bfloat16).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the baseline holds weights and gradients
    ids = torch.randint(0, V, (batch, tokens // batch), generator=torch.Generator().manual_seed(0)).to(model.device)
    att = torch.ones_like(ids)
    att[-1, -1] = int(batch == 1)  # several sequences: the last one padded by a token, as in a trainer micro-batch
    if cuda:
        torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats()
        base, peak = torch.cuda.memory_allocated() / 1024, lambda: torch.cuda.max_memory_allocated() / 1024
    else:
        def peak(field="VmHWM"):  # KiB
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
        try:  # reset the peak-RSS counter (Linux >= 4.0), else the lifetime maximum before and after
            open("/proc/self/clear_refs", "w").write("5")
            base = peak("VmRSS")
        except OSError:
            base, peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, lambda: resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
    logp = token_logprobs(hidden[:, :-1], model.lm_head.weight.float(), ids[:, 1:])  # the FP32 head
    (logp * att[:, 1:]).sum().backward()
    if cuda:
        torch.cuda.synchronize()
    print(json.dumps(dict(peak_mib=(peak() - base) / 1024, seconds=time.perf_counter() - t0)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Qwen/Qwen3-0.6B", choices=list(KNOWN_SHAPES))
    p.add_argument("--layers", default="2,4", help="decoder layers, comma-separated (the whole 0.6B: 28)")
    p.add_argument("--tokens", default="2048", help="tokens per micro-batch, comma-separated")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (1: one unpadded sequence)")
    p.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (0: the shape's own)")
    p.add_argument("--worker", nargs=4, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    L, H, I, nq, nkv, hd, V, tied = KNOWN_SHAPES[a.shape]
    shape = (L, H, I, nq, nkv, hd, a.vocab or V, tied)
    if a.worker:
        return worker(shape, *a.worker[:3], bool(a.worker[3]))
    layers, tokens = [int(x) for x in a.layers.split(",")], [int(x) for x in a.tokens.split(",")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"{a.shape} shape (vocab {shape[6]:,}), bf16 body, FP32 head: peak above weights + gradients\n"
          f"{'layers':>6} {'B x T':>11} {'ckpt':>5} {'peak MiB':>9} {'KB/token':>10} {'plan MiB':>9} {'seconds':>8}")
    got = {}
    for n_layer in layers:
        for n in tokens:
            for ckpt in (False, True):
                cmd = [sys.executable, __file__, "--shape", a.shape, "--vocab", str(a.vocab),
                       "--worker", str(n_layer), str(a.batch), str(n), str(int(ckpt))]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                row = f"{n_layer:>6} {a.batch:>3} x {n // a.batch:<5} {'yes' if ckpt else 'no':>5}"
                if out.returncode:
                    print(f"{row} failed: {out.stderr.strip().splitlines()[-1:]}")
                    continue
                r = got[n_layer, n, ckpt] = json.loads(out.stdout.strip().splitlines()[-1])
                est = trainer_activations((n_layer, *shape[1:]), n, n // a.batch, ckpt, 2) + 8 * shape[6] * H
                kb = r["peak_mib"] * 2 ** 20 / n / 1e3
                print(f"{row} {r['peak_mib']:>9,.0f} {kb:>10,.1f} {est / 2 ** 20:>9,.0f} {r['seconds']:>8.1f}")
    l0, l1 = sorted(layers)[:2] if len(layers) > 1 else (None, None)
    for ckpt in (False, True) if l0 else ():  # what one more layer adds, per token
        slopes = [(got[l1, n, ckpt]["peak_mib"] - got[l0, n, ckpt]["peak_mib"]) * 2 ** 20 / n / (l1 - l0) / 1e3
                  for n in tokens if (l0, n, ckpt) in got and (l1, n, ckpt) in got]
        print(f"per layer, {'with' if ckpt else 'without'} checkpointing: {', '.join(f'{s:.1f}' for s in slopes)} "
              f"KB/token (at {', '.join(map(str, tokens))} tokens)")


if __name__ == "__main__":
    main()
