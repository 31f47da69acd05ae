"""Throughput of engine.TorchEngine against `model.generate` of the same model, prompts and sampling.

The model is the tiny model at 4 layers (scalerl.Config(n_layer=4), the shape docs/measurements.md measured; the
default has 2): a 128-wide Llama with the character tokenizer, randomly initialised, or loaded from a warm-start or run
checkpoint of that shape with `--ckpt` (a run with `--n_layer=4`). The prompts are the built-in arithmetic task
rendered as in training (data.format_prompt), each asked for `--n` completions. Sampling is the same everywhere:
temperature 1, the full vocabulary, EOS stop, at most think_max + answer_budget new tokens (from Config).

What is measured, each configuration run `--repeats` times with the same seed (identical work) and the fastest kept:
  engine    TorchEngine.generate(templates, n) with `slots` sequences decoded at once (continuous batching: a
            finished sequence's slot is refilled at once), forced interruption off (the thinking budget is a hard
            stop) and on (the phrase is inserted at the budget, then the answer gets its own budget).
            tokens = engine.stats["tokens"] (sampled and forced: each forced token costs a decode slot-step too);
            forced = inserted interruption tokens among them; intr% = share of completions interrupted;
            prefill = model calls besides decode steps: prompt prefills (the prompts admitted in one step share
            one, right-padded; a group's completions share their prompt's) and interruption-phrase writes (the
            slots interrupted in one step share one); steps = decode steps; busy = busy_slot_steps / (steps *
            slots), the share of slots running (a step decodes only those: it moves them to the lowest slots).
  generate  model.generate(do_sample=True, ...) on the same prompts repeated n times, left-padded, in one batch
            ("all") and in batches of `slots`. tokens = real generated tokens only (up to and including EOS);
            prefill = batches (one prompt forward each); steps = generation steps summed over batches;
            busy = tokens / sum(rows * steps), the share of row-steps that produced a real token (the rest is
            finished rows waiting for the batch's longest).
tok/s is tokens over wall time of the whole call (prefill included); "x gen" divides it by generate(all)'s tok/s.
The two sides do not stop at the same lengths (the engine enforces the thinking budget; generate only caps the
total), so compare rates, not totals. The machine's load average is printed: other processes skew wall time.

Run: `python bench/engine.py` (one to two minutes on 2 CPU cores); `--prompts 64 --n 16 --slots 64,256` for bigger
batches, `--ckpt out/warmstart/<hash>.pt` (or a run's ckpt.pt) for a trained model's lengths, `--threads 0` for
torch's default thread count.
"""
import argparse
from dataclasses import replace
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import engine  # noqa: E402
import scalerl  # noqa: E402
import trainer  # noqa: E402
from infra.run import make_engine  # noqa: E402


def positive_ints(text):
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 32,64,128")
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return vals


def load_model(cfg, tok, ckpt):
    """The tiny default model: random init, or the weights in `ckpt` (a state dict, or a run checkpoint's "model")."""
    model = trainer.tiny_model(cfg, len(tok))
    if ckpt:
        if not os.path.isfile(ckpt):
            raise SystemExit(f"error: --ckpt {ckpt}: no such file; expected a warm-start .pt or a run's ckpt.pt")
        sd = torch.load(ckpt, map_location="cpu", weights_only=True)
        sd = sd.get("model", sd) if isinstance(sd, dict) else sd
        want = model.state_dict()
        if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
            raise SystemExit(f"error: --ckpt {ckpt} holds no state dict; expected a warm-start .pt or a run's ckpt.pt")
        missing, extra = [k for k in want if k not in sd], [k for k in sd if k not in want]
        shaped = [f"{k} {tuple(sd[k].shape)} vs {tuple(want[k].shape)}" for k in want
                  if k in sd and sd[k].shape != want[k].shape]
        if missing or extra or shaped:
            eg = (missing + extra + shaped)[0]
            raise SystemExit(f"error: --ckpt {ckpt} does not fit the benchmark's tiny model "
                             f"(scalerl.Config(n_layer=4)): {len(missing)} missing, {len(extra)} unexpected, "
                             f"{len(shaped)} misshapen tensors (first: {eg})")
        model.load_state_dict(sd)
    return model.eval()


