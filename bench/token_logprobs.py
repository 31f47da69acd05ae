"""Memory and time of losses.token_logprobs (the chunked FP32 LM head) against the naive full-logits path.

One 16,384-token sequence (the paper's generation budget, App. A.10), a 151,936-token vocabulary, hidden size
64, on CPU. Each figure comes from a fresh subprocess: after the inputs exist, the process's peak resident
memory (Linux VmHWM) is reset, the variant runs once, and "peak extra" is the new peak minus the resident
memory at the reset. That is everything torch allocated on top of the inputs (logits buffers, saved tensors, gradients).

Variants:
  chunked          token_logprobs (custom autograd: forward keeps one log-normaliser per token, backward
                   recomputes each chunk's logits)
  checkpoint       per-chunk torch.utils.checkpoint around plain log_softmax + gather (the alternative)
  naive            float32 logits for all tokens at once, log_softmax, gather

Modes: "fwd" runs under no_grad (the generator's use); "fwd+bwd" backprops into hidden and head weight
(the trainer's use). The naive path needs ~10 GiB per (16k, 152k) float32 tensor, so by default it runs on
a 2,048-token sequence and the 16k figure is extrapolated (memory is linear in tokens).

Run: `python bench/token_logprobs.py` (a few minutes on 2 cores); `--naive` also runs the naive path on the
full sequence (needs over 20 GiB free); `--tokens`, `--vocab`, `--hidden`, `--chunk` change the shape.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def worker(variant, mode, tokens, vocab, hidden, chunk):
    """Run one variant once in this (fresh) process; print JSON with peak extra MiB and seconds."""
    import torch
    import torch.utils.checkpoint

    sys.path.insert(0, ROOT)
    from losses import token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_(mode == "fwd+bwd")
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).requires_grad_(mode == "fwd+bwd")
    y = torch.randint(0, vocab, (1, tokens), generator=g)

    def naive(h, w, y):
        return torch.log_softmax(h.float() @ w.float().T, -1).gather(-1, y[..., None])[..., 0]

    def run():
        if variant == "chunked":
            return token_logprobs(h, w, y, chunk=chunk)
        if variant == "checkpoint":
            parts = [torch.utils.checkpoint.checkpoint(naive, h[:, i:i + chunk], w, y[:, i:i + chunk],
                                                       use_reentrant=False)
                     if mode == "fwd+bwd" else naive(h[:, i:i + chunk], w, y[:, i:i + chunk])
                     for i in range(0, tokens, chunk)]
            return torch.cat(parts, 1)
        return naive(h, w, y)

    try:  # reset the peak-RSS counter (Linux >= 4.0); otherwise fall back to the lifetime maximum
        open("/proc/self/clear_refs", "w").write("5")
        base, peak = rss_kib("VmRSS"), lambda: rss_kib("VmHWM")
    except OSError:
        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        base = peak()
    t0 = time.perf_counter()
    if mode == "fwd":
        with torch.no_grad():
            lp = run()
    else:
        lp = run()
        lp.sum().backward()
    dt = time.perf_counter() - t0
    print(json.dumps({"peak_extra_mib": (peak() - base) / 1024, "seconds": dt, "check": float(lp.detach().sum())}))


def measure(variant, mode, tokens, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, mode, str(tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return None, f"failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--short", type=int, default=2048, help="tokens for the naive path unless --naive")
    p.add_argument("--naive", action="store_true", help="run the naive path on the full sequence too")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        variant, mode, tokens = args.worker
        return worker(variant, mode, int(tokens), args.vocab, args.hidden, args.chunk)

    full_logits = args.tokens * args.vocab * 4 / 2 ** 30
    print(f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk}; "
          f"one full float32 logits tensor = {full_logits:.2f} GiB, one chunk = "
          f"{args.chunk * args.vocab * 4 / 2 ** 20:.0f} MiB")
    print(f"{'variant':<16} {'mode':<8} {'tokens':>6} {'peak extra MiB':>15} {'seconds':>8}  at {args.tokens} tokens")
    runs = [(v, args.tokens) for v in ("chunked", "checkpoint")]
    runs += [("naive", args.short)] + ([("naive", args.tokens)] if args.naive else [])
    for variant, tokens in runs:
        for mode in ("fwd", "fwd+bwd"):
            r, err = measure(variant, mode, tokens, args)
            if r is None:
                print(f"{variant:<16} {mode:<8} {tokens:>6} {err}")
                continue
            note = ""
            if tokens != args.tokens:  # memory and time are linear in tokens
                k = args.tokens / tokens
                note = f"  -> ~{r['peak_extra_mib'] * k:,.0f} MiB, ~{r['seconds'] * k:.1f} s extrapolated"
            print(f"{variant:<16} {mode:<8} {tokens:>6} {r['peak_extra_mib']:>15,.0f} {r['seconds']:>8.2f}{note}")


if __name__ == "__main__":
    main()
