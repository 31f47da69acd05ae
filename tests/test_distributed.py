"""The run under torchrun: roles, FSDP2 parity, lag bound across ranks, multi-node rendezvous, faults that end the job.

1. Config: a world with no trainer rank left is refused with one clear line (in-process).
2. FSDP2 parity: 2 trainer ranks (this file run under torchrun) give the loss, gradients, clipped norm and AdamW
   update of 1 process on the same batch, to float round-off; the ranks run unequal micro-batch counts on purpose.
3. `torchrun --standalone --nproc_per_node=2 scalerl.py --config smoke`: 1 generator + 1 trainer rank (gloo); the lag
   bound holds, completions mixing policy versions appear, device-hours count both ranks. Then 3 ranks, 2 of them
   FSDP2 trainers: the loop runs end to end, each trainer rank writes its shard of the checkpoint, and one process
   exports the model from the shards.
4. Two `torchrun --nnodes=2` launches (c10d rendezvous on 127.0.0.1) train together; then the generator's process is
   killed and the trainer's launch ends within a bounded time with a message naming rank 1.
5. A generator that hangs (SIGSTOP) makes trainer rank 0 exit after --dist_timeout with a message naming it. Three
   launches (2 FSDP2 trainers, 1 generator): an evaluation longer than --dist_timeout is waited for at a checkpoint,
   and a killed generator still ends the job within --dist_timeout, its silence named.

All runs share one base directory (the warm start is computed once). Run: python -m pytest tests/test_distributed.py
(a minute or two on 2 CPU cores; `-m "not slow"` keeps only the in-process check).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TORCHRUN_ENV as ENV, free_port, kill, launch, nodes, read_jsonl, run_base, \
    torchrun_command as torchrun, wait_for_steps, worker_pids  # conftest also puts the root on sys.path
import losses
import scalerl
import trainer
from engine import Sample
from infra import dist, plan as planner


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_base(tmp_path_factory, "dist")  # the session's warm-start cache

# ---------------------------------------------------------------------------------------------------------------------
# 1. Roles


def test_world_without_trainer_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--gen_ranks=2 leaves no trainer rank"):
        dist.dist_init(gen_ranks=2)

# ---------------------------------------------------------------------------------------------------------------------
# 2. FSDP2 parity: the same batch through policy_gradient on 1 process and on 2 sharded trainer ranks

VOCAB, BUDGET = 20, 48


def parity_setup():
    """A tiny model config and a fixed batch: 5 groups of 3 completions of varied lengths, some forced tokens."""
    cfg = scalerl.Config(n_layer=2, n_embd=32, n_head=2, micro_batch_tokens=BUDGET, grad_clip=0.05)
    rng = random.Random(0)
    groups = []
    for gid in range(5):
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randint(3, 6))]
        g = []
        for _ in range(3):
            n = rng.randint(4, 18)
            g.append(Sample(gid, gid, prompt, tokens=[rng.randrange(1, VOCAB) for _ in range(n)],
                            logprobs=[-rng.uniform(1.5, 4) for _ in range(n)], versions=[0] * n,
                            forced=[rng.random() < 0.1 for _ in range(n)], reward=rng.choice([-1., 1.])))
        groups.append(g)
    return cfg, groups


def parity_step(policy, cfg, groups, rank=0, world=1):
    """policy_gradient, then what trainer.train_step does after it: clip, AdamW step."""
    samples = [s for g in groups for s in g]
    adv = losses.group_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]),
                                  norm=cfg.adv_norm)
    loss, sums, rmax = trainer.policy_gradient(policy, samples, adv, cfg, rank, world, version=0)
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    opt.step()
    return dict(loss=loss, sums=sums, ratio_max=rmax, grads=grads, gnorm=gnorm)


def fsdp_worker(out):
    """Run by torchrun with 2 ranks: both train, sharded; rank 0 saves what the test compares."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    d = dist.Dist(torch.distributed.get_rank(), 2, [0, 1], [], 60.0, {"trainer": torch.distributed.group.WORLD})
    cfg, groups = parity_setup()
    model = trainer.tiny_model(cfg, VOCAB)
    deferred = planner.defers(cfg, 2, 2)  # as infra.run.policy asks the plan
    policy = dist.shard(trainer.Policy(model, 1.0, torch.float32), model.model.layers, d.groups["trainer"])
    policy.defer_sync = deferred
    # FSDP2's reduce-scatters (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: DefaultReduceScatter) and
    # forward passes in the step
    scatters, passes, real = [], [], torch.distributed.reduce_scatter_single
    torch.distributed.reduce_scatter_single = lambda *a, **k: scatters.append(1) or real(*a, **k)
    policy.register_forward_hook(lambda *_: passes.append(1))
    r = parity_step(policy, cfg, groups, d.rank, 2)
    sums, maxes = dist.TrainerComm(d).reduce(dict(r["sums"], loss=r["loss"]), dict(ratio_max=r["ratio_max"]))
    grads = {n: g.full_tensor() for n, g in r["grads"].items()}
    res = dict(sums=sums, maxes=maxes, grads=grads, gnorm=r["gnorm"].full_tensor(),
               params=dist.full_state_dict(model), sharded=type(next(policy.parameters())).__name__,
               scatters=len(scatters), passes=len(passes), deferred=deferred)
    if d.rank == 0:
        torch.save(res, out)
    torch.distributed.destroy_process_group()


