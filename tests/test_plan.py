"""infra/plan.py, the --dry_run planner: every memory row and a verdict per GPU role, a configuration that cannot fit
says so, the tiny default prints memory too, and the activation figures stay calibrated to bench/trainer_memory.py.
In-process (scalerl.parse_args + infra.plan.plan) apart from one real `python scalerl.py --dry_run`."""
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import losses
import scalerl
import trainer
from conftest import WITHOUT_VLLM, run_command, scalerl_command
from engine import Sample
from infra import plan as planner

ROWS = ("parameters (fp32 master)", "gradients (fp32)", "optimizer state (AdamW m, v)", "unsharded units (FSDP2)",
        "activations, act_ckpt on", "activations, act_ckpt off", "FSDP2 gather/reduce staging",
        "unsharded fp32 grads (deferred)", "batch tensors (a micro-batch)",
        # on every GPU (a vLLM generator: beside vLLM's share, infra.vllm_engine.outside_share)
        "CUDA context, this process", "NCCL buffers", "margin", "engine weights", "KV cache",
        "CUDA context, vLLM's engine core", "LM head made fp32 (net)", "receive buffer (the largest bucket)",
        "reload's copy of the largest layer", "weight-sync buffers", "total")
BESIDE = ("CUDA context, this process", "NCCL buffers", "margin", "CUDA context, vLLM's engine core",
          "LM head made fp32 (net)", "receive buffer (the largest bucket)", "reload's copy of the largest layer")


def plan(*argv):
    return planner.plan(scalerl.parse_args([*argv, "--dry_run"]))


