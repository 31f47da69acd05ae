"""The ScaleRL objective and its peers as tensor functions: advantages, token losses, aggregation, FP32-head logprobs.

REINFORCE minimises `-r * log pi(y_t)` on samples from the current policy. Each piece here changes one thing about it:
1. Advantage (Sec. 3.2): `A_i = r_i - mean` over the prompt's G completions, divided by the std of all A_i in the
   batch (ScaleRL), the prompt's own std (GRPO) or nothing (Dr. GRPO). Equal rewards in a group: A = 0, no signal.
2. Importance ratio (Sec. 3.1): the generator lags (PipelineRL) and runs other kernels: `rho = pi_train / pi_gen`.
3. CISPO (Sec. 3.2): REINFORCE weighted by `sg(min(rho, eps_max))`, a constant capped from above only: no token
   loses its gradient, a huge ratio just stops growing. eps_max = 4 (the paper saw 4, 5 and 8 tie).
4. PPO clipping (DAPO, GRPO; Sec. 3.2): `rho * A` clipped to `[1 - eps_low, 1 + eps_high]`, no dual clip, no KL: a token
   whose ratio left that range the way A pushes gets zero gradient. DAPO: 0.2 / 0.28 ("clip-higher"); GRPO: 0.2 / 0.2.
5. GSPO (Sec. 3.2): one ratio per sequence (the geometric mean of its token ratios), PPO-clipped to 3e-3 / 5e-3.
6. Aggregation (Sec. 3.2): prompt average (ScaleRL: each prompt counts once), sample (GRPO) or token average (DAPO).
7. FP32 head (Sec. 3.2, Fig. 5b): float32 logits on both generator (`head_logits`) and trainer (`head_logprobs`),
   logprobs after the sampling temperature; it lifted the asymptote from 0.52 to 0.61 by removing a ratio bias.
8. Beyond the paper (off by default; docs/metrics.md): DPPO's mask on |pi - pi_gen| (arXiv 2602.04879) in place of a
   ratio clip, and importance corrections of any loss: token-level TIS, sequence-level MIS.

ScaleRL = CISPO + prompt aggregation + batch advantage normalisation + zero-variance filtering + NPR + FP32 head.
Filtering and No-Positive-Resampling (NPR) act on prompts (pipeline_rl.py): pass only the kept groups here.
"""
import math

import torch


# ----------------------------------------------------------------------------- advantages (Sec. 3.2)
def group_advantages(rewards, group, norm="batch", eps=1e-6):
    """(B,) advantages from (B,) rewards and (B,) integer prompt ids (any values, any order)."""
    assert rewards.dim() == 1 and group.shape == rewards.shape, (rewards.shape, group.shape)
    assert norm in ("batch", "prompt", "none"), norm
    r = rewards if rewards.is_floating_point() else rewards.float()
    uniq, idx = torch.unique(group, return_inverse=True)  # (B,) group index 0..n-1

    def per_group(x, how="sum"):  # (n,) reduction of x over each group's completions
        return r.new_zeros(len(uniq)).scatter_reduce(0, idx, x, how, include_self=False)
    count = per_group(torch.ones_like(r))  # (n,)
    live = (per_group(r, "amax") > per_group(r, "amin"))[idx]  # (B,) the group's rewards differ
    adv = torch.where(live, r - (per_group(r) / count)[idx], 0.0)  # exactly 0, not round-off
    # ScaleRL: one std (unbiased; our choice) over all completions passed in, kept zero-variance groups' zeros too
    if norm == "batch":
        std = adv.std() if live.any() and adv.numel() > 1 else 0.0
        return adv / std if std > 0 else torch.zeros_like(adv)
    if norm == "prompt":  # GRPO: each group by its own (unbiased) std
        var = per_group(adv * adv) / (count - 1).clamp(min=1)
        return adv / (var.sqrt()[idx] + eps)
    return adv  # "none": Dr. GRPO


# ----------------------------------------------------------------------------- per-token losses (Sec. 3.2)
def _per_token(adv, logp):
    """Advantages as (B, T): a (B,) sequence advantage is broadcast over its tokens."""
    assert adv.shape in (logp.shape[:1], logp.shape), ("adv must be (B,) or (B, T)", adv.shape, logp.shape)
    return adv[:, None] if adv.shape == logp.shape[:1] else adv