def test_rollouts_travel_as_tensors_at_12_bytes_a_token(monkeypatch):
    """send_groups packs each group (infra.dist.pack): int32 token ids, fp32 logprobs, int32 versions (a forced
    token's as ~version), the prompt once: on the wire (torch's own pickling for send_object_list) and in trainer rank
    0's inbox about infra.plan.WIRE bytes a token, where Python lists pickle to about 17; unpacked, the same Samples."""
    rng = random.Random(0)
    prompt = [rng.randrange(151936) for _ in range(300)]
    group = [Sample(7, 7, prompt, tokens=[rng.randrange(151936) for _ in range(n)],
                    logprobs=[-rng.random() for _ in range(n)], versions=[3 + (j > 900) for j in range(n)],
                    forced=[1000 <= j < 1020 for j in range(n)], reward=1.0) for n in range(2000, 2004)]
    sent = []
    monkeypatch.setattr(dist.dist, "send_object_list", lambda objs, **kw: sent.extend(objs))
    dist.send_groups(dist.Dist(1, 2, [0], [1], 60.0, {1: None}), ([(True, group)], {"epoch": 0}))
    wire, _ = torch.distributed.distributed_c10d._object_to_tensor(sent[0], "cpu", None)
    tokens = sum(len(s.tokens) for s in group)
    assert wire.numel() / tokens < planner.WIRE + 0.5
    (kept, packed), = sent[0][0]
    assert kept and sum(t.nbytes for t in packed[2:]) == planner.WIRE * tokens
    back = dist.unpack(packed)
    for s, b in zip(group, back):
        assert (b.prompt_tokens, b.tokens, b.versions, b.forced) == (s.prompt_tokens, s.tokens, s.versions, s.forced)
        assert b.logprobs == pytest.approx(s.logprobs, rel=1e-6) and (b.group, b.reward) == (s.group, s.reward)


@pytest.mark.slow
def test_fsdp2_two_trainer_ranks_match_one_process(tmp_path):
    cfg, groups = parity_setup()
    lengths = [len(s.prompt_tokens) + len(s.tokens) for g in groups for s in g]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    counts = [len(trainer.micro_batches(order[r::2], lengths, BUDGET)) for r in (0, 1)]
    assert counts[0] != counts[1] and min(counts) >= 2  # unequal: one rank runs a zero-gradient pass to keep step

    out = tmp_path / "fsdp.pt"
    p = subprocess.run(torchrun("--standalone", "--nproc_per_node=2", __file__, str(out)), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    two = torch.load(out, weights_only=False)
    assert two["sharded"] == "DTensor"
    # the plan chose one reduce-scatter a step (the tiny model's unsharded gradients fit): one per FSDP2 unit (2
    # decoder layers, the head, the root), not one per unit and micro-batch
    assert two["deferred"] and two["passes"] == max(counts) and two["scatters"] == 4

    model = trainer.tiny_model(cfg, VOCAB)
    one = parity_step(trainer.Policy(model, 1.0, torch.float32), cfg, groups)
    assert two["sums"]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["sums"]["n_tokens"] == one["sums"]["n_tokens"] > 0
    assert two["sums"]["fresh_tokens"] == one["sums"]["fresh_tokens"] > 0
    for k in ("clip_frac", "ratio_mean", "mismatch_kl", "logratio_sq", "dapo_clip_low", "dapo_clip_high", "fresh_gap",
              *losses.SUMS):
        assert two["sums"][k] == pytest.approx(one["sums"][k], rel=1e-5, abs=1e-6)
    assert two["maxes"]["ratio_max"] == pytest.approx(one["ratio_max"], rel=1e-6)
    assert set(two["grads"]) == set(one["grads"])
    scale = max(g.abs().max().item() for g in one["grads"].values())
    assert scale > 0
    for n, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][n], g, rtol=1e-4, atol=1e-5 * scale, msg=n)
    assert float(two["gnorm"]) == pytest.approx(float(one["gnorm"]), rel=1e-5)
    assert float(one["gnorm"]) > cfg.grad_clip  # clipping was active: the sharded norm mattered
    for n, v in model.state_dict().items():  # after clip + AdamW step
        torch.testing.assert_close(two["params"][n], v, rtol=1e-4, atol=1e-5, msg=n)


