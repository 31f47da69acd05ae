"""One decode step's attention as the PyTorch engine runs it (one query per slot, a padding mask: the slots hold
different lengths), by method: time per call and error against a float64 reference.

Methods (q: (R, H, 1, D), k and v: (R, KV, T, D) views of the slot KV cache, mask (R, 1, 1, T)):
  sdpa        transformers' sdpa_attention_forward: with a mask it repeats K and V to the H query heads
              (repeat_kv), then scaled_dot_product_attention (the engine's decode attention until it measured this)
  sdpa_gqa    scaled_dot_product_attention(..., enable_gqa=True) with the mask: each KV head read once (the engine's
              engine.decode_attention, except in fp32 on a CPU)
  grouped     the G = H / KV query heads of each KV head as one matrix, two matmuls (engine.decode_attention in fp32
              on a CPU); on a GPU in bf16 with fp32 accumulation (torch.bmm's out_dtype)
  grouped_fp32  the same on q, k, v cast to fp32 first (a copy of the cache's keys and values)
Shapes default to Qwen3-8B (32 query heads, 8 KV heads, head dim 128) with 64 slots.

Run: python bench/decode_attention.py   (seconds on a GPU; on a CPU add --device cpu --dtype float32 --slots 8)
"""
import argparse
import time

import torch


class Module:  # what sdpa_attention_forward reads of the attention module
    def __init__(self, groups):
        self.num_key_value_groups, self.is_causal, self.training = groups, False, False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--keys", default="512,2048,8192", help="cached positions T, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    H, KV = (int(x) for x in a.heads.split(","))
    R, D, g = a.slots, a.head_dim, torch.Generator(dev).manual_seed(0)

    def grouped(q, k, v, m):
        (R, H, _, D), KV, T = q.shape, k.shape[1], k.shape[2]
        bmm = torch.bmm if q.dtype == torch.float32 else lambda x, y: torch.bmm(x, y, out_dtype=torch.float32)
        s = bmm(q.reshape(R * KV, H // KV, D), k.reshape(R * KV, T, D).transpose(1, 2)) * D ** -0.5
        w = torch.softmax(s.view(R, KV, H // KV, T) + m.float(), -1).to(v.dtype)
        return bmm(w.view(R * KV, H // KV, T), v.reshape(R * KV, T, D)).view(R, 1, H, D).to(q.dtype)

    methods = {
        "sdpa": lambda q, k, v, m: sdpa_attention_forward(Module(H // KV), q, k, v, m, scaling=D ** -0.5)[0],
        "sdpa_gqa": lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=m, enable_gqa=True).transpose(1, 2),
        "grouped": grouped,
        "grouped_fp32": lambda q, k, v, m: grouped(q.float(), k.float(), v.float(), m.float())}
    out = {}
    print(f"decode attention on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, {a.dtype}: "
          f"{R} slots, {H}/{KV} heads x {D}")
    for T in (int(x) for x in a.keys.split(",")):
        cache = torch.randn(2, R, KV, T + 64, D, device=dev, dtype=dtype, generator=g)  # the buffer is longer
        k, v = cache[0, :, :, :T], cache[1, :, :, :T]
        q = torch.randn(R, H, 1, D, device=dev, dtype=dtype, generator=g) * 2
        lengths = torch.randint(T // 2, T + 1, (R,), device=dev, generator=g)
        m = torch.where(torch.arange(T, device=dev) < lengths[:, None], 0.0, torch.finfo(dtype).min).to(dtype)
        m = m[:, None, None]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(H // KV, 1), v.double().repeat_interleave(H // KV, 1),
            attn_mask=m.double()).transpose(1, 2)
        line = []
        for name, f in methods.items():
            try:
                y = f(q, k, v, m)
                err = (y.double() - ref).abs().max().item()
                times = []
                for _ in range(a.repeats):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    f(q, k, v, m)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                out[name, T] = (min(times), err)
                line.append(f"{name} {min(times) * 1e3:.3f} ms (err {err:.1e})")
            except Exception as e:  # noqa: BLE001 -- a method this torch cannot run is reported, not fatal
                line.append(f"{name} failed: {str(e).splitlines()[0][:80]}")
        print(f"T {T:>5}: " + " | ".join(line), flush=True)
    return out


if __name__ == "__main__":
    main()
