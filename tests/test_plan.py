"""infra/plan.py, the --dry_run planner: every memory row and a verdict per GPU role, a configuration that cannot fit
says so, the tiny default prints memory too, and the activation figures stay calibrated to bench/trainer_memory.py.
In-process (scalerl.parse_args + infra.plan.plan) apart from one real `python scalerl.py --dry_run`."""
import pytest

import scalerl
from conftest import WITHOUT_VLLM, run_command, scalerl_command
from infra import plan as planner

ROWS = ("parameters (fp32 master)", "gradients (fp32)", "optimizer state (AdamW m, v)", "unsharded units (FSDP2)",
        "activations, act_ckpt on", "activations, act_ckpt off", "engine weights", "KV cache", "CUDA context",
        "weight-sync buffers", "total")


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


@pytest.mark.parametrize("gpus, roles", [(8, ["trainer 0", "trainer 1", "generators"]),
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
    assert drop == pytest.approx(float(on["activations, act_ckpt off"][1]) - float(on["activations, act_ckpt on"][1]),
                                 abs=0.2)


@pytest.mark.parametrize("argv", [("--config=8b", "--plan_gpus=2", "--gen_ranks=1"),  # 16 B/param on one GPU
                                  ("--config=8b", "--plan_gpus=8"),  # 2 trainer ranks: 8 B/param each, unsharded
                                  ("--micro_batch_tokens=100000000",)])  # the tiny model, a huge micro-batch
def test_a_configuration_that_cannot_fit_says_so(argv):
    _, _, verdicts = table(plan(*argv, "--act_ckpt"))
    assert verdicts[0] == "does not fit"


def test_the_tiny_default_prints_memory():
    text = plan()
    rows, names, verdicts = table(text)
    assert names == ["GPU 0"] and verdicts == ["fits"] and "memory per GPU, MB" in text
    assert float(rows["total"][0]) > 0


def test_a_micro_batch_below_one_sequence_is_noted():
    assert "holds no full sequence" in plan("--config=8b", "--micro_batch_tokens=8192")
    assert "holds no full sequence" not in plan("--config=8b", "--micro_batch_tokens=32768")


def test_the_sync_bucket_sets_the_sync_buffers_and_the_kv_cache():
    """Trainer rank 0 holds two buckets and a gathered tensor; a generator two, beside vLLM's share: the one it
    receives into and the fresh copy it hands to vLLM."""
    big, _, _ = table(plan("--config=8b", "--sync_bucket_mb=4096"))
    small, _, _ = table(plan("--config=8b", "--sync_bucket_mb=512"))
    assert float(big["weight-sync buffers"][0]) - float(small["weight-sync buffers"][0]) == pytest.approx(
        2 * 3584 * 2 ** 20 / 1e9, abs=0.1)
    # a generator's receive bucket lives in its own process, outside vLLM's share: the KV cache does not pay for it,
    # and the fp32 head (a bucket of its own) sets the smallest one
    assert small["KV cache"][-1] == big["KV cache"][-1] and float(small["weight-sync buffers"][-1]) == 5.0
    assert float(big["weight-sync buffers"][-1]) == pytest.approx(2 * 4096 * 2 ** 20 / 1e9, abs=0.1)


def test_one_node_names_the_split_that_fits():
    text = plan("--config=8b", "--plan_gpus=8")  # the paper's 80% generators leave 2 trainer ranks
    assert "does not fit" in text and "--gen_ranks=5 gives 3 trainer ranks, which do" in text
    assert "does not fit" not in plan("--config=8b", "--plan_gpus=8", "--gen_ranks=5")
    # what a GPU run takes when --gen_ranks is not given (infra/run.start): the share's split where it fits
    cfg = scalerl.parse_args(["--config=8b", "--dry_run"])  # --dry_run: the same options, vLLM installed or not
    assert planner.fitting_gen_ranks(cfg, 8) == 5 and planner.fitting_gen_ranks(cfg, 80) == 64
    assert planner.fitting_gen_ranks(cfg, 8, gpu_gb=141) == 6  # an H200 node: 2 trainer ranks hold 97.6 GB each
    assert planner.fitting_gen_ranks(cfg, 2, gpu_gb=24) == 0  # no split fits


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
