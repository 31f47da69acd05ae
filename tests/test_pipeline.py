"""Invariants of the generating side: logprobs, versions, forced tokens, lag bound, k=0 == synchronous.

Real components: a small `transformers` Llama, the PyTorch engine, and for the scheduler tests the whole generating
side of one process (infra.run.make_engine, pipeline_rl.Rollouts on the built-in arithmetic task, the Scheduler).
Run: python -m pytest tests/test_pipeline.py
"""
import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import data
import losses
import pipeline_rl
import scalerl
import trainer
from engine import Sample, TorchEngine, decode_attention, slot_attention
from infra import dist
from infra.run import make_engine

EOS, CLOSE, PHRASE = 1, 4, [7, 8, 9, 4]  # token ids: end of sequence, </think>, the interruption phrase


def tiny_model(seed=0, vocab=24):
    torch.manual_seed(seed)
    mc = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                     tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(mc)


def engine(model, slots=8, think=(10, 14), answer=5, interrupt=True, seed=0, **kw):
    return TorchEngine(model, slots=slots, max_prompt=8, think_budget=think, answer_budget=answer,
                       eos_id=EOS, think_close_ids=[CLOSE], interrupt_ids=PHRASE if interrupt else None,
                       seed=seed, **kw)


def templates(n, start=0):
    return [Sample(i, start + i, [5 + i % 7, 6, 2 + i % 3][: 2 + i % 2]) for i in range(n)]


def trainer_logprobs(model, s):
    ids = torch.tensor([s.prompt_tokens + s.tokens])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
    lp = losses.head_logprobs(h[:, :-1], model.lm_head.weight, ids[:, 1:])
    return lp[0, len(s.prompt_tokens) - 1:]


def test_behaviour_logprobs_match_trainer_fp32():
    m = tiny_model()
    out = engine(copy.deepcopy(m)).generate(templates(6), 3)
    assert [len(g) for g in out] == [3] * 6 and all(g[0].group == t.group for g, t in zip(out, templates(6)))
    err = 0.0
    for s in (s for g in out for s in g):
        assert len(s.tokens) == len(s.logprobs) == len(s.versions) == len(s.forced)
        free = ~torch.tensor(s.forced)
        err = max(err, (trainer_logprobs(m, s) - torch.tensor(s.logprobs))[free].abs().max().item())
    assert err < 2e-5  # same weights, fp32 everywhere: float round-off only (KV-cache decode vs full forward)


def bf16_rollouts(head_dtype=torch.float32, vocab=512):
    """A model with confident logits (magnitude ~10, as trained: bf16 rounding then bites) and 32 completions from
    an engine holding its parameters in bf16 (an untied FP32 head in fp32), as infra.run.make_engine builds it."""
    m = tiny_model(vocab=vocab)
    with torch.no_grad():
        m.lm_head.weight *= 40
    gm = copy.deepcopy(m)
    for n, p in gm.named_parameters():
        p.data = p.data.to(head_dtype if n == "lm_head.weight" else torch.bfloat16)
    samples = [s for g in engine(gm, slots=16, head_dtype=head_dtype, think=(20, 24)).generate(templates(8), 4)
               for s in g]
    return m, trainer.rollout_tensors(samples, 0)