def test_a_batch_without_signal_makes_no_update():
    """With the zero-variance filter off, a batch whose every group has equal rewards reaches the trainer: no AdamW
    step (weight decay alone would move the weights), no optimizer state."""
    cfg, groups = parity_setup()
    for g in groups:
        for s in g:
            s.reward = g[0].reward
    model = trainer.tiny_model(cfg, VOCAB)
    policy, before = trainer.Policy(model, 1.0, torch.float32), {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    stats = trainer.train_step(policy, opt, groups, scalerl.Config(zero_var_filter=False, warmup_steps=0), 5)
    assert stats["n_tokens"] == 0 and not opt.state
    assert set(stats) == {"loss", "n_tokens", "finite", "lr", *trainer.METRICS}  # the row a trained step logs
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

def test_a_step_logs_the_mechanism_its_trust_region_acts_on():
    """train_step's diagnostics, recomputed from one forward of the same weights: the spread of log(pi_train / pi_gen)
    on loss tokens, the mismatch on the tokens these very weights sampled (version == step: the others, sampled a
    version behind, do not count), DAPO's clip shares by side, and the gradient norm before clipping."""
    cfg, groups = parity_setup()
    for g in groups[:2]:
        for s in g:
            s.versions = [4] * len(s.tokens)
    samples = [s for g in groups for s in g]
    policy = trainer.Policy(trainer.tiny_model(cfg, VOCAB), 1.0, torch.float32)
    ids, att, tmask, gen, _ = trainer.rollout_tensors(samples, 0)
    with torch.no_grad():
        gap = policy(ids, att) - gen
    m, fresh = tmask.bool(), tmask.bool() & (torch.arange(len(samples)) < 6)[:, None]
    adv = losses.group_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]))
    a, rho = adv[:, None].expand_as(gap)[m], gap[m].exp()
    stats = trainer.train_step(policy, torch.optim.AdamW(policy.parameters(), lr=0.0), groups, cfg, 4)
    assert set(stats) == {"loss", "n_tokens", "finite", "lr", *trainer.METRICS}
    assert stats["logratio_sd"] == pytest.approx(gap[m].std(correction=0).item(), rel=1e-4)
    assert stats["mismatch_kl"] == pytest.approx(-gap[m].mean().item(), rel=1e-4)
    assert stats["fresh_mismatch"] == pytest.approx(gap[fresh].abs().mean().item(), rel=1e-4)
    assert 0 < fresh.sum() < m.sum()
    assert stats["dapo_clip_low"] == pytest.approx(((a < 0) & (rho < 0.8)).float().mean().item())
    assert stats["dapo_clip_high"] == pytest.approx(((a > 0) & (rho > 1.28)).float().mean().item())
    assert stats["dapo_clip_low"] + stats["dapo_clip_high"] > 0
    # their share of the step's gradient weight |rho A w| (w: the whole batch's aggregation weights)
    w = losses.aggregation_weights(tmask, torch.tensor([s.group for s in samples]))[m]
    gw = (rho * a * w).abs()
    assert stats["dapo_grad_low"] == pytest.approx((gw[(a < 0) & (rho < 0.8)].sum() / gw.sum()).item(), rel=1e-5)
    assert stats["dapo_grad_high"] == pytest.approx((gw[(a > 0) & (rho > 1.28)].sum() / gw.sum()).item(), rel=1e-5)
    # the effective sample size over sequences, w the sequence ratio exp(mean log ratio over its loss tokens)
    seq_w = (torch.where(tmask.bool(), gap, 0).sum(1) / tmask.sum(1)).exp()
    assert stats["seq_ess"] == pytest.approx((seq_w.sum() ** 2 / (len(seq_w) * seq_w.square().sum())).item(), rel=1e-5)
    # the norm before clipping, as the same batch on the same initial weights gives it
    one = parity_step(trainer.Policy(trainer.tiny_model(cfg, VOCAB), 1.0, torch.float32), cfg, groups)
    assert stats["grad_norm"] == pytest.approx(float(one["gnorm"]), rel=1e-5) and stats["grad_norm"] > cfg.grad_clip
    # nothing sampled by the weights being trained: no figure, rather than a zero
    assert trainer.train_step(policy, torch.optim.AdamW(policy.parameters(), lr=0.0), groups, cfg, 9)[
        "fresh_mismatch"] is None