def run_engine(model, tok, cfg, prompts, n, slots, interrupt, seed):
    """One TorchEngine.generate call (the engine a run with these settings builds); returns its figures."""
    eng = make_engine(replace(cfg, engine="torch", slots=slots, interrupt=interrupt), model, tok, seed)
    prefills, forward = [0], eng._forward

    def counting_forward(rows, tokens, pos):  # a decode step's rows are a range of slots; the other calls' a list
        prefills[0] += not isinstance(rows, range)
        return forward(rows, tokens, pos)
    eng._forward = counting_forward
    templates = [engine.Sample(i, i, p) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    groups = eng.generate(templates, n)
    dt = time.perf_counter() - t0
    st = eng.stats
    samples = [s for g in groups for s in g]
    return dict(tokens=st["tokens"], forced=sum(sum(s.forced) for s in samples), prefills=prefills[0],
                steps=st["decode_steps"], busy=st["busy_slot_steps"] / (st["decode_steps"] * slots), seconds=dt,
                completions=len(samples), interrupted=sum(s.interrupted for s in samples) / len(samples))


def run_generate(model, tok, cfg, texts, n, batch, seed):
    """model.generate over the prompts repeated n times, in left-padded batches of `batch`; returns its figures."""
    rows = [t for t in texts for _ in range(n)]  # the engine's order: a prompt's n completions side by side
    eos, max_new = tok.eos_token_id, cfg.think_max + cfg.answer_budget
    torch.manual_seed(seed)
    tokens = steps = row_steps = batches = 0
    t0 = time.perf_counter()
    for i in range(0, len(rows), batch):
        enc = tok(rows[i:i + batch], add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        gen = out[:, enc["input_ids"].shape[1]:]                       # (B, steps): EOS, then pad after it
        is_eos = gen == eos
        real = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, gen.shape[1])  # (B,) up to and with EOS
        tokens += int(real.sum())
        steps += gen.shape[1]
        row_steps += gen.numel()
        batches += 1
    dt = time.perf_counter() - t0
    return dict(tokens=tokens, forced=0, prefills=batches, steps=steps, busy=tokens / row_steps, seconds=dt,
                completions=len(rows), interrupted=None)


def best_of(repeats, fn):
    """Identical runs (same seed); the fastest one stands for the configuration (load spikes only slow things)."""
    return min((fn() for _ in range(repeats)), key=lambda r: r["seconds"])


def parse_args(description, argv, slots_help):
    """The options both engine benchmarks take, checked; sets torch's thread count."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--prompts", type=int, default=32, help="arith prompts (levels 1..5 cycle)")
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--slots", type=positive_ints, default=[32, 64, 128], help=slots_help)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest is reported")
    ap.add_argument("--ckpt", default=None, help="state dict of the 4-layer tiny model (default: random init)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for k in ("prompts", "n", "repeats"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k} must be positive, got {getattr(args, k)}")
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main(argv=None):
    args = parse_args(__doc__.splitlines()[0], argv,
                      "engine slot counts, also the model.generate batch sizes (comma-separated)")

    cfg = scalerl.Config(n_layer=4)  # the 4-layer tiny model docs/measurements.md measured (the default is 2)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    tok.padding_side = "left"  # generate appends on the right: pads must sit before the prompt
    model = load_model(cfg, tok, args.ckpt)
    texts = [data.format_prompt(p.question, tok) for p in data.arith_problems(args.prompts, seed=args.seed)]
    prompts = [data.encode(tok, t) for t in texts]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"engine benchmark | {n_params / 1e6:.2f}M params ({args.ckpt or 'random init'}) | torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s) | load average {os.getloadavg()[0]:.2f}")
    print(f"  {args.prompts} prompts x {args.n} = {args.prompts * args.n} completions | prompt "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens | think {cfg.think_min}-{cfg.think_max} + "
          f"answer {cfg.answer_budget} (generate: max_new_tokens {cfg.think_max + cfg.answer_budget}) | "
          f"interruption phrase {len(data.encode(tok, data.INTERRUPT_PHRASE))} tokens | best of {args.repeats}")

    # Warm-up: first calls pay one-time costs (kernel selection, lazy imports) that are not throughput.
    run_engine(model, tok, cfg, prompts[:2], 2, 4, True, args.seed)
    run_generate(model, tok, cfg, texts[:2], 2, 4, args.seed)

    t_start = time.time()
    rows = []
    everything = len(texts) * args.n
    gen_all = best_of(args.repeats, lambda: run_generate(model, tok, cfg, texts, args.n, everything, args.seed))
    rows.append(("generate", "all", "-", gen_all))
    for b in args.slots:
        rows.append(("generate", str(b), "-", best_of(
            args.repeats, lambda: run_generate(model, tok, cfg, texts, args.n, b, args.seed))))
    for s in args.slots:
        for interrupt in (False, True):
            rows.append(("engine", str(s), "on" if interrupt else "off", best_of(
                args.repeats, lambda: run_engine(model, tok, cfg, prompts, args.n, s, interrupt, args.seed))))

    base = gen_all["tokens"] / gen_all["seconds"]
    head = (f"{'method':<9} {'slots':>5} {'intr':>4} {'tokens':>7} {'forced':>6} {'tok/compl':>9} {'intr%':>5} "
            f"{'prefill':>7} {'steps':>6} {'busy':>5} {'s':>6} {'tok/s':>7} {'x gen':>6}")
    print(head)
    print("-" * len(head))
    for method, slots, intr, r in rows:
        rate = r["tokens"] / r["seconds"]
        ip = "-" if r["interrupted"] is None else f"{100 * r['interrupted']:.1f}"
        print(f"{method:<9} {slots:>5} {intr:>4} {r['tokens']:>7} {r['forced']:>6} "
              f"{r['tokens'] / r['completions']:>9.1f} {ip:>5} {r['prefills']:>7} {r['steps']:>6} {r['busy']:>5.2f} "
              f"{r['seconds']:>6.2f} {rate:>7.0f} {rate / base:>6.2f}")
    print(f"measured in {time.time() - t_start:.0f}s | load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