def test_mixed_precision_trainer_computes_the_body_as_the_generator_holds_it():
    """FSDP2 mixed precision (one process: a group of one) runs the body on bf16 parameters, exactly a bf16 model's
    forward; fp32 master weights under autocast do not (fp32 residual stream), and sit further from the generator."""
    m, (ids, att, tmask, gen_logp, _) = bf16_rollouts()
    policy = trainer.Policy(copy.deepcopy(m), 1.0, torch.float32)
    dist.shard(policy, policy.lm.model.layers, dist.local_group(), torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the masters stay fp32
    pure = copy.deepcopy(m)
    for p in pure.model.parameters():
        p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():
        mixed = policy(ids, att)
        want = losses.head_logprobs(pure.model(input_ids=ids, attention_mask=att).last_hidden_state[:, :-1],
                                    pure.lm_head.weight, ids[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = m.model(input_ids=ids, attention_mask=att).last_hidden_state
        autocast = losses.head_logprobs(hidden[:, :-1], m.lm_head.weight, ids[:, 1:])
    keep = tmask.bool()
    assert (mixed - want)[keep].abs().max() < 1e-6
    gap = {k: (v - gen_logp)[keep].abs().mean().item() for k, v in (("mixed", mixed), ("autocast", autocast))}
    # measured on these tokens: 0.0085 (mixed) against 0.0150 (autocast); the rest is the engine's one-token decode
    # kernels against a full-sequence forward, in bf16
    assert gap["mixed"] < 0.75 * gap["autocast"], gap


def test_fp32_end_to_end_is_round_off_only():
    m = tiny_model(vocab=512)
    with torch.no_grad():
        m.lm_head.weight *= 40
    gaps = []
    for s in (s for g in engine(copy.deepcopy(m), slots=16, think=(20, 24)).generate(templates(8), 4) for s in g):
        free = ~torch.tensor(s.forced)
        gaps.append((torch.tensor(s.logprobs) - trainer_logprobs(m, s))[free])
    assert torch.cat(gaps).abs().mean().item() < 1e-5


@pytest.fixture
def never_stop(monkeypatch):
    """Make </think> and EOS unsampleable, so thinking always runs into its budget."""
    head = losses.head_logits

    def biased(hidden, weight, head_dtype=torch.float32, *finish):
        logits = head(hidden, weight, head_dtype, *finish)
        logits[..., [EOS, CLOSE]] = -1e4
        return logits
    monkeypatch.setattr(losses, "head_logits", biased)  # the engine samples through losses.head_logits


def test_forced_interruption_tokens_are_marked_and_budgets_hold(never_stop):
    out = engine(tiny_model(seed=3), think=(6, 9), answer=4).generate(templates(4), 2)
    for s in (s for g in out for s in g):
        assert s.interrupted and s.truncated  # budget hit, phrase forced, answer budget ran out (EOS suppressed)
        i = s.forced.index(True)
        assert 6 <= i <= 9 and s.tokens[i:i + len(PHRASE)] == PHRASE
        assert s.forced[i:i + len(PHRASE)] == [True] * len(PHRASE) and sum(s.forced) == len(PHRASE)
        assert all(lp == 0.0 for lp, f in zip(s.logprobs, s.forced) if f)
        assert len(s.tokens) == i + len(PHRASE) + 4
    off = engine(tiny_model(seed=3), think=(6, 9), interrupt=False)
    for s in (s for g in off.generate(templates(4), 2) for s in g):
        assert s.truncated and not s.interrupted and not any(s.forced) and 6 <= len(s.tokens) <= 9


def head_ref_logprobs(model, s):
    """Full-sequence recompute through losses.head_logits (so the never_stop bias applies here too)."""
    ids = torch.tensor([s.prompt_tokens + s.tokens])
    with torch.no_grad():
        logits = losses.head_logits(model.model(input_ids=ids).last_hidden_state[:, :-1], model.lm_head.weight)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
    return lp[len(s.prompt_tokens) - 1:]


def test_in_flight_update_keeps_kv_and_tags_new_version(never_stop):
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    eng = engine(copy.deepcopy(old), think=(30, 30), answer=3)
    for t in templates(4):
        eng.add(t, 2)
    for _ in range(6):
        assert eng.step() == []
    eng.load_weights(new, version=1)
    done = []
    while eng.busy:
        done += eng.step()
    for s in (s for g in done for s in g):
        v = s.versions
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v)  # mixed versions, switch once, in order
        cut = v.index(1)
        free = ~torch.tensor(s.forced)
        gap_old = (head_ref_logprobs(old, s) - torch.tensor(s.logprobs)).abs()
        assert gap_old[:cut].max() < 2e-5  # tokens before the update: the old policy's numbers
        after_old = gap_old[cut:][free[cut:]].max().item()
        assert after_old > 1e-2  # tokens after it come from the new weights (over the old KV cache)


def perturb(model, step):
    """Stand-in for an optimizer step: a deterministic weight change."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


TOK = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")  # <eos>=1 and </think>=4, as above
PROBLEMS = data.arith_problems(40, levels=(1, 2))


def rollouts(model, seed=0):
    """One process's generating side, as scalerl.main builds it: an engine from a Config (its own copy of `model`),
    the curriculum over the built-in arithmetic task, prompts through the tokenizer, rewards from the verifier."""
    cfg = scalerl.Config(slots=6, think_min=8, think_max=12, answer_budget=5, max_prompt=64)
    return pipeline_rl.Rollouts(make_engine(cfg, model, TOK, seed), pipeline_rl.PromptPool(PROBLEMS, seed=seed), TOK,
                                cfg.max_prompt)


def run_scheduler(mode, k, steps=6, B=3, G=2, decode_per_step=4):
    learner = tiny_model(vocab=len(TOK))  # the trainer's weights
    policy = trainer.Policy(learner, 1.0)
    sched = pipeline_rl.Scheduler(rollouts(learner), mode=mode, k=k, batch_prompts=B, group_size=G,
                                  decode_per_step=decode_per_step)
    batches, lags = [], []
    for step in range(steps):
        batch = sched.next_batch()
        groups = batch.groups
        assert len(groups) == B and all(len(g) == G for g in groups)
        assert [g[0].group for g in groups] == sorted(g[0].group for g in groups)  # admission order
        assert all(s.reward in (-1.0, 1.0) for g in groups for s in g)  # scored by the verifier
        assert batch.kept == [g for g in groups if len({s.reward for s in g}) > 1]  # the zero-variance filter
        lags.append(max(sched.version - v for g in groups for s in g for v in s.versions))  # forced tokens too
        assert batch.lag_max <= lags[-1] and 0 <= batch.lag_mean <= batch.lag_max <= k
        batches.append(groups)
        perturb(learner, step)
        sched.push_weights(policy)
    return batches, lags, sched


@pytest.mark.parametrize("mode,k", [("pipeline", 0), ("pipeline", 1), ("pipeline", 3), ("ppo", 1), ("ppo", 3)])
def test_lag_never_exceeds_k(mode, k):
    batches, lags, sched = run_scheduler(mode, k)
    assert max(lags) <= k
    if k >= (1 if mode == "pipeline" else 2):  # off-policy data really appears (PPO-off-policy-k lags up to k-1)
        assert max(lags) >= 1
    if mode == "pipeline" and k >= 1:  # in-flight updates: some completion holds tokens of two versions
        assert any(len(set(s.versions)) > 1 for b in batches for g in b for s in g)
    assert sched.totals()["tokens"] > 0
    assert sched.rollouts.pool.groups_seen == sum(map(len, batches))  # each trained group recorded once


def test_pipeline_k0_equals_synchronous_ppo_k1():
    a, la, _ = run_scheduler("pipeline", 0)
    b, lb, _ = run_scheduler("ppo", 1)
    assert la == lb == [0] * len(la)
    for ba, bb in zip(a, b):
        for ga, gb in zip(ba, bb):
            for sa, sb in zip(ga, gb):
                assert sa.prompt_id == sb.prompt_id and sa.reward == sb.reward
                assert sa.tokens == sb.tokens and sa.logprobs == sb.logprobs and sa.versions == sb.versions


def test_continuous_batching_refills_slots_and_shares_prefill():
    m = tiny_model()
    eng = engine(copy.deepcopy(m), slots=5)
    out = eng.generate(templates(6), 4)  # 24 completions through 5 slots: groups start in pieces
    assert sum(len(g) for g in out) == 24
    assert eng.stats["busy_slot_steps"] / (eng.stats["decode_steps"] * 5) > 0.6
    assert eng.stats["prefills"] < 24  # a split group copies its prompt's KV from a running sibling
    for s in (s for g in out for s in g):  # ... and the copied cache gives the same numbers as a full forward
        free = ~torch.tensor(s.forced)
        assert (trainer_logprobs(m, s) - torch.tensor(s.logprobs))[free].abs().max() < 2e-5
    with pytest.raises(AssertionError, match="max_prompt"):
        eng.add(Sample(0, 99, [5] * 9), 1)


def test_shared_forwards_keep_logprobs_exact(monkeypatch):
    """Prompts admitted together share one right-padded prefill, slots interrupted together one phrase write, running
    slots move down as others finish, decode attention reads per-row horizons: still the trainer's numbers."""
    seen = dict(prefill=0, phrase=0, horizons=0)
    attend = slot_attention

    def spy(module, query, key, value, mask, horizon=None, **kw):
        seen["horizons"] += horizon is not None
        return attend(module, query, key, value, mask, horizon=horizon, **kw)
    monkeypatch.setattr("engine.slot_attention", spy)  # registered when the engine is built
    m = tiny_model()
    phrase = [7, 8, 9] * 6 + [CLOSE]  # long enough that interrupted slots read far more keys than the others
    eng = TorchEngine(copy.deepcopy(m), slots=8, max_prompt=8, think_budget=(3, 5), answer_budget=6,
                      eos_id=EOS, think_close_ids=[CLOSE], interrupt_ids=phrase)
    forward = eng._forward

    def counting(rows, tokens, pos):
        if not isinstance(rows, range) and len(rows) > 1:
            seen["phrase" if len(tokens[0]) == len(phrase) else "prefill"] += 1
        return forward(rows, tokens, pos)
    monkeypatch.setattr(eng, "_forward", counting)
    out = eng.generate(templates(10), 3)
    assert min(seen.values()) > 0, seen
    for s in (s for g in out for s in g):
        free = ~torch.tensor(s.forced)
        assert (trainer_logprobs(m, s) - torch.tensor(s.logprobs))[free].abs().max() < 2e-5


def test_bad_scheduler_settings_are_refused():
    """An invariant inside; the user's message is infra.cli.validate's (tests/test_scalerl.py)."""
    side = rollouts(tiny_model(vocab=len(TOK)))
    with pytest.raises(AssertionError):
        pipeline_rl.Scheduler(side, mode="ppo", k=0, batch_prompts=1, group_size=2)
    with pytest.raises(AssertionError):
        pipeline_rl.Scheduler(side, mode="async", k=1, batch_prompts=1, group_size=2)


def test_trainer_tensors_mask_forced_tokens_and_align_logprobs(never_stop):
    m = tiny_model(seed=3)
    samples = [s for g in engine(copy.deepcopy(m), think=(6, 9), answer=4).generate(templates(3), 2) for s in g]
    ids, att, tmask, gen_logp, versions = trainer.rollout_tensors(samples, pad_id=0)
    for i, s in enumerate(samples):
        P, n = len(s.prompt_tokens), len(s.tokens)
        assert ids[i, P:P + n].tolist() == s.tokens and att[i].sum() == P + n
        # target position j predicts ids[j + 1]: the completion occupies positions P-1 .. P+n-2
        want = [0.0] * (P - 1) + [0.0 if f else 1.0 for f in s.forced] + [0.0] * (tmask.shape[1] - P + 1 - n)
        assert tmask[i].tolist() == want and sum(s.forced) == len(PHRASE)
        assert torch.equal(gen_logp[i, P - 1:P - 1 + n], torch.tensor(s.logprobs))
        assert versions[i].tolist() == [-1] * (P - 1) + s.versions + [-1] * (tmask.shape[1] - P + 1 - n)


def pushed(link, policy):
    """The tensors TrainerLink.push_weights broadcasts for `policy`, in order (each has landed)."""
    sent, broadcast = [], torch.distributed.broadcast
    try:
        torch.distributed.broadcast = lambda t, **kw: (sent.append(t), broadcast(t, **kw))[1]
        link.push_weights(policy)
        link._land()
    finally:
        torch.distributed.broadcast = broadcast
    return sent


def update_through_the_link(device):
    """One weight update on the torchrun path, in a process group of one (gloo on CPU, NCCL on a GPU): trainer rank 0's
    TrainerLink.push_weights casts a bf16-body, FP32-head policy into its two buckets and broadcasts them; the
    generator's PyTorch engine, built from other weights, takes each bucket where receive_weights lands it (its own
    parameters: `landing`). In a group of one a broadcast moves nothing, so the bytes cross by a copy. Returns the
    mean |behaviour - trainer| logprob of the engine's samples afterwards, and the bf16 trainer's own gap."""
    m = tiny_model(vocab=512).to(device)
    with torch.no_grad():
        m.lm_head.weight *= 40
    other = tiny_model(seed=3, vocab=512).to(device)
    for n, p in other.named_parameters():
        p.data = p.data.to(torch.float32 if n == "lm_head.weight" else torch.bfloat16)
    eng = engine(other, slots=16, head_dtype=torch.float32, think=(20, 24))
    policy = trainer.Policy(m, 1.0, torch.float32, 0, torch.bfloat16)
    dist.shard(policy, m.model.layers, dist.local_group(), torch.bfloat16)
    job = dist.Dist(groups={"weights": dist.local_group()}, store=torch.distributed.HashStore())
    link = dist.TrainerLink(job, k=1, batch_prompts=1, bucket_bytes=1 << 30)  # two buckets: body, head
    sent = pushed(link, policy)
    runs = list(dist.buckets(((n, p, p.dtype) for n, p in eng.model.named_parameters()), 1 << 30))
    assert [r[0][2] for r in runs] == [torch.bfloat16, torch.float32] and len(sent) == 2
    for run, flat in zip(runs, sent):
        assert flat.device.type == torch.device(device).type
        eng.landing(run).copy_(flat)  # the wire
    eng.version = 1
    want = policy.state()
    for n, p in eng.model.named_parameters():  # every parameter arrived, cast as the export casts it
        assert torch.equal(p, want[n]), n
    samples = [s for g in eng.generate(templates(8), 4) for s in g]
    assert all(set(s.versions) == {1} for s in samples)
    ids, att, tmask, gen_logp, _ = (t.to(device) for t in trainer.rollout_tensors(samples, 0))
    with torch.no_grad():
        return (policy(ids, att) - gen_logp)[tmask.bool()].abs().mean().item()


def test_a_tensor_larger_than_a_bucket_is_sent_from_a_copy():
    """A bucket of one tensor over the limit goes as its own tensor, never the live parameter: the next optimizer step
    changes the parameter while the broadcast may still be in flight."""
    m = tiny_model(vocab=512)
    policy = trainer.Policy(m, 1.0, torch.float32)
    job = dist.Dist(groups={"weights": dist.local_group()}, store=torch.distributed.HashStore())
    link = dist.TrainerLink(job, k=1, batch_prompts=1, bucket_bytes=1 << 10)  # 1 KB: every matrix over it
    sent = pushed(link, policy)
    live = {p.data_ptr() for p in m.parameters()}
    assert len(sent) >= 5 and not live & {t.data_ptr() for t in sent}


def test_a_weight_update_through_the_link_lands_in_the_engines_parameters():
    assert update_through_the_link("cpu") < 0.02  # bf16 body: the engine's decode against the trainer's forward


@pytest.mark.parametrize("dtype, fp32_head", [("bfloat16", True), ("bfloat16", False), ("float32", True)])
def test_weight_buckets_agree_between_trainer_and_generator(dtype, fp32_head):
    """Under torchrun trainer rank 0 packs the weights (cast while copied) into buckets and every generator rank forms
    the same buckets from its engine's parameters: the same names, shapes, dtypes and sizes, in the same order."""
    cfg = scalerl.Config(dtype=dtype, fp32_head=fp32_head)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    model = trainer.tiny_model(cfg, len(tok))
    engine = make_engine(cfg, model, tok, 0)
    body = getattr(torch, dtype)
    policy = trainer.Policy(model, 1.0, torch.float32 if fp32_head else body, 0, body)
    limit = 64 << 10  # 64 KB: each decoder layer of the tiny model over it, a bucket of its own

    def layout(named):
        return [[(n, tuple(t.shape), d) for n, t, d in run] for run in dist.buckets(named, limit)]
    sent = layout(policy.weights())
    spec = layout((n, p, p.dtype) for n, p in engine.model.named_parameters())
    assert sent == spec and len(sent) >= cfg.n_layer + 1  # a bucket per decoder layer at least, and the head's
    assert {d for run in sent for *_, d in run} == ({torch.bfloat16, torch.float32} if dtype == "bfloat16" and fp32_head
                                                    else {body})
    layer = lambda n: n.split(".")[2] if ".layers." in n else n  # noqa: E731
    for run, nxt in zip(sent, sent[1:]):  # a decoder layer is never split between buckets
        assert layer(run[-1][0]) != layer(nxt[0][0]) or run[-1][2] != nxt[0][2]
    for run in sent:  # within the limit but for the last layer, which it does not split
        assert sum(math.prod(s) * d.itemsize for n, s, d in run if layer(n) != layer(run[-1][0])) <= limit


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_reads_each_kv_head_for_its_query_heads(dtype, tol):
    """engine.decode_attention (fp32 on a CPU: two matmuls; otherwise SDPA with enable_gqa, the GPU's path) against
    float64 attention over K and V repeated to the query heads, on views of a longer cache with a padding mask."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 8, 1, 32, generator=g)
    cache = torch.randn(2, 6, 2, 40, 32, generator=g)
    k, v = cache[0, :, :, :25], cache[1, :, :, :25]  # (R, KV, T, D) views with the buffer's stride, as in SlotCache
    lengths = torch.tensor([25, 3, 17, 25, 9, 1])
    mask = torch.where(torch.arange(25) < lengths[:, None], 0.0, torch.finfo(dtype).min)[:, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1),
        attn_mask=mask.double().clamp(min=-1e30)).transpose(1, 2)
    got = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), 32 ** -0.5)
    assert got.shape == (6, 1, 8, 32) and got.dtype == dtype
    assert (got.double() - want).abs().max() < tol