# ---------------------------------------------------------------------------------------------------------------------
# 3. One generator rank, one trainer rank


SMOKE = ["scalerl.py", "--config", "smoke", "--threads=1"]


def test_a_wait_on_the_weights_that_hangs_ends_in_one_line():
    """A hung NCCL broadcast raises nothing: the host just waits (until NCCL's watchdog aborts, 60 s after
    --dist_timeout, naming no wait). A bounded wait ends the process at --dist_timeout, naming what it waited for."""
    code = ("import time\nfrom infra import dist\njob = dist.Dist(rank=1, world=2, generators=[1], timeout=1.0)\n"
            "with dist.waiting_for(job, 'policy version 3 from trainer rank 0', bound=True):\n    time.sleep(60)")
    t = time.time()
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert time.time() - t < 30 and p.returncode == 1
    assert p.stderr.strip() == "error: generator rank 1 gave up waiting for policy version 3 from trainer rank 0 after 1 s"


def test_a_generator_visits_the_store_on_a_timer_not_every_engine_step(monkeypatch):
    """run_generator reads the job's TCPStore (stop, version, dropped, held-out requests) and adds its counts every
    dist.POLL_S, not at every engine step (64 generators made some 15k requests a second); the counts still add up
    to the tokens it generated. A real TCPStore and engine; trainer rank 0 is this test, which says stop after 2 s."""
    from datetime import timedelta
    import data
    import pipeline_rl
    from infra.run import make_engine
    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    calls = []

    class Counted:  # the store, each request counted
        def __getattr__(self, name):
            calls.append(name)
            return getattr(store, name)
    job = dist.Dist(rank=1, world=2, trainers=[0], generators=[1], timeout=30.0, store=Counted())
    sent = []
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    cfg = scalerl.Config(slots=8, think_min=8, think_max=12, answer_budget=5, max_prompt=64)
    engine = make_engine(cfg, trainer.tiny_model(cfg, len(tok)), tok, 0)
    rollouts = pipeline_rl.Rollouts(engine, pipeline_rl.PromptPool(data.arith_problems(40), seed=0), tok, 64)
    __import__("threading").Timer(2.0, lambda: store.add("stop", 2)).start()  # 2: stop (1: training over)
    t = time.time()
    dist.run_generator(job, rollouts, mode="pipeline", k=8, batch_prompts=4, group_size=2, state_path="/nonexistent",
                       save_every=10 ** 9, bucket_bytes=1 << 20, held_out=dist.HeldOut(rollouts, [], 2, cap=2),
                       send=lambda job, msg: sent.append(msg))  # the transport is not under test
    polls, steps, admitted = (time.time() - t) / dist.POLL_S + 1, engine.stats["decode_steps"], store.add("admitted", 0)
    assert steps > 10 and sum(len(m[0]) for m in sent if m) > 4 and None in sent  # it generated, sent, said it stopped
    assert store.add("gen_tokens", 0) == engine.stats["tokens"]  # its counts were flushed before it stopped
    # 6 requests a poll, one per group it admitted, and the flush when it stops (measured: 163-164 in 2 s, over 115
    # engine steps and 37 groups; a request per counter per step made 6 a step, 690 here)
    assert len(calls) <= 6 * (polls + 1) + admitted, (len(calls), polls, steps, admitted)