def cispo(logp, gen_logp, adv, eps_max=4.0):
    """CISPO: -sg(min(rho, eps_max)) * A * logp, (B, T). rho has no lower bound; eps_max is absolute."""
    rho = torch.exp(logp - gen_logp).detach()  # (B, T) stop-gradient: only the last logp carries gradient
    return -rho.clamp(max=eps_max) * _per_token(adv, logp) * logp


def ppo_clip(logp, gen_logp, adv, eps_low=0.2, eps_high=0.28):
    """PPO clipped surrogate, (B, T): DAPO with the defaults, GRPO with 0.2 / 0.2. No dual clip."""
    rho = torch.exp(logp - gen_logp)  # (B, T)
    a = _per_token(adv, logp)
    return -torch.minimum(rho * a, rho.clamp(1 - eps_low, 1 + eps_high) * a)


def _seq_log_ratio(logp, gen_logp, mask):
    """(B,) log of GSPO's sequence ratio: mean over loss tokens of log(pi_train / pi_gen)."""
    m = mask.bool()
    return torch.where(m, logp - gen_logp, 0.0).sum(-1) / m.sum(-1).clamp(min=1)  # padding may hold any value


def gspo(logp, gen_logp, adv, mask, eps_low=3e-3, eps_high=5e-3):
    """GSPO in token form, (B, T): PPO clipping of s_it = sg(s_i) * pi/sg(pi), the value of the sequence ratio s_i with
    the gradient s_i * grad log pi(y_t); with a per-sequence A and sample aggregation, sequence-level GSPO (tested)."""
    log_s = _seq_log_ratio(logp, gen_logp, mask).detach()  # (B,)
    return ppo_clip(log_s[:, None] + logp, logp.detach(), adv, eps_low, eps_high)


def dppo(logp, gen_logp, adv, eps_low=0.15, eps_high=0.15):
    """DPPO-Binary-TV (arXiv 2602.04879), (B, T): -sg(rho) * A * logp, masked where the sampled token's probability
    moved from the generator's by more than the threshold the way A pushes (pi - pi_gen > eps_high with A > 0, below
    -eps_low with A < 0): a trust region on the binary total variation |pi - pi_gen|, not on the ratio."""
    rho, a = torch.exp(logp - gen_logp).detach(), _per_token(adv, logp)
    shift = (logp.exp() - gen_logp.exp()).detach()
    return -torch.where(torch.where(a > 0, shift <= eps_high, shift >= -eps_low), rho * a * logp, 0.0)


def is_weights(logp, gen_logp, mask, how, cap):
    """(B, T) constant multipliers of each token's term against the generator-trainer gap, rho = pi_train / pi_gen:
    TIS min(rho, cap) per token; MIS 0 for a whole sequence whose geometric-mean ratio is outside [1/cap, cap]."""
    if how == "tis":
        return torch.exp(logp - gen_logp).detach().clamp(max=cap)
    log_s = _seq_log_ratio(logp.detach(), gen_logp, mask)  # (B,)
    return (log_s.abs() <= math.log(cap)).to(logp.dtype)[:, None].expand_as(logp)


# ----------------------------------------------------------------------------- aggregation (Sec. 3.2)
def aggregation_weights(mask, group, how="prompt", dtype=None):
    """(B, T) weights w with aggregate = (per_token * w).sum(); sliced to micro-batches, the sums add up to the full
    loss exactly. Completions (prompts) without loss tokens contribute nothing and are not counted."""
    assert how in ("prompt", "sample", "token"), how
    assert mask.dim() == 2 and group.shape == mask.shape[:1], (mask.shape, group.shape)
    dtype = dtype or (mask.dtype if mask.is_floating_point() else torch.float32)
    m = mask.bool().to(dtype)  # (B, T)
    # the mean over units of (sum of the unit's token losses / T_u, its loss tokens); a unit is a prompt with all its
    # completions (ScaleRL), one completion (GRPO: "sample") or the whole batch (DAPO: every token counts the same)
    unit = dict(prompt=group, sample=torch.arange(len(group), device=group.device), token=torch.zeros_like(group))[how]
    uniq, idx = torch.unique(unit, return_inverse=True)
    t_u = m.new_zeros(len(uniq)).index_add_(0, idx, m.sum(-1))  # (n_units,)
    return m / t_u[idx].clamp(min=1)[:, None] / (t_u > 0).sum().clamp(min=1)


