"""How far the generator's behaviour logprobs are from the trainer's on the same tokens, with a bf16 body and the FP32
head on both sides (Sec. 3.2), and what that does to GSPO's clipping on-policy (its ranges are 3e-3 / 5e-3).

Trainer numerics compared:
  autocast     fp32 master weights with the body under torch.autocast (bf16 matmuls, fp32 residual stream and
               norms): what the generator, which holds bf16 weights, does not compute
  mixed        FSDP2 mixed precision (infra.dist.shard; one process: a group of one): the body on a bf16 copy of the
               weights, as the generator holds them, the head in fp32 (what scalerl.py runs)
  fp32         everything fp32 on both sides: float round-off only (the floor)

The model is the tiny one after its warm start (cached under out/warmstart, so a trained, confident model); the
completions are sampled by the PyTorch engine from 32 held-out prompts x 8.

Run: `python bench/mismatch.py` (about a minute once the warm start is cached; `--prompts`, `--samples`).
"""
import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import losses  # noqa: E402
import pipeline_rl  # noqa: E402
import scalerl  # noqa: E402
import trainer  # noqa: E402
from infra import dist, run, sources  # noqa: E402


def sample(cfg, model, tok, val, n):
    """Completions of the held-out prompts by the engine in cfg.dtype, scored (GSPO needs advantages)."""
    engine = run.make_engine(cfg, model, tok, seed=1)
    scorer = pipeline_rl.Rollouts(engine, None, tok, cfg.max_prompt)
    groups = engine.generate(run.held_out(scorer, val), n)
    scorer.score(groups)
    return groups


@torch.no_grad()
def trainer_logprobs(model, ids, att, how):
    if how == "mixed":
        policy = trainer.Policy(copy.deepcopy(model), 1.0, torch.float32)
        dist.shard(policy, policy.lm.model.layers, dist.local_group(), torch.bfloat16)
        return policy(ids, att)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
    return losses.head_logprobs(hidden[:, :-1], model.lm_head.weight, ids[:, 1:])


def measure(groups, model, tok, how):
    samples = [s for g in groups for s in g]
    ids, att, tmask, gen_logp = trainer.rollout_tensors(samples, tok.pad_token_id)
    logp = trainer_logprobs(model, ids, att, how)
    gap = (logp - gen_logp)[tmask.bool()].abs()
    gid = torch.tensor([s.group for s in samples])
    adv = losses.group_advantages(torch.tensor([s.reward for s in samples]), gid)
    _, diag = losses.policy_loss(logp, gen_logp, adv, tmask, losses.aggregation_weights(tmask, gid, "prompt"),
                                 loss="gspo")
    return gap.mean().item(), gap.max().item(), diag["clip_frac"], int(tmask.sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = scalerl.parse_args([f"--eval_prompts={args.prompts}"])
    train, val, tasks = sources.load_data(cfg)
    model, tok = sources.load_model(cfg, tasks)
    trainer.warm_start(cfg, model, tok, "out")
    print(f"{'generator':>10} {'trainer':>9} | {'mean |dlogp|':>12} {'max |dlogp|':>11} | {'GSPO clip':>9} | tokens")
    for body, hows in (("float32", ("fp32",)), ("bfloat16", ("autocast", "mixed"))):
        cfg.dtype = body
        groups = sample(cfg, model, tok, val, args.samples)
        for how in hows:
            mean, top, clip, n = measure(groups, model, tok, how)
            print(f"{body:>10} {how:>9} | {mean:12.5f} {top:11.4f} | {clip:9.3f} | {n}")


if __name__ == "__main__":
    main()