@pytest.mark.slow
def test_two_ranks_smoke(runs):
    out = runs / "two"
    p = subprocess.run(torchrun("--standalone", "--nproc_per_node=2", *SMOKE, f"--out_dir={out}", "--max_steps=6",
                                "--eval_every=3", "--sync_bucket_mb=1"),  # weights in 4 buckets of 1 MB or less
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "generator ranks [1]" in p.stdout
    meta = json.load(open(out / "config.json"))
    assert meta["ranks"] == {"trainers": [0], "generators": [1]}
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "pass_rate" not in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "pass_rate" in r] == [0, 3, 6]
    k = scalerl.PRESETS["smoke"].get("max_lag", scalerl.Config().max_lag)
    for r in train:
        assert r["policy_version"] == r["step"] and 0 <= r["lag_mean"] <= r["lag_max"] <= k
        assert r["gen_tok_s"] >= 0 and r["train_tokens"] >= 0 and r["gen_busy"] >= 0 and 0 <= r["train_busy"] <= 1
    wall = sum(r["dt"] for r in train)  # the generator's decode time over the run: a share of the wall time
    # at most the wall time, give or take decode steps straddling the step boundaries (generous for a busy machine)
    assert 0 < sum(r["gen_busy"] * r["dt"] for r in train) / wall <= 1.25 and sum(r["gen_tok_s"] for r in train) > 0
    assert any(r["mixed_version_frac"] > 0 for r in train)  # weights landed mid-completion
    assert any(r["lag_max"] >= 1 for r in train)  # and the trainer did use off-policy data
    total = 0.0
    for r in train:  # device-hours: wall time x 2 ranks
        total += r["dt"] * 2 / 3600
        assert r["device_hours"] == pytest.approx(total, rel=1e-9)
    ck = torch.load(out / "ckpt.pt", weights_only=True)  # the marker naming the trainer's shards
    assert ck["step"] == 6 and ck["version"] == 6 and "model" not in ck and ck["shards"] == "shards-000006"
    assert sorted(os.listdir(out / "shards-000006")) == [".metadata", "__0_0.distcp"]  # one trainer rank
    assert not [d for d in os.listdir(out) if d.startswith("shards-") and d != "shards-000006"]  # older ones gone


