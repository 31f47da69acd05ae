"""The CUDA path, where a GPU is present (skipped elsewhere): the engine's behaviour logprobs against the mixed-
precision trainer's on the GPU, one FSDP2 rank over NCCL training a bf16 Qwen3 step with the FP32 head, the chunked
FP32 head's memory at 16,384 x 151,936, a weight update over NCCL into the PyTorch engine, the CUDA context and the
allocator's fragmentation against infra/plan.py's constants, and a few real steps of `python scalerl.py` on the GPU.

Run: python -m pytest -m gpu -s   (prints the measured mismatches)
"""
import copy

import pytest
import torch

import losses
import scalerl
import trainer
from conftest import read_jsonl, run_command, scalerl_command
from engine import Sample
from infra import dist
from test_pipeline import engine, templates, tiny_model, update_through_the_link

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_mismatch(head_dtype):
    """Generator on the GPU with bf16 parameters (an FP32 head in fp32); trainer on the GPU through FSDP2 mixed
    precision over a group of one (NCCL). Returns the mean |gen - train| logprob over sampled tokens."""
    m = tiny_model(vocab=512).cuda()
    with torch.no_grad():
        m.lm_head.weight *= 40  # confident logits, as in a trained model
    gm = copy.deepcopy(m)
    for n, p in gm.named_parameters():
        p.data = p.data.to(head_dtype if n == "lm_head.weight" else torch.bfloat16)
    samples = [s for g in engine(gm, slots=16, head_dtype=head_dtype, think=(20, 24)).generate(templates(8), 4)
               for s in g]
    ids, att, tmask, gen_logp, _ = (t.cuda() for t in trainer.rollout_tensors(samples, 0))
    policy = trainer.Policy(m, 1.0, head_dtype)
    dist.shard(policy, m.model.layers, dist.local_group(), torch.bfloat16)
    with torch.no_grad():
        return (policy(ids, att) - gen_logp)[tmask.bool()].abs().mean().item()


def test_engine_and_mixed_precision_trainer_agree_on_the_gpu():
    fp32_head, low_head = gpu_mismatch(torch.float32), gpu_mismatch(torch.bfloat16)
    print(f"\nGPU mean |gen - train| logprob, bf16 body: fp32 head {fp32_head:.2e}, bf16 head {low_head:.2e}")
    assert fp32_head < 0.02 and low_head < 0.05


def test_a_weight_update_over_nccl_lands_in_the_torch_engine():
    """The torchrun weight path's GPU half in a group of one (NCCL): bucket buffers on the GPU, broadcasts over NCCL,
    the engine's parameters as the landing; afterwards the engine samples with the trainer's logprobs."""
    gap = update_through_the_link("cuda")
    print(f"\nGPU mean |gen - train| logprob after an update through the link: {gap:.2e}")
    assert gap < 0.02


def test_one_fsdp2_rank_over_nccl_trains_a_bf16_qwen3_step():
    """A random-init small Qwen3 (the presets' architecture), one FSDP2 rank over NCCL: bf16 body, FP32 head unit,
    activation checkpointing; one real train step moves the fp32 masters."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=False)).cuda()
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    policy = dist.shard(trainer.Policy(lm, 1.0, torch.float32, 0, torch.bfloat16), lm.model.layers,
                        dist.local_group(), torch.bfloat16)
    before = {k: v.clone() for k, v in dist.full_state_dict(lm).items()}  # (one rank: views of the shards)
    gen = torch.Generator().manual_seed(0)
    groups = [[Sample(g, g, [5, 6, 7], tokens=torch.randint(8, 4096, (40,), generator=gen).tolist(),
                      logprobs=[-8.3] * 40, versions=[0] * 40, forced=[False] * 40, reward=float(i % 2))
               for i in range(4)] for g in range(4)]
    cfg = scalerl.Config(lr=1e-3, warmup_steps=0)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    stats = trainer.train_step(policy, opt, groups, cfg, 0)
    assert stats["finite"] and stats["n_tokens"] == 16 * 40
    weights = policy.state()
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert weights["lm_head.weight"].dtype == torch.float32  # the FP32 head
    after = dist.full_state_dict(lm)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any((after[k] - before[k]).abs().max() > 0 for k in before)


ALLOCATOR = """
import json, os, sys, torch
import scalerl, trainer
from engine import Sample
from infra import dist, run
from transformers import Qwen3Config, Qwen3ForCausalLM
run.start(scalerl.parse_args(["--out_dir", sys.argv[1]]))  # sets the allocator before CUDA starts
torch.zeros(1, device="cuda")
free, total = torch.cuda.mem_get_info()
context = total - free - torch.cuda.memory_reserved()  # the CUDA context (NCCL not started yet)
lm = Qwen3ForCausalLM(Qwen3Config(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                  tie_word_embeddings=False)).cuda()
lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
policy = dist.shard(trainer.Policy(lm, 1.0, torch.float32, 0, torch.bfloat16), lm.model.layers, dist.local_group(),
                    torch.bfloat16)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
groups = [[Sample(g, g, [5, 6, 7], tokens=torch.randint(8, 32768, (n,)).tolist(), logprobs=[-9.0] * n,
                  versions=[0] * n, forced=[False] * n, reward=float(n % 2)) for n in range(500, 796, 37)]
          for g in range(8)]
for step in range(3):
    trainer.train_step(policy, opt, groups, scalerl.Config(micro_batch_tokens=4096, warmup_steps=0), step)
