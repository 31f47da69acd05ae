"""runs/levels.py: a finished run's held-out pass rate level by level on the built-in arithmetic task, beside what the
thinking budget allows each level (data.feasible_share) and how long the thinking ran; --show L prints a few of level
L's failed completions.

    python runs/levels.py out/ablations/long_scalerl-s0 [--show 1] [--samples 8]

The run's own options (config.json), held-out set, budgets and sampling, on the weights it ended with (hf/).
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import pipeline_rl  # noqa: E402
import scalerl  # noqa: E402
from infra import cli, run, sources  # noqa: E402


def evaluate(run_dir, samples=None):
    """(config, held-out problems, their scored groups in the same order) on the run's final weights."""
    from transformers import AutoModelForCausalLM
    cfg = cli.restore_options(scalerl.Config(out_dir=run_dir), os.path.join(run_dir, "config.json"), {})
    if cfg.task != "arith":
        sys.exit(f"{run_dir}: --task={cfg.task}; levels are the built-in arithmetic task's")
    _, val, tasks = sources.load_data(cfg)
    model, tok = sources.load_model(cfg, tasks)
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "hf"),
                                                               dtype=torch.float32).state_dict())
    engine = run.make_engine(cfg, model, tok, seed=cfg.seed)
    scorer = pipeline_rl.Rollouts(engine, None, tok, cfg.max_prompt)
    groups = engine.generate(run.held_out(scorer, val), samples or cfg.eval_samples)
    scorer.score(groups)
    return cfg, tok, val, groups


def thinking(s, close):
    """Tokens the policy itself thought: up to its </think>, or to the forced interruption."""
    own = [t for t, f in zip(s.tokens, s.forced) if not f]
    return own.index(close) if close in own else len(own)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a finished run's directory (config.json, hf/)")
    ap.add_argument("--samples", type=int, help="completions per prompt (default: the run's --eval_samples)")
    ap.add_argument("--show", type=int, help="print a few failed completions of this level")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg, tok, val, groups = evaluate(args.run, args.samples)
    close = tok.convert_tokens_to_ids(data.THINK_CLOSE)
    print(f"{args.run}: thinking budget {cfg.think_min}-{cfg.think_max} tokens, {len(val)} held-out prompts x "
          f"{len(groups[0])}")
    print(f"{'level':>5} {'prompts':>7} | {'pass':>5} {'fits the budget':>15} | {'interrupted':>11} | thinking: "
          f"{'mean':>5} {'trace needs':>11}")
    for level in sorted({p.level for p in val}):
        mine = [(p, g) for p, g in zip(val, groups) if p.level == level]
        done = [s for _, g in mine for s in g]
        print(f"{level:>5} {len(mine):>7} | {np.mean([s.reward > 0 for s in done]):5.2f} "
              f"{data.feasible_share([p for p, _ in mine], (cfg.think_min, cfg.think_max)):15.2f} | "
              f"{np.mean([s.interrupted for s in done]):11.2f} | {np.mean([thinking(s, close) for s in done]):15.1f} "
              f"{np.mean([len(p.trace) + 1 for p, _ in mine]):11.1f}")
    failed = [(p, s) for p, g in zip(val, groups) if p.level == args.show for s in g if s.reward < 0]
    for p, s in failed[:8]:
        print(f"\n{p.question} = {p.answer}\n  {tok.decode(s.tokens)!r}")


if __name__ == "__main__":
    main()
