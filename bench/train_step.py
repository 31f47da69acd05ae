"""Trained tokens/s of one optimizer step (trainer.train_step) on the default run's batches, by thread count.

The batches are real: the tiny model at 4 layers (scalerl.Config(n_layer=4), the shape docs/measurements.md measured;
random init, or a warm-start or run checkpoint of that shape with `--ckpt`) generates 16 prompts x 8 completions of the
built-in task per batch with the PyTorch engine and the default budgets. Every group gets rewards 1, 0, 1, 0, ... so
every group is kept (the most work a batch can hold). Each thread count trains a fresh copy of the model on the same
batches, `--steps` steps after one warm-up step; tokens/s is the batches' completion tokens over the steps' wall time,
as the progress line's `train ... tok/s`.

Run: `python bench/train_step.py` (about a minute on 2 CPU cores); `--threads 1,2` is the default.
"""
import argparse
import copy
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
from bench.engine import load_model, positive_ints  # noqa: E402
from infra import dist, run  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=positive_ints, default=[1, 2], help="torch CPU thread counts (comma-separated)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per thread count")
    ap.add_argument("--ckpt", default=None, help="state dict of the 4-layer tiny model (default: random init)")
    args = ap.parse_args(argv)
    if args.steps <= 0:
        ap.error(f"--steps must be positive, got {args.steps}")
    cfg = scalerl.Config(n_layer=4)  # the 4-layer tiny model docs/measurements.md measured (the default is 2)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    model = load_model(cfg, tok, args.ckpt).train()
    torch.set_num_threads(1)
    eng = run.make_engine(replace(cfg, engine="torch"), model, tok, seed=0)
    problems = data.arith_problems(cfg.batch_prompts * (args.steps + 1), seed=0)
    batches = []
    for b in range(args.steps + 1):
        chunk = problems[b * cfg.batch_prompts:(b + 1) * cfg.batch_prompts]
        templates = [engine.Sample(p.id, b * cfg.batch_prompts + i, data.encode(tok, data.format_prompt(
            p.question, tok))) for i, p in enumerate(chunk)]
        groups = eng.generate(templates, cfg.group_size)
        for g in groups:
            for i, s in enumerate(g):
                s.reward = float(i % 2)
        batches.append(groups)
    n_tokens = sum(len(s.tokens) for g in batches[1] for s in g)
    print(f"trainer benchmark | {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
          f"({args.ckpt or 'random init'}) | {cfg.batch_prompts} x {cfg.group_size} completions per step, "
          f"{n_tokens / (cfg.batch_prompts * cfg.group_size):.1f} tokens each | loss {cfg.loss}, {cfg.dtype} | "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'threads':>7} {'steps':>5} {'tokens':>7} {'s':>6} {'tok/s':>7}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        policy, opt = run.policy(cfg, dist.Dist(), copy.deepcopy(model), tok)  # as a run builds
        trainer.train_step(policy, opt, batches[0], cfg, 0)  # warm-up: first-call costs are not throughput
        t0, tokens = time.perf_counter(), 0
        for step, groups in enumerate(batches[1:], 1):
            tokens += trainer.train_step(policy, opt, groups, cfg, step)["n_tokens"]
        dt = time.perf_counter() - t0
        print(f"{threads:>7} {args.steps:>5} {tokens:>7} {dt:>6.2f} {tokens / dt:>7.0f}")
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