print(json.dumps(dict(conf=os.environ["PYTORCH_CUDA_ALLOC_CONF"], context=context,
                      reserved=torch.cuda.max_memory_reserved(), allocated=torch.cuda.max_memory_allocated())))
"""


def test_the_cuda_context_and_the_allocators_fragmentation_fit_the_plan(tmp_path):
    """What only CUDA shows, against infra/plan.py's constants: the CUDA context, and with expandable segments (set by
    infra.run.start before CUDA starts) the allocator's peak reserved memory over its peak allocated in three bf16
    FSDP2 steps of a small Qwen3 over micro-batches of several lengths (the plan's margin: FRAGMENTATION)."""
    import json
    import subprocess
    import sys
    from conftest import ENV, ROOT
    from infra import plan
    env = {k: v for k, v in ENV.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    p = subprocess.run([sys.executable, "-c", ALLOCATOR, str(tmp_path / "run")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\nCUDA context {r['context'] / 2 ** 30:.2f} GiB (plan {plan.CUDA_CONTEXT / 2 ** 30:.2f}); peak reserved "
          f"{r['reserved'] / 2 ** 30:.2f} GiB over peak allocated {r['allocated'] / 2 ** 30:.2f} GiB")
    assert r["conf"] == "expandable_segments:True"
    assert r["context"] < 2 * plan.CUDA_CONTEXT
    assert r["reserved"] <= (1 + plan.FRAGMENTATION) * r["allocated"] + (64 << 20)


def test_chunked_fp32_head_memory_on_cuda():
    """The FP32 head at the paper's 16,384 tokens x Qwen3's 151,936 vocabulary: forward and backward stay far below
    the 10 GB that one float32 logits tensor of that size would take."""
    V, T, H = 151936, 16384, 1024
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    hidden = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, V, (1, T), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    losses.token_logprobs(hidden, w, targets).sum().backward()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    print(f"\nchunked FP32 head, {T} x {V:,}: peak extra {extra:.2f} GiB (one fp32 logits tensor: "
          f"{T * V * 4 / 2 ** 30:.1f} GiB)")
    assert extra < 3.0  # 2.16 GiB on the meta device: the head's fp32 copy and gradient, one chunk's logits


def test_a_few_steps_on_the_gpu(tmp_path):
    out = tmp_path / "run"
    p = run_command(scalerl_command("--config=smoke", f"--out_dir={out}", "--dtype=bfloat16",
                                    "--zero_var_filter=false"), timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "reward" in r]
    # a step whose groups all got one reward trains nothing (no signal): some step must have trained
    assert [r["step"] for r in train] == [1, 2, 3, 4] and any(r["train_tokens"] > 0 for r in train)
    print("\n" + "\n".join(line for line in p.stdout.splitlines() if line.startswith("step")))


def test_a_bucket_reaches_a_child_on_the_same_gpu_by_cuda_ipc():
    """The vLLM child engine's load path (infra.vllm_engine.share_in_worker, bucket_pairs) without vLLM, which the
    GPU machine lacks: the receive buffer is shared once by CUDA IPC with a child process that sees only this GPU
    (device index rewritten); then each of 200 buckets landed in it is named by its layout alone, and the child reads
    the parent's values exact. The parent's memory stays the buffer's: no copy per bucket."""
    import os
    import pickle
    import struct
    import subprocess
    import sys
    from conftest import ENV, ROOT
    from torch.multiprocessing.reductions import reduce_tensor
    from infra.dist import new_bucket
    shapes = {"a.weight": (64, 32), "b.weight": (64, 32), "c.bias": (64,)}
    run = [(n, torch.empty(s), torch.bfloat16) for n, s in shapes.items()]
    bufs = {}
    child = """import pickle, struct, sys, types
from infra.vllm_engine import bucket_pairs, share_in_worker
worker = types.SimpleNamespace()
share_in_worker(worker, sys.stdin.buffer.read(struct.unpack("q", sys.stdin.buffer.read(8))[0]))
while (n := sys.stdin.buffer.read(8)):
    pairs = bucket_pairs(worker, pickle.loads(sys.stdin.buffer.read(struct.unpack("q", n)[0])))
    out = pickle.dumps({n: (t.device.index, t.cpu()) for n, t in pairs})
    sys.stdout.buffer.write(struct.pack("q", len(out)) + out)
    sys.stdout.buffer.flush()
"""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    env = {**ENV, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": visible.split(",")[torch.cuda.current_device()]}
    p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                         cwd=ROOT)

    def send(message):
        p.stdin.write(struct.pack("q", len(message)) + message)
        p.stdin.flush()
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        new_bucket(run, "cuda", bufs)
        send(pickle.dumps(reduce_tensor(bufs[0])[1]))
        for i in range(200):
            _, parts = new_bucket(run, "cuda", bufs)  # the receive buffer, reused
            for x in parts:
                x.normal_()
            torch.cuda.synchronize()
            send(pickle.dumps(("bfloat16", [(n, shapes[n]) for n in shapes])))
            got = pickle.loads(p.stdout.read(struct.unpack("q", p.stdout.read(8))[0]))
            for x, n in zip(parts, shapes):  # on the child's only device, the parent's values
                assert got[n][0] == 0 and torch.equal(got[n][1], x.view(shapes[n]).cpu()), (i, n)
        assert torch.cuda.memory_allocated() - base <= bufs[0].numel() + (1 << 20)  # the buffer, not 200 copies
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert p.returncode == 0