def table(text, at=40, width=15):
    """{row label: [figure per column]}, the column names, the verdicts (infra/plan.py's fixed-width table)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("memory per GPU"))

    def cells(line):
        return [line[i:i + width].strip() for i in range(at, len(line), width)]
    rows = {}
    for line in lines[head + 1:]:
        if not line.startswith("    ") or line.startswith("     "):
            break
        rows[line[:at].strip().removesuffix(" *")] = cells(line)
    return rows, cells(lines[head]), rows.pop("verdict")


@pytest.mark.parametrize("gpus, roles", [(8, ["trainer 0", "trainers 1-3", "generators"]),
                                         (80, ["trainer 0", "trainers 1-15", "generators"])])
def test_8b_plan_lists_every_row_and_a_verdict_per_role(gpus, roles):
    rows, names, verdicts = table(plan("--config=8b", f"--plan_gpus={gpus}"))
    assert names == roles
    assert list(rows) == list(ROWS)
    assert all(len(v) == len(roles) for v in rows.values()) and len(verdicts) == len(roles)
    assert set(verdicts) <= {"fits", "does not fit"}
    assert rows["KV cache"][:2] == ["-", "-"] and rows["parameters (fp32 master)"][-1] == "-"  # each role its own


def test_act_ckpt_counts_the_checkpointed_activations():
    off, _, _ = table(plan("--config=8b", "--act_ckpt=false"))
    on, _, _ = table(plan("--config=8b", "--act_ckpt=true"))
    assert float(on["activations, act_ckpt on"][1]) < float(on["activations, act_ckpt off"][1]) / 10
    drop = float(off["total"][1]) - float(on["total"][1])
    # the allocator's margin grows with them
    assert drop == pytest.approx((float(on["activations, act_ckpt off"][1]) - float(on["activations, act_ckpt on"][1]))
                                 * (1 + planner.FRAGMENTATION), abs=0.3)


@pytest.mark.parametrize("argv", [("--config=8b", "--plan_gpus=2", "--gen_ranks=1"),  # 16 B/param on one GPU
                                  ("--config=8b", "--plan_gpus=8", "--gen_ranks=6"),  # 2 trainer ranks: 8 B/param
                                  ("--micro_batch_tokens=100000000",)])  # the tiny model, a huge micro-batch
def test_a_configuration_that_cannot_fit_says_so(argv):
    text = plan(*argv, "--act_ckpt")
    assert table(text)[2][0] == "does not fit"
    assert any(change in text for change in ("which do", "more GPUs, or", "lower --slots or"))  # what to change


def test_the_tiny_default_prints_memory():
    text = plan()
    rows, names, verdicts = table(text)
    assert names == ["GPU 0"] and verdicts == ["fits"] and "memory per GPU, MB" in text
    assert float(rows["total"][0]) > 0


def test_a_micro_batch_below_one_sequence_is_noted():
    assert "holds no full sequence" in plan("--config=8b", "--micro_batch_tokens=8192")
    assert "holds no full sequence" not in plan("--config=8b", "--micro_batch_tokens=32768")


def test_the_sync_bucket_sets_the_sync_buffers_and_the_kv_cache():
    """Trainer rank 0 holds two buckets and a gathered tensor. A vLLM generator receives into one buffer beside vLLM's
    share (the fp32 head, a bucket of its own, sets the smallest): a larger bucket takes its room from the share."""
    big, _, _ = table(plan("--config=8b", "--sync_bucket_mb=4096"))
    small, _, _ = table(plan("--config=8b", "--sync_bucket_mb=512"))
    # trainer rank 0: the largest bucket of each of its two reused buffers (every other bucket), and the fp32 head
    # gathered whole; with 512 MB buckets the head's own bucket (2.49 GB) is the largest
    head = 4 * 151936 * 4096 / 1e9
    assert 2 * head < float(small["weight-sync buffers"][0]) <= 2 * head + (512 * 2 ** 20 + 0.4e9) / 1e9 + 0.05
    runs = planner.bucket_bytes(scalerl.parse_args(["--config=8b", "--sync_bucket_mb=4096", "--dry_run"]),
                                planner.KNOWN_SHAPES["Qwen/Qwen3-8B"])
    assert float(big["weight-sync buffers"][0]) == pytest.approx((max(runs[::2]) + max(runs[1::2])) / 1e9 + head,
                                                                 abs=0.06)
    recv = "receive buffer (the largest bucket)"
    # a bucket passes its limit by at most the rest of a decoder layer (0.39 GB in bf16 at 8B)
    assert float(small[recv][-1]) == 2.5 and 4096 * 2 ** 20 / 1e9 - 0.05 <= float(big[recv][-1]) <= 4.3 + 0.4
    assert float(big["KV cache"][-1]) < float(small["KV cache"][-1])
    assert float(big["total"][-1]) <= 80 and float(small["total"][-1]) <= 80


def test_an_8b_generator_fits_its_gpu_with_every_row_beside_vllms_share():
    """Every allocation beside vLLM's share is a row, the share is what they leave (at most 0.9 x 80 GB), and the plan
    prints what is left to spare."""
    for gpus in (8, 80):
        text = plan("--config=8b", f"--plan_gpus={gpus}")
        rows, names, verdicts = table(text)
        beside = sum(float(rows[r][-1]) for r in BESIDE)
        assert verdicts[-1] == "fits" and 7 < beside <= 8.0 + 0.05
        assert float(rows["engine weights"][-1]) + float(rows["KV cache"][-1]) == pytest.approx(72.0, abs=0.15)
        assert "vLLM's share 72.0 GB" in text and "GB of 80 to spare" in text


def test_one_node_plans_the_split_the_run_takes():
    """The paper's 80% generators leave 2 trainer ranks on 8 GPUs, which do not fit (nor do 3 once the CUDA context,
    NCCL's buffers, FSDP2's staging and the allocator's margin count): the plan takes the split a GPU run takes
    (infra.run.start through plan.settle), and names the one that fits where --gen_ranks asks for another."""
    text = plan("--config=8b", "--plan_gpus=8")
    assert "generator ranks 4-7 (4, engine vllm)" in text and "does not fit" not in text
    assert "generator ranks: 4, not --gen_share's" in text
    text = plan("--config=8b", "--plan_gpus=8", "--gen_ranks=5")
    assert "does not fit" in text and "--gen_ranks=4 gives 4 trainer ranks, which do" in text
    # --dry_run: the same options, vLLM installed or not
    cfg = scalerl.parse_args(["--config=8b", "--dry_run"])
    assert planner.fitting_gen_ranks(cfg, 8) == 4 and planner.fitting_gen_ranks(cfg, 80) == 64
    assert planner.fitting_gen_ranks(cfg, 8, gpu_gb=141) == 6  # an H200 node: 2 trainer ranks hold 113.6 GB each
    assert planner.fitting_gen_ranks(cfg, 2, gpu_gb=24) == 0  # no split fits
    assert planner.settle(cfg, 8)[0] == 4 and planner.settle(cfg, 80)[0] == 64


@pytest.mark.parametrize("preset", ["8b", "8b_32k", "8b_batch2048"])
@pytest.mark.parametrize("gpus", [8, 80])
def test_the_paper_presets_name_their_regime_and_time_out(preset, gpus):
    """Waits end on a rank's silence, not on the work's length: a preset's --dist_timeout=0 is 30 min of silence, and
    no estimate refuses it. The plan names the generators' regime: slot-bound where (k+1) B G / generators exceeds
    --slots (8b on 8 GPUs: 9 x 48 x 16 / 5 = 1,382 of 256; 8b_batch2048: 4,608 on 80), else lag-bound."""
    cfg = scalerl.parse_args([f"--config={preset}", "--dry_run"])
    g, timeout, problem = planner.settle(cfg, gpus)
    assert problem is None and timeout == 1800
    text = plan(f"--config={preset}", f"--plan_gpus={gpus}")
    assert "time-outs: a wait ends once a rank has been silent (no heartbeat) for --dist_timeout=1,800 s" in text
    want = 9 * cfg.batch_prompts * cfg.group_size / g
    bound = "slot" if want > cfg.slots else "lag"
    assert f"generators {bound}-bound: the lag bound lets {want:,.0f} completions into each" in text
    assert bound == ("lag" if gpus == 80 and preset != "8b_batch2048" else "slot")


def test_an_evaluation_that_outlasts_its_interval_is_refused():
    """An evaluation that outlasts --eval_every steps would queue up: a GPU job is refused at start, with the
    arithmetic."""
    problem = planner.settle(scalerl.parse_args(["--config=8b", "--eval_every=1", "--dry_run"]), 80)[2]
    assert "outlasts --eval_every=1 steps" in problem


def test_the_fp32_head_share_of_a_step_is_shown():
    """The FP32 head's true fp32 matmuls (no TF32) are a large part of an 8B step: the plan prints the share."""
    def head(*argv):
        line = next(x for x in plan("--config=8b", *argv).splitlines() if "head" in x and "of which the" in x)
        return float(line.split("(")[1].split("%")[0])
    assert 30 < head() < 60 and head("--fp32_head=false") < 10


