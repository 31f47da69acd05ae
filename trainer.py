"""trainer.py: the training side of ScaleRL, one optimizer step at a time. The paper's choices made here:
  1. `rollout_tensors`: the generator's logprobs for the ratio (Sec. 3.1); forced tokens out of the loss (App. A.10).
  2. `Policy`: the body in its dtype, the LM head in FP32 (Sec. 3.2, Fig. 5b); logprobs after the temperature.
  3. `policy_gradient`: the RL loss (losses.py; CISPO by default, Sec. 3.2) over micro-batches that add up exactly.
  4. `train_step`: AdamW with linear warm-up and gradient clipping, no KL term (App. A.3); a non-finite step is skipped.
  5. `warm_start`: the tiny model's cached supervised warm start (the paper starts RL from an SFT model).
"""
import contextlib
import hashlib
import json
import math
import os
import random
import time

import torch

import data
import losses

# part of the warm start cache's key: raise it when the warm start's recipe changes
WARM_START_VERSION = 1


def sequence_batch(seqs, starts, pad_id, dtypes=(torch.long, torch.long, torch.float)):
    """Right-padded (N, L) ids, (N, L) attention mask, and the (N, L-1) mask of trainable target positions (dtypes)."""
    L = max(len(s) for s in seqs)
    ids, att = torch.full((len(seqs), L), pad_id, dtype=dtypes[0]), torch.zeros(len(seqs), L, dtype=dtypes[1])
    for i, s in enumerate(seqs):
        ids[i, :len(s)], att[i, :len(s)] = torch.tensor(s), 1
    tmask = (torch.arange(1, L)[None] >= torch.tensor(starts)[:, None]) & att[:, 1:].bool()
    return ids, att, tmask.to(dtypes[2])


# the narrowest dtypes of ids, attention and loss masks, versions: policy_gradient keeps the batch on the host in them
NARROW = (torch.int32, torch.bool, torch.bool, torch.int32)


def rollout_tensors(samples, pad_id, dtypes=(torch.long, torch.long, torch.float, torch.long)):
    """Trainer tensors for completions: ids/att (N, L); the loss mask, behaviour logprobs and the policy version that
    sampled each token (-1 off the completion) (N, L-1), aligned with the target positions. Forced interruption
    tokens stay in the context but are masked out of the loss (App. A.10)."""
    ids, att, tmask = sequence_batch([s.prompt_tokens + s.tokens for s in samples],
                                     [len(s.prompt_tokens) for s in samples], pad_id, dtypes[:3])
    gen_logp, versions = torch.zeros(tmask.shape), torch.full(tmask.shape, -1, dtype=dtypes[3])
    for i, s in enumerate(samples):
        P, n = len(s.prompt_tokens), len(s.tokens)
        gen_logp[i, P - 1:P - 1 + n], versions[i, P - 1:P - 1 + n] = torch.tensor(s.logprobs), torch.tensor(s.versions)
        tmask[i, P - 1:P - 1 + n] *= ~torch.tensor(s.forced, dtype=torch.bool)
    return ids, att, tmask, gen_logp, versions


class Head(torch.nn.Module):
    """The model's own LM head as a module (untied: its own FSDP2 unit), in `dtype`, with its bias, scale and soft cap
    (losses.head_finish): logprobs (N, T) of `targets` (Sec. 3.2)."""
    def __init__(self, linear, temperature, dtype, config):
        super().__init__()
        self.linear, self.temperature, self.dtype, self.finish = linear, temperature, dtype, losses.head_finish(config)

    def forward(self, hidden, targets):
        out = losses.head_logprobs(hidden, self.linear.weight, targets, self.temperature, self.dtype, self.linear.bias,
                                   *self.finish)
        return out.clone()  # not a view: FSDP2 hooks its backward onto the output