def aggregate(per_token, mask, group, how="prompt"):
    """Scalar loss from (B, T) token losses; tokens outside the mask are ignored (even if inf or nan)."""
    w = aggregation_weights(mask, group, how, dtype=per_token.dtype)
    return torch.where(mask.bool(), per_token * w, torch.zeros_like(per_token)).sum()


# ----------------------------------------------------------------------------- registry and entry point
# name -> the paper's options for that loss (Sec. 3.2, items 3-5 above; GSPO's own 3e-4 / 4e-4 failed there)
# dppo: the TV threshold 0.15 on both sides, as the paper's public recipe runs it (docs/metrics.md)
DEFAULTS = {"cispo": dict(eps_max=4.0), "dapo": dict(eps_low=0.2, eps_high=0.28),
            "grpo": dict(eps_low=0.2, eps_high=0.2), "gspo": dict(eps_low=3e-3, eps_high=5e-3),
            "dppo": dict(eps_low=0.15, eps_high=0.15)}
LOSSES = {"cispo": cispo, "dapo": ppo_clip, "grpo": ppo_clip, "gspo": gspo, "dppo": dppo}  # gspo takes the mask too
IS_CORRECTIONS = ("none", "tis", "mis")  # is_weights
# policy_loss's token means, whatever the loss (docs/metrics.md)
DIAGNOSTICS = ("clip_frac", "ratio_mean", "ratio_max", "mismatch_kl", "logratio_sq", "dapo_clip_low", "dapo_clip_high")
# policy_loss's sums (whole-batch weights: micro-batches and ranks add up): |rho A w| of the tokens DAPO's rule
# would clip, by side, and of every loss token (the trainer logs each side's share, docs/metrics.md)
# and the batch's sequence ratios w (geometric means): sum w, sum w^2, count, for the effective sample size
SUMS = ("dapo_weight_low", "dapo_weight_high", "weight_total", "seq_w", "seq_w2", "n_seqs")