@pytest.mark.parametrize("ckpt, measured_mib", [(False, 6109), (True, 1956)])
def test_activation_estimate_matches_the_bench(ckpt, measured_mib):
    """bench/trainer_memory.py --layers 28 (CPU, peak RSS): the whole Qwen3-0.6B shape, one 2 x 1024-token padded
    micro-batch, FP32 head; the plan's activations plus the head's fp32 weight and gradient within 15%."""
    L, H, I, nq, nkv, hd, V, tied = shape = planner.KNOWN_SHAPES["Qwen/Qwen3-0.6B"]
    est = planner.trainer_activations(shape, 2048, 1024, ckpt, 2) + 8 * V * H
    assert est / 2 ** 20 == pytest.approx(measured_mib, rel=0.15)


@pytest.mark.slow
def test_the_real_command_prints_the_plan():
    """The 8B preset's engine is vLLM, which --dry_run neither needs nor imports: planned here as if it were not
    installed (tests/without_vllm hides it from the process)."""
    p = run_command(scalerl_command("--config=8b", "--dry_run", "--plan_gpus=8"), timeout=120, env=WITHOUT_VLLM)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "weight-sync buffers" in p.stdout and "verdict" in p.stdout and "Traceback" not in p.stderr


def test_the_gpu_bench_runs_on_cpu():
    """bench/gpu.py's CPU twin: every part (train step with and without activation checkpointing, engine against
    generate, logprob gap, the weight path into the engine's parameters) on a tiny Qwen3 shape, as it runs on a GPU."""
    from bench import gpu
    out = gpu.main(["--device", "cpu", "--shape", "2,64,128,2,2,32,512,0", "--seq", "64", "--new", "8", "--slots",
                    "8", "--group", "4", "--prompts", "2", "--micro_batch_tokens", "128", "--steps", "1",
                    "--repeats", "1", "--attention", "sdpa,engine"])
    assert out["train_ckpt"]["tok_s"] > 0 and out["train_no_ckpt"]["plan_gb"] > 0
    assert min(out["engine"][k] for k in ("engine_tok_s_sdpa", "engine_tok_s_engine", "generate_tok_s")) > 0
    assert out["mismatch"]["tokens"] == 8 * 8 and out["mismatch"]["mean"] < 0.01
    assert out["sync"]["gb"] > 0


