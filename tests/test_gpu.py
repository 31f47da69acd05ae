"""The CUDA path, where a GPU is present (skipped elsewhere): the engine's behaviour logprobs against the trainer's on
the GPU with a bf16 body and an FP32 or bf16 head, and a few real steps of `python scalerl.py` on the GPU.

Run: python -m pytest -m gpu -s   (prints the measured mismatches)
"""
import copy

import pytest
import torch

import losses
from conftest import read_jsonl, run_command, scalerl_command
from test_pipeline import engine, templates, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_mismatch(body_dtype, head_dtype):
    """Generator on the GPU in body_dtype; trainer on the GPU with fp32 master weights autocast to body_dtype."""
    m = tiny_model(vocab=512).cuda()
    with torch.no_grad():
        m.lm_head.weight *= 40  # confident logits, as in a trained model
    eng = engine(copy.deepcopy(m).to(body_dtype), slots=16, head_dtype=head_dtype, think=(20, 24))
    gaps = []
    for s in (s for g in eng.generate(templates(8), 4) for s in g):
        ids = torch.tensor([s.prompt_tokens + s.tokens], device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=body_dtype, enabled=body_dtype != torch.float32):
            h = m.model(input_ids=ids).last_hidden_state
        lp = losses.head_logprobs(h[:, :-1], m.lm_head.weight, ids[:, 1:], 1.0, head_dtype)[0]
        free = ~torch.tensor(s.forced, device="cuda")
        gaps.append((torch.tensor(s.logprobs, device="cuda") - lp[len(s.prompt_tokens) - 1:])[free])
    return torch.cat(gaps).abs().mean().item()


def test_engine_runs_on_the_gpu_and_fp32_head_narrows_the_mismatch():
    f32, bf = torch.float32, torch.bfloat16
    exact, low_head, fp32_head = gpu_mismatch(f32, f32), gpu_mismatch(bf, bf), gpu_mismatch(bf, f32)
    print(f"\nGPU mean |gen - train| logprob: fp32 {exact:.2e}, bf16 body + bf16 head {low_head:.2e}, "
          f"bf16 body + fp32 head {fp32_head:.2e}")
    assert exact < 1e-4 and fp32_head < low_head


def test_a_few_steps_on_the_gpu(tmp_path):
    out = tmp_path / "run"
    p = run_command(scalerl_command("--config=smoke", f"--out_dir={out}", "--dtype=bfloat16",
                                    "--zero_var_filter=false"), timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["train_tokens"] > 0 for r in train)
    print("\n" + "\n".join(line for line in p.stdout.splitlines() if line.startswith("step")))
