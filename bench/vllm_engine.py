"""Throughput of infra.vllm_engine.VLLMEngine against engine.TorchEngine on the same model, prompts and sampling.

The setting of bench/engine.py: the 4-layer tiny model (random init, or `--ckpt`), the built-in arithmetic prompts
rendered as in training, `--n` completions each, temperature 1, the thinking budget and answer budget of Config, the
forced interruption off (the thinking budget is a hard stop) and on. Both engines run `generate(templates, n)` with
`slots` sequences at once. The vLLM engine is built once per slot count (its start-up is printed, not timed in the
rows) and its sampling seeds are reset before each run, so every repeat does identical work; the first run on a
fresh vLLM engine pays one-time costs and is shown apart ("first s").

Columns: tokens = engine.stats["tokens"] (sampled and forced); forced = inserted interruption tokens; intr% = share
of completions interrupted; steps = engine steps; s = wall time of the fastest run; tok/s = tokens / s; "x torch"
divides it by the torch engine's at the same slots and interruption setting. The two engines sample with different
random streams, so their lengths differ a little: compare rates. Also printed: the time of one in-flight weight load.

Needs vLLM (pip install -r requirements-vllm.txt). Run: `python bench/vllm_engine.py` (two to three minutes on
2 CPU cores); `--slots 64 --prompts 64` for one bigger configuration, `--ckpt out/warmstart/<hash>.pt` for a
trained model's lengths.
"""
from dataclasses import replace
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import scalerl  # noqa: E402
from bench import engine as bench  # noqa: E402  -- bench/engine.py: model loading and argument helpers
from engine import Sample  # noqa: E402
from infra.run import make_engine  # noqa: E402


def run(eng, prompts, n, seed):
    """One generate call on `eng` with reseeded sampling; returns its figures."""
    eng.rng.manual_seed(seed)
    eng.budget_rng.seed(seed)
    before = dict(eng.stats)
    t0 = time.perf_counter()
    groups = eng.generate([Sample(i, i, p) for i, p in enumerate(prompts)], n)
    dt = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    return dict(tokens=eng.stats["tokens"] - before["tokens"], forced=sum(sum(s.forced) for s in samples),
                steps=eng.stats["decode_steps"] - before["decode_steps"], seconds=dt,
                interrupted=sum(s.interrupted for s in samples) / len(samples))


def main(argv=None):
    args = bench.parse_args(__doc__.splitlines()[0], argv, "slot counts (comma-separated)")
    try:
        import vllm
    except ImportError as e:
        raise SystemExit(f"error: this benchmark needs vLLM ({e}); pip install -r requirements-vllm.txt")

    cfg = scalerl.Config(n_layer=4)  # the 4-layer tiny model docs/measurements.md measured (the default is 2)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    model = bench.load_model(cfg, tok, args.ckpt)
    prompts = [data.encode(tok, data.format_prompt(p.question, tok))
               for p in data.arith_problems(args.prompts, seed=args.seed)]
    print(f"vLLM engine benchmark | {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
          f"({args.ckpt or 'random init'}) | vllm {vllm.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s) | load average {os.getloadavg()[0]:.2f}")
    print(f"  {args.prompts} prompts x {args.n} = {args.prompts * args.n} completions | think {cfg.think_min}-"
          f"{cfg.think_max} + answer {cfg.answer_budget} | best of {args.repeats}")

    def make(engine, slots, interrupt):  # the engine a run with these settings builds
        return make_engine(replace(cfg, engine=engine, slots=slots, interrupt=interrupt), model, tok, args.seed)

    head = (f"{'engine':<6} {'slots':>5} {'intr':>4} {'tokens':>7} {'forced':>6} {'intr%':>5} {'steps':>6} "
            f"{'first s':>7} {'s':>6} {'tok/s':>7} {'x torch':>7}")
    rows, t_start = [], time.time()
    run(make("torch", 4, True), prompts[:2], 2, args.seed)  # warm-up of the torch side
    for slots in args.slots:
        for interrupt in (False, True):
            t0 = time.perf_counter()
            veng = make("vllm", slots, interrupt)
            start = time.perf_counter() - t0
            teng = make("torch", slots, interrupt)
            first = run(veng, prompts, args.n, args.seed)
            t = min((run(teng, prompts, args.n, args.seed) for _ in range(args.repeats)), key=lambda r: r["seconds"])
            v = min([first] + [run(veng, prompts, args.n, args.seed) for _ in range(args.repeats - 1)],
                    key=lambda r: r["seconds"])
            v["first"], t["first"] = first["seconds"], None
            t0 = time.perf_counter()
            veng.load_weights(model, 1)
            load = time.perf_counter() - t0
            rows += [("torch", slots, interrupt, t, t), ("vllm", slots, interrupt, v, t)]
            print(f"  vLLM engine with {slots} slots: start {start:.1f}s, one weight load {1000 * load:.0f} ms",
                  flush=True)
            del veng
    print(head)
    print("-" * len(head))
    for name, slots, interrupt, r, base in rows:
        rate = r["tokens"] / r["seconds"]
        first = "-" if r["first"] is None else f"{r['first']:.2f}"
        print(f"{name:<6} {slots:>5} {'on' if interrupt else 'off':>4} {r['tokens']:>7} {r['forced']:>6} "
              f"{100 * r['interrupted']:>5.1f} {r['steps']:>6} {first:>7} {r['seconds']:>6.2f} {rate:>7.0f} "
              f"{rate / (base['tokens'] / base['seconds']):>7.2f}")
    print(f"measured in {time.time() - t_start:.0f}s | load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