def test_the_interruptions_prefill_is_planned():
    """vLLM cannot append the interruption phrase to a running request: the resubmit prefills its prompt and thinking
    again after a weight update, a cost the plan states (and the engine counts, tests/test_vllm.py)."""
    assert "up to 14,336 tokens are\n    prefilled again" in plan("--config=8b")
    assert "interruption: vLLM" not in plan("--config=8b", "--interrupt=false")
    assert "interruption: vLLM" not in plan()  # the PyTorch engine writes the phrase into its KV cache


def test_a_split_that_leaves_no_trainer_is_one_line(capsys):
    """--gen_ranks as large as the planned world: the plan says so in one line and exits 2, no traceback."""
    with pytest.raises(SystemExit) as e:
        plan("--config=8b", "--plan_gpus=2", "--gen_ranks=5")
    assert e.value.code == 2 and "--gen_ranks=5 leaves no trainer rank in a world of 2" in capsys.readouterr().err


def device_bytes_per_micro_batch(monkeypatch, prompts, budget=64):
    """(bytes trainer.policy_gradient hands to .to(device), forward passes) for `prompts` groups of 4 completions of 16
    tokens each (prompt and completion), micro-batches of `budget` tokens: every micro-batch alike."""
    cfg = scalerl.Config(n_layer=1, n_embd=16, n_head=2, micro_batch_tokens=budget)
    policy = trainer.Policy(trainer.tiny_model(cfg, 20), 1.0)
    samples = [Sample(g, g, [3, 4, 5, 6], tokens=[7] * 12, logprobs=[-1.0] * 12, versions=[0] * 12,
                      forced=[False] * 12, reward=float(i % 2)) for g in range(prompts) for i in range(4)]
    adv = losses.group_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]))
    moved, passes, real = [0], [], torch.Tensor.to

    def to(self, *args, **kw):  # what policy_gradient itself hands to the device
        code = sys._getframe(1).f_code
        moved[0] += self.nbytes * (code.co_filename == trainer.__file__ and "policy_gradient" in code.co_qualname)
        return real(self, *args, **kw)
    monkeypatch.setattr(torch.Tensor, "to", to)
    policy.register_forward_hook(lambda *_: passes.append(1))
    trainer.policy_gradient(policy, samples, adv, cfg)
    monkeypatch.undo()
    return moved[0] / len(passes), len(passes)


def test_a_micro_batch_hands_the_device_its_own_bytes_not_the_batch(monkeypatch):
    """The batch stays on the host in its narrowest dtypes; each micro-batch goes to the device as it is used: 4x the
    prompts at the same --micro_batch_tokens hand the device the same bytes a micro-batch, the plan's TO_DEVICE a
    position (and 4 bytes a completion: its advantage)."""
    one, passes = device_bytes_per_micro_batch(monkeypatch, 2)
    four, passes4 = device_bytes_per_micro_batch(monkeypatch, 8)
    assert passes == 2 and passes4 == 8  # 4 sequences of 16 tokens a micro-batch of 64
    assert one == four == 4 * (16 * 5 + 15 * 10 + 4)  # ids int32 + attention bool; fp32 logprobs, weights; 2 bools
    assert 0.9 * 64 * planner.TO_DEVICE < one <= 64 * planner.TO_DEVICE


def test_the_fp32_head_costs_what_the_plan_counts():
    """losses._FP32HeadLogprobs, forward and backward, measured by torch's FlopCounterMode: 8VH a token (the logits,
    their recomputation, the hidden states' and the weight's gradients), the FLOPs the plan's step time takes."""
    N, H, V = 96, 32, 50
    h, w = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (1, N))
    with FlopCounterMode(display=False) as counter:
        losses.token_logprobs(h[None], w, targets, chunk=40).sum().backward()
    cfg = scalerl.parse_args(["--config=8b", "--dry_run"])
    assert counter.get_total_flops() == N * planner.HEAD_FLOPS[cfg.fp32_head] * V * H == N * 8 * V * H
    assert planner.HEAD_FLOPS[False] == 6  # autograd's: the forward, the hidden states' and the weight's gradients
