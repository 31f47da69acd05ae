"""The generator-trainer mismatch of each precision setting (Sec. 3.2, Fig. 5b): mean |log pi_train - log pi_gen| on
the same tokens with the same weights, where the only difference is the numerics of the two sides.

  fp32              body and head in float32 on both sides: round-off only, the floor
  bf16, fp32 head   the body in bf16 (the engine holds bf16 weights; the trainer, FSDP2 mixed precision, computes on a
                    bf16 copy of its fp32 masters), the LM head in fp32 on both sides: ScaleRL's setting
  bf16, bf16 head   the same body, the head in bf16 too

Measured on the miniature's warm start ("start") and, with --run DIR, on the weights a finished run exported (DIR/hf,
"after training"). The completions are sampled by the PyTorch engine from --prompts held-out prompts x --samples.
For scale, a run's log holds `fresh_mismatch` (the same gap on the tokens the trained weights sampled themselves,
kernels and all) and `logratio_sd` (with the lag: what the trust region acts on); docs/metrics.md.

Run: `python bench/mismatch.py [--run out/ablations/scalerl-s0]` (seconds once the warm start is cached).
"""
import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipeline_rl  # noqa: E402
import scalerl  # noqa: E402
import trainer  # noqa: E402
from infra import dist, run, sources  # noqa: E402

SETTINGS = {"fp32": ("float32", True), "bf16, fp32 head": ("bfloat16", True), "bf16, bf16 head": ("bfloat16", False)}


@torch.no_grad()
def gap(cfg, model, tok, val, samples):
    """(mean, max) |log pi_train - log pi_gen| over the sampled tokens, and their count, in cfg's precision."""
    engine = run.make_engine(cfg, model, tok, seed=1)
    groups = engine.generate(run.held_out(pipeline_rl.Rollouts(engine, None, tok, cfg.max_prompt), val), samples)
    body = getattr(torch, cfg.dtype)
    policy = trainer.Policy(copy.deepcopy(model), cfg.temperature, torch.float32 if cfg.fp32_head else body,
                            tok.pad_token_id, body)
    if body != torch.float32:  # the trainer's mixed precision, as the run computes it (infra/run.py: policy)
        dist.shard(policy, trainer.decoder_layers(policy.lm), dist.local_group(), body)
    ids, att, tmask, gen_logp, _ = trainer.rollout_tensors([s for g in groups for s in g], tok.pad_token_id)
    d = (policy(ids, att) - gen_logp)[tmask.bool()].abs()
    return d.mean().item(), d.max().item(), d.numel()


def table(args):
    """{weights: {setting: (mean, max, tokens)}} for the warm start and, with --run, the run's final weights."""
    cfg = scalerl.parse_args(["--config=miniature", f"--eval_prompts={args.prompts}"])
    train, val, tasks = sources.load_data(cfg)
    model, tok = sources.load_model(cfg, tasks)
    trainer.warm_start(cfg, model, tok, "out")
    weights = {"start": model.state_dict()}
    if args.run:
        from transformers import AutoModelForCausalLM
        weights["after training"] = AutoModelForCausalLM.from_pretrained(os.path.join(args.run, "hf"),
                                                                         dtype=torch.float32).state_dict()
    out = {}
    for when, state in weights.items():
        model.load_state_dict(state)
        for name, (dtype, fp32_head) in SETTINGS.items():
            cfg.dtype, cfg.fp32_head = dtype, fp32_head
            out.setdefault(when, {})[name] = mean, top, n = gap(cfg, model, tok, val, args.samples)
            print(f"{when:<15} {name:<16} | {mean:12.2e} {top:11.2e} | {n}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts (default 64)")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (default 8)")
    ap.add_argument("--run", help="a finished miniature run's directory: also measure its final weights (DIR/hf)")
    ap.add_argument("--json", help="also write the table here (notebooks/ablations.ipynb reads it)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"{'weights':<15} {'setting':<16} | {'mean |dlogp|':>12} {'max |dlogp|':>11} | tokens")
    out = table(args)
    if args.json:
        json.dump({when: {name: dict(mean=m, max=t, tokens=n) for name, (m, t, n) in rows.items()}
                   for when, rows in out.items()}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