@pytest.mark.slow
def test_three_ranks_two_fsdp_trainers(runs):
    out = runs / "three"
    p = subprocess.run(torchrun("--standalone", "--nproc_per_node=3", *SMOKE, f"--out_dir={out}", "--max_steps=3",
                                "--gen_ranks=1", "--zero_var_filter=false"),  # every step trains
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "trainer ranks [0, 1] (FSDP2) | generator ranks [2]" in p.stdout
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" not in r]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["skipped_nonfinite"] == 0 for r in train)
    assert train[-1]["device_hours"] == pytest.approx(sum(r["dt"] for r in train) * 3 / 3600, rel=1e-9)
    ck = torch.load(out / "ckpt.pt", weights_only=True)  # each trainer rank wrote its shard, nothing gathered
    assert sorted(os.listdir(out / ck["shards"])) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    p = subprocess.run([sys.executable, "scalerl.py", f"--out_dir={out}", "--export"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)  # one process reads the shards in full
    assert p.returncode == 0, p.stderr[-3000:]
    from safetensors.torch import load_file
    hf = load_file(out / "hf" / "model.safetensors")
    cfg = scalerl.Config(**json.load(open(out / "config.json"))["config"])
    full = trainer.tiny_model(cfg, hf["model.embed_tokens.weight"].shape[0]).state_dict()
    assert {k: v.shape for k, v in hf.items()} == {k: v.shape for k, v in full.items()}

# ---------------------------------------------------------------------------------------------------------------------
# 4 and 5. Two launches on one machine; a rank that dies or hangs ends the job with a message


@pytest.mark.slow
def test_two_nodes_train_together_then_a_killed_rank_ends_the_job(runs):
    out = runs / "nodes"
    procs = nodes(2, runs / "node", *SMOKE, f"--out_dir={out}", "--max_steps=1000", "--eval_every=1000",
                  "--dist_timeout=20")
    try:
        wait_for_steps(out / "metrics.jsonl", 3, procs)  # trained together across the two launches
        ranks = worker_pids({p.pid for p in procs})
        assert set(ranks) == {0, 1} and ranks[0][1] != ranks[1][1]  # one rank per launch
        elapsed = kill(ranks[1][0], procs)
    finally:
        for p in procs:
            p.kill()
    trainer_log = (runs / f"node{[p.pid for p in procs].index(ranks[0][1])}.log").read_text()
    assert all(p.returncode != 0 for p in procs)
    # a closed connection is noticed at once (a second or two when quiet); the bound is generous for a busy machine
    assert elapsed < 60, elapsed
    line = [x for x in trainer_log.splitlines() if x.startswith("error: trainer rank 0")]
    assert line and "generator rank" in line[0] and "1" in line[0], trainer_log[-3000:]


@pytest.mark.slow
def test_a_long_evaluation_is_waited_for_and_a_killed_rank_still_ends_the_job(runs):
    """Three launches of one rank each (as three nodes: torchrun passes no death to another launch), two FSDP2 trainer
    ranks and a generator. At the step-2 checkpoint trainer rank 0 waits for an evaluation longer than
    --dist_timeout, trainer rank 1 at the gate before the next collective: both wait on while every rank lives
    (a flat time-out ended the job). The generator killed, its silence ends the job within --dist_timeout."""
    timeout, out = 8, runs / "silence"
    procs = nodes(3, out, *SMOKE, f"--out_dir={out}", "--max_steps=1000", "--eval_every=2", "--ckpt_every=2",
                  "--eval_prompts=1000", "--eval_samples=8", "--gen_ranks=1", f"--dist_timeout={timeout}")
    try:
        wait_for_steps(out / "metrics.jsonl", 2, procs)  # step 2's checkpoint waits for the step-0 evaluation
        time.sleep(2 * timeout)
        rows = read_jsonl(out / "metrics.jsonl", torn_ok=True)
        assert all(p.poll() is None for p in procs) and not any("pass_rate" in r for r in rows), rows[-1]
        assert [r["step"] for r in rows] == [1, 2]  # still waiting, alive
        ranks = worker_pids({p.pid for p in procs})
        elapsed = kill(ranks[2][0], procs)
    finally:
        for p in procs:
            p.kill()
    log = (runs / f"silence{[p.pid for p in procs].index(ranks[0][1])}.log").read_text()
    assert elapsed < timeout + 30, elapsed  # the silence, a heartbeat's check, and room for a busy machine
    line = [x for x in log.splitlines() if x.startswith("error: trainer rank 0 gave up waiting for the held-out")]
    assert line and ": generator rank 2 has been silent for " in line[0], log[-3000:]


@pytest.mark.slow
def test_trainer_ranks_that_do_not_share_the_run_directory_are_refused(runs):
    """Two launches (nodes) in different working directories with a relative --out_dir: the ranks on the second do not
    see the folder rank 0 writes, so checkpoint shards would scatter; the job stops at start in one line."""
    port, cwds = free_port(), [runs / "node-a", runs / "node-b"]
    script = os.path.join(ROOT, "scalerl.py")
    procs = []
    for i, cwd in enumerate(cwds):
        cwd.mkdir()
        cmd = torchrun("--nnodes=2", f"--node_rank={i}", "--nproc_per_node=2", "--rdzv_backend=c10d",
                       f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=scalerl-shared", script, *SMOKE[1:],
                       "--out_dir=run", "--gen_ranks=1")
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode != 0 for p in procs)
    line = [x for log in logs for x in log.splitlines() if x.startswith("error: rank 0: ranks [")]
    assert line and "do not see rank 0's run directory run" in line[0] and "filesystem every node shares" in line[0]
    assert not any(".shared-" in f for cwd in cwds if (cwd / "run").exists() for f in os.listdir(cwd / "run"))


@pytest.mark.slow
def test_hung_generator_times_out_with_a_message(runs):
    out = runs / "hang"
    p = launch(torchrun("--standalone", "--nproc_per_node=2", *SMOKE, f"--out_dir={out}", "--max_steps=1000",
                        "--eval_every=1000", "--dist_timeout=8"), runs / "hang.log")
    stopped = None
    try:
        wait_for_steps(out / "metrics.jsonl", 2, [p])
        stopped = worker_pids({p.pid})[1][0]
        os.kill(stopped, signal.SIGSTOP)
        t = time.time()
        while "error: " not in (runs / "hang.log").read_text() and time.time() - t < 120:
            time.sleep(0.2)
        elapsed = time.time() - t
        os.kill(stopped, signal.SIGCONT)  # a hung process, unlike a stopped one, takes torchrun's SIGTERM at once
        p.wait(timeout=60)
    finally:
        p.kill()
        if stopped:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log = (runs / "hang.log").read_text()
    assert p.returncode != 0
    assert elapsed < 8 + 40, elapsed  # --dist_timeout=8, plus generous room for a busy machine
    line = [x for x in log.splitlines() if x.startswith("error: trainer rank 0 gave up waiting")]
    assert line and "generator rank" in line[0] and "1" in line[0], log[-3000:]


if __name__ == "__main__":
    fsdp_worker(sys.argv[1])
