"""losses.py against hand-computed values and naive Python loops (values and gradients).

Run: `python -m pytest tests/test_losses.py -q` from the project root (a few seconds on a CPU).
"""
import math

import pytest
import torch

import losses
from losses import (DEFAULTS, IS_CORRECTIONS, LOSSES, aggregate, aggregation_weights, cispo, dppo, group_advantages,
                    gspo, policy_loss, ppo_clip, token_logprobs)

f64 = torch.float64


def random_batch(seed, B=6, T=5, groups=(4, 4, 9, 9, 2, 2)):
    """Random float64 logprobs, a ragged mask and interleaved, non-contiguous prompt ids."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=f64) * 2).requires_grad_()
    gen_logp = logp.detach() + 0.6 * torch.randn(B, T, generator=g, dtype=f64)  # ratios from ~0.2 to ~5
    adv = torch.randn(B, generator=g, dtype=f64)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lens[:, None]
    return logp, gen_logp, adv, mask, torch.tensor(groups)


# ----------------------------------------------------------------------------- group_advantages


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, -1, 1, 1, -1, -1, 1, 0], dtype=f64)
    g = torch.tensor([5, 5, 5, 5, 9, 9, 2, 2])
    a = torch.tensor([0.5, -1.5, 0.5, 0.5, 0, 0, 0.5, -0.5], dtype=f64)  # group 9 has zero variance
    torch.testing.assert_close(group_advantages(r, g, "none"), a)
    # batch std over all 8 completions (zero-variance filter off: group 9's zeros count): sum of squares 3.5, / 7
    torch.testing.assert_close(group_advantages(r, g), a / math.sqrt(0.5))
    # the filter on passes only groups 5 and 2: unbiased variance 3.5 / 5
    live = g != 9
    torch.testing.assert_close(group_advantages(r[live], g[live]), a[live] / math.sqrt(0.7))
    # group 5: std 1 ; group 2: std sqrt(0.5)
    want = torch.tensor([0.5, -1.5, 0.5, 0.5, 0, 0, 0.5 / 0.5 ** 0.5, -0.5 / 0.5 ** 0.5], dtype=f64)
    torch.testing.assert_close(group_advantages(r, g, "prompt"), want, rtol=1e-5, atol=0)


def naive_advantages(r, g, norm, eps=1e-6):
    r, g = r.tolist(), g.tolist()
    members = {k: [j for j in range(len(r)) if g[j] == k] for k in set(g)}
    adv, std_p = [], []
    for i in range(len(r)):
        rs = [r[j] for j in members[g[i]]]
        mean = sum(rs) / len(rs)
        live = max(rs) > min(rs)
        adv.append(r[i] - mean if live else 0.0)
        std_p.append(math.sqrt(sum((x - mean) ** 2 for x in rs) / max(len(rs) - 1, 1)))
    if norm == "prompt":
        adv = [a / (s + eps) for a, s in zip(adv, std_p)]
    if norm == "batch":  # one std over every completion given, flat groups' zeros included
        m = sum(adv) / len(adv)
        std = math.sqrt(sum((x - m) ** 2 for x in adv) / (len(adv) - 1))
        adv = [a / std for a in adv]
    return torch.tensor(adv, dtype=f64)


@pytest.mark.parametrize("norm", ["batch", "prompt", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_vs_loops(norm, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.tensor([7, 3, 7, 100, 3, 7, 100, 3, 42, 42, 7, 100, -5])  # interleaved, arbitrary ids
    r = torch.randint(0, 2, g.shape, generator=gen).to(f64) * 2 - 1  # +-1 rewards, some groups constant
    r[8:10] = 1.0  # group 42 is always zero-variance; -5 is a group of one
    if seed % 2:
        r = r + torch.rand(g.shape, generator=gen, dtype=f64)  # continuous rewards too
        r[8:10] = 0.3
    torch.testing.assert_close(group_advantages(r, g, norm), naive_advantages(r, g, norm))


def test_group_advantages_edge_cases():
    g = torch.tensor([1, 1, 2, 2, 3])
    same = torch.tensor([0.1, 0.1, 1.0, 1.0, -1.0], dtype=f64)
    for norm in ("batch", "prompt", "none"):  # all groups constant: exactly zero, no nan
        assert torch.equal(group_advantages(same, g, norm), torch.zeros(5, dtype=f64))
    r3 = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5], dtype=f64)
    assert (r3[:3] - r3[:3].mean()).abs().max() > 0  # the mean of three 0.1s is not 0.1 in float64
    g3 = torch.tensor([0, 0, 0, 1, 1, 1])
    for norm in ("batch", "prompt", "none"):
        assert torch.equal(group_advantages(r3, g3, norm)[:3], torch.zeros(3, dtype=f64))
    ints = group_advantages(torch.tensor([1, 0, 1, 1]), torch.tensor([0, 0, 1, 1]), "none")
    assert ints.dtype == torch.float32 and ints.tolist() == [0.5, -0.5, 0.0, 0.0]
    # a single live group of two: batch-normalised to +-1/sqrt(2) (unbiased std of [0.5, -0.5] is sqrt(0.5))
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])),
                               torch.tensor([0.5, -0.5]) / math.sqrt(0.5))
    with pytest.raises(AssertionError, match="group"):
        group_advantages(same, g, "group")
    with pytest.raises(AssertionError):
        group_advantages(same, g[:3])


# ----------------------------------------------------------------------------- cispo


def test_cispo_hand_computed_gradient_and_cap():
    # ratios 2, 8, 16, 0.5: the last three are on either side of the cap eps_max = 4
    logp = torch.log(torch.tensor([[0.5, 0.8, 0.8, 0.1]], dtype=f64)).requires_grad_()
    gen_logp = torch.log(torch.tensor([[0.25, 0.1, 0.05, 0.2]], dtype=f64)).requires_grad_()
    adv = torch.tensor([1.5], dtype=f64)
    loss = cispo(logp, gen_logp, adv)
    want = -torch.tensor([2.0, 4.0, 4.0, 0.5], dtype=f64) * 1.5 * logp.detach()
    torch.testing.assert_close(loss, want)
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=f64)  # aggregation weights
    (loss * w).sum().backward()
    # gradient = -sg(min(rho, eps)) * A * w: rho = 8 and rho = 16 get the same weight, 4
    torch.testing.assert_close(logp.grad, -torch.tensor([[2.0 * 0.1, 4 * 0.2, 4 * 0.3, 0.5 * 0.4]], dtype=f64) * 1.5)
    assert gen_logp.grad is None  # the whole ratio is a constant
    # without the stop-gradient rho would add -A * w * rho * logp to the uncapped tokens' gradient
    lp2 = logp.detach().clone().requires_grad_()
    rho = torch.exp(lp2 - gen_logp.detach())
    (-(rho.clamp(max=4.0) * 1.5 * lp2) * w).sum().backward()
    assert (lp2.grad - logp.grad)[0, [0, 3]].abs().min() > 0.1


@pytest.mark.parametrize("seed", range(3))
def test_cispo_vs_loops(seed):
    logp, gen_logp, adv, _, _ = random_batch(seed)
    eps = 1.7
    loss = cispo(logp, gen_logp, adv, eps_max=eps)
    B, T = logp.shape
    lp, glp = logp.detach().tolist(), gen_logp.tolist()
    val = [[-min(math.exp(lp[i][t] - glp[i][t]), eps) * adv[i].item() * lp[i][t] for t in range(T)] for i in range(B)]
    torch.testing.assert_close(loss, torch.tensor(val, dtype=f64))
    loss.sum().backward()
    grad = [[-min(math.exp(lp[i][t] - glp[i][t]), eps) * adv[i].item() for t in range(T)] for i in range(B)]
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=f64))
    # (B, T) advantages give the same as their broadcast (B,) form
    torch.testing.assert_close(cispo(logp, gen_logp, adv[:, None].expand(B, T), eps), loss)


# ----------------------------------------------------------------------------- ppo_clip


def test_ppo_clip_hand_computed():
    rho = torch.tensor([1.1, 1.5, 0.5, 0.5, 1.5, 0.9], dtype=f64)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], dtype=f64)
    logp = torch.log(rho)[None].clone().requires_grad_()
    loss = ppo_clip(logp, torch.zeros(1, 6, dtype=f64), adv)  # DAPO: [0.8, 1.28]
    # A>0: in range -> -rho ; above -> -(1.28) clipped ; below -> -rho (min keeps it)
    # A<0: below -> +0.8 clipped ; above -> +rho (min keeps it) ; in range -> +rho
    torch.testing.assert_close(loss, torch.tensor([[-1.1, -1.28, -0.5, 0.8, 1.5, 0.9]], dtype=f64))
    loss.sum().backward()  # d/dlogp of -rho*A is -rho*A ; clipped tokens get nothing
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1, 0, -0.5, 0, 1.5, 0.9]], dtype=f64))


@pytest.mark.parametrize("eps", [(0.2, 0.28), (0.2, 0.2), (0.05, 0.5)])
def test_ppo_clip_vs_loops(eps):
    logp, gen_logp, adv, _, _ = random_batch(11)
    lo, hi = eps
    loss = ppo_clip(logp, gen_logp, adv, lo, hi)
    loss.sum().backward()
    B, T = logp.shape
    for i in range(B):
        for t in range(T):
            rho, a = math.exp(logp[i, t].item() - gen_logp[i, t].item()), adv[i].item()
            clipped = min(max(rho, 1 - lo), 1 + hi)
            assert loss[i, t].item() == pytest.approx(-min(rho * a, clipped * a), rel=1e-12)
            active = rho * a > clipped * a  # the clipped branch is the minimum: no gradient
            assert logp.grad[i, t].item() == pytest.approx(0.0 if active else -rho * a, rel=1e-12, abs=1e-15)


# ----------------------------------------------------------------------------- gspo


def sequence_gspo(logp, gen_logp, adv, mask, eps_low, eps_high):
    """Sequence-level GSPO written directly: mean over sequences of -min(s A, clip(s) A)."""
    terms = []
    for i in range(logp.shape[0]):
        idx = mask[i].nonzero()[:, 0]
        s = torch.exp((logp[i, idx] - gen_logp[i, idx]).mean())
        terms.append(-torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("eps", [(3e-3, 5e-3), (0.2, 0.28)])
@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_equals_sequence_level(eps, seed):
    logp, gen_logp, adv, mask, group = random_batch(seed)
    gen_logp = logp.detach() + 0.01 * torch.randn(logp.shape, dtype=f64, generator=torch.Generator().manual_seed(seed))
    gen_logp[~mask] = float("nan")  # padding holds garbage: it must not leak in
    seq = sequence_gspo(logp, gen_logp, adv, mask, *eps)
    (g_seq,) = torch.autograd.grad(seq, logp)
    tok = aggregate(gspo(logp, gen_logp, adv, mask, *eps), mask, group, "sample")
    (g_tok,) = torch.autograd.grad(tok, logp)
    torch.testing.assert_close(tok, seq)
    torch.testing.assert_close(g_tok, g_seq)
    assert g_tok[~mask].abs().sum() == 0


def test_gspo_hand_computed():
    logp = torch.tensor([[-1.0, -2.0, -5.0]], dtype=f64, requires_grad=True)
    gen_logp = torch.tensor([[-1.01, -2.01, 0.0]], dtype=f64)
    mask = torch.tensor([[True, True, False]])
    s = math.exp(0.01)  # 1.01005 > 1 + 5e-3: clipped for A > 0, kept for A < 0
    pos = gspo(logp, gen_logp, torch.tensor([2.0], dtype=f64), mask)
    torch.testing.assert_close(pos[0, :2], torch.tensor([-2 * 1.005] * 2, dtype=f64))
    neg = gspo(logp, gen_logp, torch.tensor([-2.0], dtype=f64), mask)
    torch.testing.assert_close(neg[0, :2], torch.tensor([2 * s] * 2, dtype=f64))
    (g,) = torch.autograd.grad(neg[0, :2].sum(), logp)  # each token: s * A * grad log pi, with -A
    torch.testing.assert_close(g, torch.tensor([[2 * s, 2 * s, 0.0]], dtype=f64))


# ----------------------------------------------------------------------------- aggregation


def test_aggregation_weights_hand_computed():
    mask = torch.arange(4)[None] < torch.tensor([2, 4, 1, 3])[:, None]  # token counts 2, 4, 1, 3
    group = torch.tensor([3, 3, 8, 8])  # T_p: prompt 3 has 6 tokens, prompt 8 has 4
    m = mask.double()
    want = {"prompt": m * torch.tensor([1 / 12, 1 / 12, 1 / 8, 1 / 8], dtype=f64)[:, None],
            "sample": m * torch.tensor([1 / 8, 1 / 16, 1 / 4, 1 / 12], dtype=f64)[:, None],
            "token": m / 10}
    for how, w in want.items():
        torch.testing.assert_close(aggregation_weights(mask, group, how, dtype=f64), w)
    per_token = torch.arange(16, dtype=f64).view(4, 4)
    # prompt: mean of (0+1+4+5+6+7)/6 and (8+12+13+14)/4 ; sample: mean of 0.5, 5.5, 8, 13 ; token: 70/10
    assert aggregate(per_token, mask, group, "prompt").item() == pytest.approx((23 / 6 + 47 / 4) / 2)
    assert aggregate(per_token, mask, group, "sample").item() == pytest.approx((0.5 + 5.5 + 8 + 13) / 4)
    assert aggregate(per_token, mask, group, "token").item() == pytest.approx(7.0)
    assert aggregation_weights(mask, group).dtype == torch.float32


def test_aggregations_coincide_when_counts_equal():
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, dtype=f64, generator=g)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[:, 4] = False  # every completion has 4 tokens, every prompt 8
    group = torch.tensor([1, 2, 3, 1, 2, 3])
    vals = [aggregate(per_token, mask, group, how) for how in ("prompt", "sample", "token")]
    torch.testing.assert_close(vals[0], vals[1])
    torch.testing.assert_close(vals[0], vals[2])
    mask[0, 3] = False  # now they differ
    vals = [aggregate(per_token, mask, group, how).item() for how in ("prompt", "sample", "token")]
    assert len({round(v, 12) for v in vals}) == 3


def test_empty_completions_and_prompts_are_not_counted():
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [0, 0]], dtype=torch.bool)
    group = torch.tensor([0, 0, 1, 2])  # prompt 2 has no loss tokens at all
    per_token = torch.tensor([[1.0, 3.0], [100.0, 100.0], [5.0, 100.0], [100.0, 100.0]], dtype=f64)
    assert aggregate(per_token, mask, group, "sample").item() == pytest.approx((2 + 5) / 2)
    assert aggregate(per_token, mask, group, "prompt").item() == pytest.approx((4 / 2 + 5) / 2)
    assert aggregate(per_token, mask, group, "token").item() == pytest.approx(3.0)
    nothing = torch.zeros(2, 3, dtype=torch.bool)
    assert aggregate(torch.ones(2, 3), nothing, torch.tensor([0, 1])).item() == 0.0
    with pytest.raises(AssertionError, match="sequence"):
        aggregate(per_token, mask, group, "sequence")


def naive_aggregate(per_token, mask, group, how):
    B, T = mask.shape
    toks = lambda i: [per_token[i, t] for t in range(T) if mask[i, t]]  # noqa: E731
    if how == "token":
        allt = [x for i in range(B) for x in toks(i)]
        return sum(allt) / len(allt)
    if how == "sample":
        means = [sum(toks(i)) / len(toks(i)) for i in range(B) if toks(i)]
        return sum(means) / len(means)
    per_prompt = []
    for p in sorted(set(group.tolist())):
        xs = [x for i in range(B) if group[i] == p for x in toks(i)]
        if xs:
            per_prompt.append(sum(xs) / len(xs))
    return sum(per_prompt) / len(per_prompt)


@pytest.mark.parametrize("how", ["prompt", "sample", "token"])
@pytest.mark.parametrize("seed", range(3))
def test_aggregate_vs_loops_value_and_gradient(how, seed):
    g = torch.Generator().manual_seed(seed)
    per_token = torch.randn(7, 6, dtype=f64, generator=g, requires_grad=True)
    mask = torch.rand(7, 6, generator=g) < 0.6
    mask[2] = False  # one empty completion
    group = torch.tensor([9, 1, 9, 4, 1, 9, 4])
    got = aggregate(per_token, mask, group, how)
    want = naive_aggregate(per_token, mask, group, how)
    torch.testing.assert_close(got, want)
    (g1,) = torch.autograd.grad(got, per_token)
    (g2,) = torch.autograd.grad(want, per_token)
    torch.testing.assert_close(g1, g2)


# ----------------------------------------------------------------------------- policy_loss and diagnostics


@pytest.mark.parametrize("corr", IS_CORRECTIONS)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_with_sliced_weights_equal_full_batch(name, corr):
    logp, gen_logp, adv, mask, group = random_batch(5, B=6, T=7)
    w = aggregation_weights(mask, group, "prompt", dtype=f64)
    full, _ = policy_loss(logp, gen_logp, adv, mask, w, loss=name, is_correction=corr)
    (g_full,) = torch.autograd.grad(full, logp)
    total, g_acc = 0.0, torch.zeros_like(logp)
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):  # micro-batches that split prompts
        lp = logp.detach()[sl].clone().requires_grad_()
        part, _ = policy_loss(lp, gen_logp[sl], adv[sl], mask[sl], w[sl], loss=name, is_correction=corr)
        part.backward()
        total, g_acc[sl] = total + part.item(), lp.grad
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g_acc, g_full)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_zero_variance_groups_contribute_nothing(name):
    logp, gen_logp, _, mask, group = random_batch(2)  # prompts 4, 9, 2 with two completions each
    rewards = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -1.0], dtype=f64)  # prompts 4 and 2 are constant
    adv = group_advantages(rewards, group)
    assert adv[[0, 1, 4, 5]].abs().sum() == 0
    w = aggregation_weights(mask, group, dtype=f64)
    loss, _ = policy_loss(logp, gen_logp, adv, mask, w, loss=name)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[[0, 1, 4, 5]].abs().sum() == 0 and g[[2, 3]].abs().sum() > 0


def test_policy_loss_matches_aggregate_and_paper_defaults():
    logp, gen_logp, adv, mask, group = random_batch(3)
    w = aggregation_weights(mask, group, "sample", dtype=f64)
    for name, fn in [("cispo", lambda: cispo(logp, gen_logp, adv)),
                     ("dapo", lambda: ppo_clip(logp, gen_logp, adv, 0.2, 0.28)),
                     ("grpo", lambda: ppo_clip(logp, gen_logp, adv, 0.2, 0.2)),
                     ("gspo", lambda: gspo(logp, gen_logp, adv, mask)),
                     ("dppo", lambda: dppo(logp, gen_logp, adv, 0.15, 0.15))]:
        loss, diag = policy_loss(logp, gen_logp, adv, mask, w, loss=name)
        torch.testing.assert_close(loss, aggregate(fn(), mask, group, "sample"))
        assert diag["n_tokens"] == int(mask.sum())
    assert DEFAULTS == {"cispo": {"eps_max": 4.0}, "dapo": {"eps_low": 0.2, "eps_high": 0.28},
                        "grpo": {"eps_low": 0.2, "eps_high": 0.2}, "gspo": {"eps_low": 3e-3, "eps_high": 5e-3},
                        "dppo": {"eps_low": 0.15, "eps_high": 0.15}}
    a, _ = policy_loss(logp, gen_logp, adv, mask, w, eps_max=1.0)  # kw reaches the loss
    torch.testing.assert_close(a, aggregate(cispo(logp, gen_logp, adv, 1.0), mask, group, "sample"))
    with pytest.raises(AssertionError, match="ppo"):
        policy_loss(logp, gen_logp, adv, mask, w, loss="ppo")
    with pytest.raises(AssertionError, match="eps_max"):
        policy_loss(logp, gen_logp, adv, mask, w, loss="cispo", eps_high=0.3)


def test_diagnostics_hand_computed():
    rho = torch.tensor([[0.5, 1.0, 5.0, 9.0], [1.5, 0.7, 1.0, 1.0]], dtype=f64)
    gen_logp = torch.tensor([[-1.0, -2.0, -3.0, -1.0], [-2.0, -1.0, -0.5, 0.0]], dtype=f64)
    logp = gen_logp + torch.log(rho)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)  # the 9.0 is padding
    adv = torch.tensor([1.0, -1.0], dtype=f64)
    w = aggregation_weights(mask, torch.tensor([0, 1]), dtype=f64)
    _, d = policy_loss(logp, gen_logp, adv, mask, w, loss="cispo")
    assert d["clip_frac"] == pytest.approx(1 / 6)  # only 5.0 is above eps_max = 4
    assert d["ratio_mean"] == pytest.approx((0.5 + 1 + 5 + 1.5 + 0.7 + 1) / 6)
    assert d["ratio_max"] == pytest.approx(5.0)
    assert d["mismatch_kl"] == pytest.approx(-sum(math.log(x) for x in (0.5, 1, 5, 1.5, 0.7, 1)) / 6)
    assert d["n_tokens"] == 6
    assert d["logratio_sq"] == pytest.approx(sum(math.log(x) ** 2 for x in (0.5, 1, 5, 1.5, 0.7, 1)) / 6)
    # what DAPO's rule would clip, whatever the loss: 5.0 above 1.28 with A>0, 0.7 below 0.8 with A<0
    assert d["dapo_clip_high"] == pytest.approx(1 / 6) and d["dapo_clip_low"] == pytest.approx(1 / 6)
    # their gradient weight |rho A w| (w = 1/6 a token): 5.0 and 0.7 of the six tokens' 0.5+1+5+1.5+0.7+1 = 9.7
    assert d["dapo_weight_high"] == pytest.approx(5 / 6) and d["dapo_weight_low"] == pytest.approx(0.7 / 6)
    assert d["weight_total"] == pytest.approx(9.7 / 6)
    # DAPO: A>0 clips 5.0 (not 0.5); A<0 clips 0.7 (not 1.5): 2 of 6
    _, d = policy_loss(logp, gen_logp, adv, mask, w, loss="dapo")
    assert d["clip_frac"] == pytest.approx(2 / 6)
    _, d = policy_loss(logp, gen_logp, adv, mask, w, loss="dapo", eps_high=5.0)
    assert d["clip_frac"] == pytest.approx(1 / 6) and d["dapo_clip_high"] == pytest.approx(1 / 6)
    # GSPO: s_0 = (0.5*1*5)^(1/3) = 1.357 > 1.005 with A>0: clipped ; s_1 = (1.05)^(1/3) > 1 with A<0: kept
    _, d = policy_loss(logp, gen_logp, adv, mask, w, loss="gspo")
    assert d["clip_frac"] == pytest.approx(3 / 6) and d["dapo_clip_low"] == pytest.approx(1 / 6)
    _, d = policy_loss(logp, gen_logp, adv, mask & False, w, loss="gspo")
    assert d == {"clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "mismatch_kl": 0.0, "logratio_sq": 0.0,
                 "dapo_clip_low": 0.0, "dapo_clip_high": 0.0, "dapo_weight_low": 0.0, "dapo_weight_high": 0.0,
                 "weight_total": 0.0, "seq_w": 0.0, "seq_w2": 0.0, "n_seqs": 0.0, "n_tokens": 0}


def test_dppo_hand_computed():
    """DPPO-Binary-TV masks a token whose probability moved more than 0.15 from the generator's the way A pushes,
    whatever its ratio: 0.1 -> 0.2 (ratio 2, which DAPO would clip) keeps its gradient, 0.5 -> 0.7 loses it."""
    p_gen = torch.tensor([[0.5, 0.1, 0.9], [0.9, 0.5, 0.3]], dtype=f64)
    p = torch.tensor([[0.7, 0.2, 0.95], [0.7, 0.45, 0.4]], dtype=f64)  # shifts +0.2 +0.1 +0.05 ; -0.2 -0.05 +0.1
    logp, adv = p.log().requires_grad_(), torch.tensor([1.0, -1.0], dtype=f64)
    per_token = dppo(logp, p_gen.log(), adv)
    rho = torch.tensor([[1.4, 2.0, 0.95 / 0.9], [0.7 / 0.9, 0.9, 4 / 3]], dtype=f64)
    keep = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=f64)
    torch.testing.assert_close(per_token, -keep * rho * adv[:, None] * p.log())
    per_token.sum().backward()
    torch.testing.assert_close(logp.grad, -keep * rho * adv[:, None])  # the ratio is a constant weight
    # A < 0 and a rise, A > 0 and a fall: never masked (the move is against A's push), however large
    torch.testing.assert_close(dppo(torch.tensor([[0.9]], dtype=f64).log(), torch.tensor([[0.1]], dtype=f64).log(),
                                    torch.tensor([-1.0], dtype=f64)), torch.tensor([[9 * math.log(0.9)]], dtype=f64))
    mask = torch.ones(2, 3, dtype=torch.bool)
    _, d = policy_loss(logp, p_gen.log(), adv, mask, aggregation_weights(mask, torch.tensor([0, 1]), dtype=f64),
                       loss="dppo")
    assert d["clip_frac"] == pytest.approx(2 / 6)
    _, d = policy_loss(logp, p_gen.log(), adv, mask, aggregation_weights(mask, torch.tensor([0, 1]), dtype=f64),
                       loss="dppo", eps_low=0.25, eps_high=0.05)  # the sides' own thresholds
    assert d["clip_frac"] == pytest.approx(2 / 6)  # +0.2 and +0.1 above 0.05; -0.2 within 0.25


def test_importance_corrections_hand_computed():
    """TIS: each token's term x sg(min(rho, C)); MIS: a sequence whose geometric-mean ratio is outside [1/C, C] drops
    out whole. The effective sample size over sequences, (sum w)^2 / (N sum w^2), is logged either way."""
    rho = torch.tensor([[0.5, 1.0, 5.0, 9.0], [4.0, 4.0, 1.0, 1.0]], dtype=f64)
    gen_logp = torch.tensor([[-1.0, -2.0, -3.0, -1.0], [-2.0, -1.5, -0.5, -1.0]], dtype=f64)
    logp = (gen_logp + rho.log()).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)  # the 9.0 is padding
    adv, group = torch.tensor([1.0, -1.0], dtype=f64), torch.tensor([0, 1])
    w = aggregation_weights(mask, group, dtype=f64)  # 1/6 a token
    base = cispo(logp, gen_logp, adv)  # -min(rho, 4) A logp
    tis, d = policy_loss(logp, gen_logp, adv, mask, w, is_correction="tis", is_cap=2.0)
    cap = torch.tensor([[0.5, 1.0, 2.0, 2.0], [2.0, 2.0, 1.0, 1.0]], dtype=f64)
    torch.testing.assert_close(tis, aggregate(base * cap, mask, group))
    (g,) = torch.autograd.grad(tis, logp)
    torch.testing.assert_close(g, -rho.clamp(max=4) * cap * adv[:, None] * mask / 6)  # constant multipliers
    # geometric means: (0.5 * 1 * 5)^(1/3) = 1.357 (kept), (4 * 4 * 1)^(1/3) = 2.52 (dropped at C = 2, kept at 3)
    mis, _ = policy_loss(logp, gen_logp, adv, mask, w, is_correction="mis", is_cap=2.0)
    torch.testing.assert_close(mis, aggregate(base * torch.tensor([[1.0], [0.0]], dtype=f64), mask, group))
    mis3, _ = policy_loss(logp, gen_logp, adv, mask, w, is_correction="mis", is_cap=3.0)
    torch.testing.assert_close(mis3, aggregate(base, mask, group))
    inv = (gen_logp - rho.log()).requires_grad_()  # ratios 1/rho: geometric means 0.737 (kept), 0.397 < 1/2 (dropped)
    mis_inv, _ = policy_loss(inv, gen_logp, adv, mask, w, is_correction="mis", is_cap=2.0)
    torch.testing.assert_close(mis_inv, aggregate(cispo(inv, gen_logp, adv) * torch.tensor([[1.0], [0.0]], dtype=f64),
                                                  mask, group))
    s = torch.tensor([2.5 ** (1 / 3), 16 ** (1 / 3)], dtype=f64)
    assert (d["seq_w"], d["seq_w2"], d["n_seqs"]) == (pytest.approx(s.sum().item()), pytest.approx(s.square().sum()
                                                                                                   .item()), 2)


# ----------------------------------------------------------------------------- token_logprobs


def naive_logprobs(hidden, weight, targets, temperature=1.0):
    logits = hidden.float() @ weight.float().T / temperature if hidden.dtype != f64 else hidden @ weight.T / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("chunk", [1, 4, 7, 18, 1000])  # B*T = 18: divides, does not divide, equal, larger
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_vs_naive(chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(2, 9, 8, generator=g, requires_grad=True)
    weight = torch.randn(33, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 33, (2, 9), generator=g)
    lp = token_logprobs(hidden, weight, targets, chunk=chunk, temperature=temperature)
    lp0 = naive_logprobs(hidden, weight, targets, temperature)
    torch.testing.assert_close(lp, lp0)
    assert lp.dtype == torch.float32 and lp.shape == (2, 9)
    c1 = torch.randn(2, 9, generator=g)  # gradients against autograd through the naive path
    grads = torch.autograd.grad((lp * c1).sum(), (hidden, weight))
    grads0 = torch.autograd.grad((lp0 * c1).sum(), (hidden, weight))
    for a, b in zip(grads, grads0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_token_logprobs_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, dtype=f64, generator=g, requires_grad=True)
    weight = torch.randn(6, 4, dtype=f64, generator=g, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3), generator=g)
    f = lambda h, w: token_logprobs(h, w, targets, chunk=4, temperature=0.7)  # noqa: E731
    assert torch.autograd.gradcheck(f, (hidden, weight))
    torch.testing.assert_close(f(hidden, weight), naive_logprobs(hidden, weight, targets, 0.7))


def test_head_logprobs_fp32_and_bf16_heads():
    """The trainer's head_logprobs follows the generator's head_logits arithmetic: the FP32 head equals the naive
    float32 path; a bf16 head runs its matmul in bf16 and so differs measurably."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 6, 16, generator=g) * 3, torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (2, 6), generator=g)
    fp32 = losses.head_logprobs(hidden, weight, targets, temperature=0.7)
    torch.testing.assert_close(fp32, naive_logprobs(hidden, weight, targets, 0.7))
    sampled = torch.log_softmax(losses.head_logits(hidden, weight, torch.bfloat16) / 0.7, -1)
    bf16 = losses.head_logprobs(hidden, weight, targets, temperature=0.7, head_dtype=torch.bfloat16)
    torch.testing.assert_close(bf16, sampled.gather(-1, targets[..., None])[..., 0])
    assert (bf16 - fp32).abs().max() > 1e-3


def test_token_logprobs_bf16_is_float32():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, 16, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(50, 16, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (3, 5), generator=g)
    lp = token_logprobs(hidden, weight, targets, chunk=4)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, naive_logprobs(hidden, weight, targets))  # bf16 inputs, fp32 math
    bf16_logits = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, targets[..., None])[..., 0]
    assert (bf16_logits - lp).abs().max() > 1e-3  # the bf16 head really is different
    lp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_token_logprobs_errors():
    h, w = torch.randn(1, 2, 4), torch.randn(5, 4)
    with pytest.raises(AssertionError, match="targets out of vocab"):
        token_logprobs(h, w, torch.tensor([[0, 5]]))
    with pytest.raises(AssertionError, match="targets"):
        token_logprobs(h, w, torch.zeros(1, 2))
    with pytest.raises(AssertionError, match="head_weight"):
        token_logprobs(h, torch.randn(5, 3), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(AssertionError, match="chunk"):
        token_logprobs(h, w, torch.zeros(1, 2, dtype=torch.long), chunk=0)


def test_module_stands_alone():
    src = open(losses.__file__).read()
    imports = [ln.split()[1] for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert set(imports) <= {"torch", "functools", "math"}