def policy_loss(logp, gen_logp, adv, mask, weights, loss="cispo", is_correction="none", is_cap=2.0, **kw):
    """(scalar loss, diagnostics); `weights`: aggregation_weights of the whole batch, sliced; kw overrides DEFAULTS;
    is_correction (tis, mis) multiplies each token's term by is_weights."""
    assert loss in LOSSES, loss
    assert set(kw) <= set(DEFAULTS[loss]), f"loss {loss!r} takes options {sorted(DEFAULTS[loss])}; got {sorted(kw)}"
    fn, opts = LOSSES[loss], {**DEFAULTS[loss], **kw}
    assert logp.shape == gen_logp.shape == mask.shape == weights.shape and logp.dim() == 2, (logp.shape, mask.shape)
    m = mask.bool()
    per_token = fn(logp, gen_logp, adv, mask, **opts) if loss == "gspo" else fn(logp, gen_logp, adv, **opts)
    if is_correction != "none":
        per_token = per_token * is_weights(logp, gen_logp, mask, is_correction, is_cap)
    total = torch.where(m, per_token * weights, torch.zeros_like(per_token)).sum()
    n = int(m.sum())
    if n == 0:
        return total, dict.fromkeys(DIAGNOSTICS + SUMS, 0.0) | dict(n_tokens=0)
    with torch.no_grad():
        rho, a = torch.exp(logp - gen_logp), _per_token(adv, logp).expand_as(logp)  # (B, T) token ratios, advantages
        if loss == "dppo":  # masked: moved past the TV threshold the way A pushes
            shift = logp.exp() - gen_logp.exp()
            clipped = ((a > 0) & (shift > opts["eps_high"])) | ((a < 0) & (shift < -opts["eps_low"]))
        elif "eps_high" not in opts:  # truncated (CISPO, or a loss without PPO's clip): the weight was capped
            clipped = rho > opts.get("eps_max", float("inf"))
        else:  # the clipped branch is the minimum: this token's gradient is zero
            r = rho if loss != "gspo" else torch.exp(_seq_log_ratio(logp, gen_logp, mask))[:, None].expand_as(rho)
            clipped = ((a > 0) & (r > 1 + opts["eps_high"])) | ((a < 0) & (r < 1 - opts["eps_low"]))
        # whatever the loss, the tokens DAPO's rule would silence, by side (Sec. 3.2); mismatch_kl estimates
        # KL(gen || train), logratio_sq is the mean square of log(pi_train / pi_gen)
        rho, a, lr, dapo = rho[m], a[m], (logp - gen_logp)[m], DEFAULTS["dapo"]
        low, high = (a < 0) & (rho < 1 - dapo["eps_low"]), (a > 0) & (rho > 1 + dapo["eps_high"])
        gw = (rho * a * weights[m]).abs()  # each token's weight on grad log pi in the unclipped surrogate rho * A
        w = torch.exp(_seq_log_ratio(logp, gen_logp, mask))[m.any(-1)]  # (sequences with loss tokens,)
        return total, dict(clip_frac=float(clipped[m].sum()) / n, ratio_mean=float(rho.mean()),
                           ratio_max=float(rho.max()), mismatch_kl=-float(lr.mean()),
                           logratio_sq=float(lr.square().mean()), dapo_clip_low=float(low.sum()) / n,
                           dapo_clip_high=float(high.sum()) / n, dapo_weight_low=float(gw[low].sum()),
                           dapo_weight_high=float(gw[high].sum()), weight_total=float(gw.sum()),
                           seq_w=float(w.sum()), seq_w2=float(w.square().sum()), n_seqs=len(w), n_tokens=n)


# ----------------------------------------------------------------------------- FP32-head logprobs (Sec. 3.2, Fig. 5b)
class _FP32HeadLogprobs(torch.autograd.Function):
    """Logprobs of targets under softmax(finish(h W^T + b) / tau), chunk by chunk: forward keeps a log-normaliser per
    token, backward recomputes each chunk's logits in one reused (chunk, V) buffer (autograd would keep them all)."""

    @staticmethod
    def forward(ctx, h, w, b, targets, chunk, tau, scale, cap):  # h (N, H), w (V, H), b (V,) or None, targets (N,)
        wf = w.to(torch.promote_types(torch.promote_types(h.dtype, w.dtype), torch.float32))
        lp, lse = wf.new_empty(h.shape[0]), wf.new_empty(h.shape[0])
        ctx.chunk, ctx.tau, ctx.finish = chunk, tau, (None if b is None else b.to(wf.dtype), scale, cap)
        for c, _, z in _chunks(h, wf, chunk, tau, *ctx.finish):
            zmax = z.amax(-1, keepdim=True)
            tgt = z.sub_(zmax).gather(1, targets[c, None])[:, 0]
            lse[c] = z.exp_().sum(-1).log() + zmax[:, 0]
            lp[c] = tgt + zmax[:, 0] - lse[c]
        ctx.save_for_backward(h, w, targets, lse)
        return lp

    @staticmethod
    def backward(ctx, g_lp):
        h, w, targets, lse = ctx.saved_tensors
        wf = w.to(lse.dtype)
        grad_h = wf.new_empty(h.shape) if ctx.needs_input_grad[0] else None
        grad_w = wf.new_zeros(w.shape) if ctx.needs_input_grad[1] else None
        grad_b = wf.new_zeros(w.shape[0]) if ctx.needs_input_grad[2] else None
        _, scale, cap = ctx.finish
        for c, hc, g in _chunks(h, wf, ctx.chunk, ctx.tau, *ctx.finish):
            # the finish's slope: scale, times 1 - tanh^2 under a soft cap (g holds the capped logits / tau)
            slope = scale if cap is None else (g * (ctx.tau / cap)).square_().neg_().add_(1).mul_(scale)
            # d logp_target / d logits = (onehot - p) / tau
            g.sub_(lse[c, None]).exp_().mul_(-g_lp[c, None])
            g.scatter_add_(1, targets[c, None], g_lp[c, None]).div_(ctx.tau).mul_(slope)
            if grad_b is not None:
                grad_b += g.sum(0)
            if grad_h is not None:
                grad_h[c] = g @ wf
            if grad_w is not None:  # in place, as out= (torch's FlopCounterMode counts addmm, not addmm_)
                torch.addmm(grad_w, g.T, hc, out=grad_w)
        return (None if grad_h is None else grad_h.to(h.dtype), None if grad_w is None else grad_w.to(w.dtype),
                None if grad_b is None else grad_b.to(w.dtype), None, None, None, None, None)