class Policy(torch.nn.Module):
    """The trainer's forward as one module call (FSDP2's hooks gather every weight it uses): logprobs (N, L-1) of ids
    (N, L). Below fp32, FSDP2 (infra.dist.shard, one process too) runs the body on a copy of the fp32 masters."""
    def __init__(self, lm, temperature, head_dtype=torch.float32, pad_id=0, body_dtype=torch.float32):
        super().__init__()
        out = lm.get_output_embeddings()
        self.lm, self.head, self.pad_id = lm, Head(out, temperature, head_dtype, lm.config), pad_id
        self.body_dtype, self.head_name = body_dtype, next(n for n, m in lm.named_modules() if m is out) + "."
        # a tied head is the embedding, computed in the body
        self.tied = out.weight is lm.get_input_embeddings().weight

    def forward(self, ids, att):
        hidden = self.lm.get_decoder()(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
        return self.head(hidden[:, :-1], ids[:, 1:])

    def weights(self):
        """What the generators load, (name, tensor, dtype): the body in its dtype, an untied head in its own (Sec. 3.2).
        An FSDP2 parameter comes gathered and cast (all trainer ranks must consume it), a plain one as it is."""
        for name, p in self.lm.named_parameters():
            dtype = self.head.dtype if name.startswith(self.head_name) else self.body_dtype  # a tied one: not listed
            yield name, p.detach().to(dtype).full_tensor() if hasattr(p, "full_tensor") else p.detach(), dtype

    def state(self):
        """{name: tensor} of the weights in the dtype each is loaded in (one process: the engines, the export)."""
        return {name: t.to(dtype) for name, t, dtype in self.weights()}


def micro_batches(order, lengths, budget):
    """Runs of `order` (sorted by length: little padding) that fit `budget` tokens padded to their last, longest one."""
    out = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[i] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def policy_gradient(policy, samples, adv, cfg, rank=0, world=1, version=-1):
    """Backward of the RL loss (Sec. 3.2) into .grad over token-budget micro-batches of every world-th completion by
    length (whole-batch weights: the ranks' gradients add up). Returns loss, token-weighted sums, max ratio. The batch
    stays on the host (NARROW); each micro-batch goes to the device as it is used, as the model takes it."""
    # the loss's options (eps_max; eps_low, eps_high) from cfg: a negative one keeps the loss's default
    opts = {k: getattr(cfg, k) for k in losses.DEFAULTS[cfg.loss] if getattr(cfg, k) >= 0}
    dev = next(policy.parameters()).device
    ids, att, tmask, gen_logp, versions = rollout_tensors(samples, policy.pad_id, NARROW)
    weights = losses.aggregation_weights(tmask, torch.tensor([s.group for s in samples]), how=cfg.agg)
    lengths = att.sum(1).tolist()
    order = sorted(range(len(samples)), key=lengths.__getitem__)
    plans = [micro_batches(order[r::world], lengths, cfg.micro_batch_tokens) for r in range(world)]
    policy.train()
    total, ratio_max, means = 0.0, 0.0, [k for k in losses.DIAGNOSTICS if k != "ratio_max"]
    sums = dict.fromkeys(("n_tokens", "fresh_tokens", "fresh_gap", *losses.SUMS, *means), 0.0)
    n = max(map(len, plans))
    for i in range(n):
        if getattr(policy, "defer_sync", False):  # FSDP2 reduce-scatters after the last pass only (infra.plan)
            policy.set_requires_gradient_sync(i == n - 1)
        # FSDP2 ranks run the same number of passes: one with fewer adds a zero gradient
        mb = plans[rank][i] if i < len(plans[rank]) else [0]
        L = lengths[mb[-1]]
        logp = policy(ids[mb, :L].to(dev).long(), att[mb, :L].to(dev).long())
        if i >= len(plans[rank]):
            (logp.sum() * 0).backward()
            continue
        # the loss tokens sampled by these very weights: their mismatch is the kernels' (and an older KV cache's)
        gen, w, f, a = (t.to(dev) for t in (gen_logp[mb, :L - 1], weights[mb, :L - 1],
                                            (versions[mb, :L - 1] == version) & tmask[mb, :L - 1], adv[mb]))
        loss, diag = losses.policy_loss(logp, gen, a, tmask[mb, :L - 1].to(dev).float(), w, loss=cfg.loss,
                                        is_correction=cfg.is_correction, is_cap=cfg.is_cap, **opts)
        loss.backward()
        total += loss.item()
        diag |= dict(fresh_tokens=int(f.sum()), fresh_gap=float(torch.where(f, (logp.detach() - gen).abs(), 0).sum()))
        for k in sums:
            sums[k] += diag[k] * diag["n_tokens"] if k in means else diag[k]
        ratio_max = max(ratio_max, diag["ratio_max"])
    return total, sums, ratio_max


# train_step's metrics beside loss, n_tokens, finite and lr (docs/metrics.md)
METRICS = ("clip_frac", "ratio_mean", "ratio_max", "mismatch_kl", "logratio_sd", "dapo_clip_low", "dapo_clip_high",
           "dapo_grad_low", "dapo_grad_high", "seq_ess", "fresh_mismatch", "grad_norm")


def train_step(policy, opt, groups, cfg, step, comm=None):
    """One optimizer step on the kept groups (App. A.3), skipped if the loss or gradient is non-finite (a bad batch
    must not poison weights or Adam's moments). `comm`: several trainer ranks (infra.dist); metrics agree on all."""
    lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    for group in opt.param_groups:
        group["lr"] = lr
    samples = [s for g in groups for s in g]
    adv = losses.group_advantages(torch.tensor([s.reward for s in samples]),
                                  torch.tensor([s.group for s in samples], dtype=torch.long), norm=cfg.adv_norm)
    # every group zero-variance: no signal, no update (AdamW's weight decay alone would still move the weights)
    if not adv.any():
        return dict(dict.fromkeys(METRICS, 0.0), loss=0.0, ratio_mean=1.0, ratio_max=1.0, fresh_mismatch=None,
                    seq_ess=None, n_tokens=0, finite=True, lr=lr)
    rank, world = (comm.rank, comm.size) if comm else (0, 1)
    with comm.guard("gradients") if comm else contextlib.nullcontext():
        loss, sums, ratio_max = policy_gradient(policy, samples, adv, cfg, rank, world, version=step)
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        # under FSDP2 the norm is a DTensor
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    sums, maxes = dict(sums, loss=loss), dict(ratio_max=ratio_max)
    if comm:
        sums, maxes = comm.reduce(sums, maxes)
    # the same verdict on every trainer rank
    finite = math.isfinite(gnorm) and math.isfinite(sums["loss"])
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    n = sums["n_tokens"] or 1
    out = {k: sums[k] / n for k in ("clip_frac", "ratio_mean", "mismatch_kl", "dapo_clip_low", "dapo_clip_high")}
    # the spread of log(pi_train / pi_gen): what the trust region (clip or cap) acts on; the norm before clipping
    out |= {f"dapo_grad_{k}": sums[f"dapo_weight_{k}"] / (sums["weight_total"] or 1) for k in ("low", "high")}
    out["seq_ess"] = sums["seq_w"] ** 2 / (sums["n_seqs"] * sums["seq_w2"] or 1)  # (sum w)^2 / (N sum w^2), w: s_i
    return dict(out, logratio_sd=max(sums["logratio_sq"] / n - out["mismatch_kl"] ** 2, 0.0) ** 0.5,
                fresh_mismatch=sums["fresh_gap"] / sums["fresh_tokens"] if sums["fresh_tokens"] else None,
                grad_norm=float(gnorm), loss=sums["loss"], ratio_max=maxes["ratio_max"], n_tokens=int(sums["n_tokens"]),
                finite=finite, lr=lr)


def optimizer(cfg, policy):
    """AdamW as in App. A.3 (no KL term, no schedule beyond the warm-up in train_step)."""
    return torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)