def _chunks(h, wf, chunk, tau, bias=None, scale=1.0, cap=None):
    """Per chunk of tokens: its slice, hidden states (C, H) in the head's dtype, logits / tau (C, V) in one buffer."""
    buf = wf.new_empty(min(chunk, h.shape[0]), wf.shape[0])
    for i in range(0, h.shape[0], chunk):
        hc = h[i:i + chunk].to(wf.dtype)
        yield slice(i, i + chunk), hc, finish(torch.mm(hc, wf.T, out=buf[:hc.shape[0]]), bias, scale, cap).div_(tau)


def head_finish(config):
    """(scale, cap) of a model's own head after h W^T + b: Granite's 1 / logits_scaling, Cohere's logit_scale, Gemma
    2's final soft cap. The policy must sample and train on the logits its exported model computes."""
    scale = getattr(config, "logit_scale", None) or 1 / (getattr(config, "logits_scaling", None) or 1)
    return float(scale), getattr(config, "final_logit_softcapping", None)


def finish(z, bias, scale, cap):
    """Logits z (in place): + bias, x scale, then the soft cap cap * tanh(z / cap) (losses.head_finish)."""
    z = z if bias is None else z.add_(bias)
    z = z if scale == 1 else z.mul_(scale)
    return z if cap is None else z.div_(cap).tanh_().mul_(cap)


def token_logprobs(hidden, head_weight, targets, chunk=1024, temperature=1.0, bias=None, scale=1.0, cap=None):
    """(B, T) float32 (float64 if an input is) logprobs of targets under the FP32 LM head after temperature (Sec. 3.2),
    differentiable in hidden (B, T, H, any dtype), head_weight (V, H) and bias; the (B*T, V) logits never exist."""
    assert hidden.dim() == 3 and hidden.shape[-1] == head_weight.shape[1] and targets.shape == hidden.shape[:2] and \
        not targets.is_floating_point(), ("hidden, head_weight, targets", hidden.shape, head_weight.shape, targets)
    assert not targets.numel() or 0 <= targets.min() <= targets.max() < head_weight.shape[0], "targets out of vocab"
    assert int(chunk) >= 1 and temperature > 0, ("chunk, temperature", chunk, temperature)
    return _FP32HeadLogprobs.apply(hidden.flatten(0, 1), head_weight, bias, targets.flatten().long(), int(chunk),
                                   float(temperature), float(scale), cap).view(targets.shape)


def head_logits(hidden, weight, head_dtype=torch.float32, bias=None, scale=1.0, cap=None):
    """The generator's float32 LM-head logits, the matmul in head_dtype (float32: the FP32 head, Sec. 3.2, Fig. 5b)."""
    logits = torch.nn.functional.linear(hidden.to(head_dtype), weight.to(head_dtype)).float()
    return finish(logits, None if bias is None else bias.float(), scale, cap)


def head_logprobs(hidden, weight, targets, temperature=1.0, head_dtype=torch.float32, bias=None, scale=1.0, cap=None):
    """Trainer logprobs of `targets` (B, T) after temperature, in `head_logits`'s arithmetic (FP32: token_logprobs)."""
    if head_dtype == torch.float32:
        return token_logprobs(hidden, weight, targets, temperature=temperature, bias=bias, scale=scale, cap=cap)
    logp = torch.log_softmax(head_logits(hidden, weight, head_dtype, bias, scale, cap) / temperature, -1)  # (B, T, V)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