def decoder_layers(lm):
    """The decoder's stack of layers (FSDP2 units), whatever the family names it: model.layers, transformer.h, ..."""
    return next(m for m in lm.get_decoder().children() if isinstance(m, torch.nn.ModuleList))


def tiny_model(cfg, vocab_size):
    """The tiny model: a small Llama built from a config (no download), seeded; the warm start below trains it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    mc = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.n_embd, intermediate_size=3 * cfg.n_embd,
                     num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                     max_position_embeddings=512, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(mc)


def warm_start(cfg, model, tok, out_root):
    """Supervised warm start on the task's traces (some wrong on purpose), cached so later runs reuse it."""
    if cfg.sft_steps == 0 or cfg.model != "tiny":
        return
    key = {k: getattr(cfg, k) for k in ("seed", "n_layer", "n_embd", "n_head", "task", "levels", "sft_steps",
                                        "sft_batch", "sft_lr", "sft_error_rate")}
    key["vocab"], key["version"] = tok.get_vocab(), WARM_START_VERSION
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(out_root, "warmstart", digest + ".pt")
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True))
        print(f"warm start: loaded {path}")
        return
    levels, sources = tuple(int(x) for x in cfg.levels.split(",")), cfg.task.split("+")
    # 4,000 traces per task from the training side of the split (held-out questions never appear), ids apart from RL's
    kw = dict(seed=cfg.seed, error_rate=cfg.sft_error_rate, split="train", start_id=10 ** 6)
    traces = data.arith_problems(4000, levels=levels, **kw) if "arith" in sources else []
    if "code" in sources:
        traces += data.code_problems(4000, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    t0 = time.time()
    model.train()
    for it in range(cfg.sft_steps):
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / cfg.sft_steps))
        opt.param_groups[0]["lr"] = cfg.sft_lr * min(1.0, (it + 1) / 50) * cosine
        ps = rng.sample(traces, cfg.sft_batch)
        prompts = [data.encode(tok, data.format_prompt(p.question, tok)) for p in ps]
        seqs = [pr + data.encode(tok, data.format_target(p)) + [tok.eos_token_id] for pr, p in zip(prompts, ps)]
        n_targets = sum(len(s) - len(p) for s, p in zip(seqs, prompts))
        order, loss = sorted(range(len(seqs)), key=lambda i: len(seqs[i])), 0.0
        for k in range(0, len(order), 16):  # 16 similar lengths at a time: a quarter less padding than one batch
            part = order[k:k + 16]
            ids, att, tmask = sequence_batch([seqs[i] for i in part], [len(prompts[i]) for i in part], tok.pad_token_id)
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            part_loss = (nll * tmask).sum() / n_targets  # the batch's mean over target tokens, accumulated
            part_loss.backward()
            loss += part_loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it % 100 == 0 or it == cfg.sft_steps - 1:
            eta = (time.time() - t0) / (it + 1) * (cfg.sft_steps - it - 1)
            print(f"warm start {it:4d}/{cfg.sft_steps} | loss {loss:.3f} | {time.time() - t0:.0f}s | eta "
                  f"{eta / 60:.1f}m", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # the cache is shared: runs started side by side each write their own
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
