"""Trained tokens per second of the 2-rank pipeline (torchrun: 1 generator rank + 1 trainer rank, gloo) against the
single process, same config, same machine; and how busy each role was.

Both runs are real `scalerl.py` runs of `--steps` optimizer steps from the cached warm start (held-out evals only at
step 0 and at the end; they are outside every figure here). From metrics.jsonl, steps after the first `--skip`:
  trained tok/s   loss tokens trained / summed step wall time (dt)
  gen busy        single process: share of the step spent generating; 2 ranks: the generator rank's decode time
                  over the step's wall time (the rest is waiting: for weights, or for the lag bound to admit)
  train busy      share of the step in the optimizer step (forward, backward, update); the rest is waiting for
                  rollouts (2 ranks) or generating (single process)
In one process, generation and training alternate, so per step t = t_gen + t_train. With two ranks they overlap, so
t approaches max(t_gen, t_train) plus the weight broadcast: the speed-up approaches (t_gen + t_train) / max(...).
The single process runs with `--threads` torch threads (1, or 2: both cores, the default of `python scalerl.py`).

Run: python bench/distributed.py   (about 3 minutes on 2 CPU cores; `--steps 80` for steadier figures, extra
scalerl options after `--`, e.g. `-- --batch_prompts=32`)
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(name, cmd, out):
    t = time.time()
    p = subprocess.run(cmd + [f"--out_dir={out}"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        sys.exit(f"{name} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"pass_rate"' not in x], time.time() - t


def summary(rows, skip):
    rows = rows[skip:]
    wall = sum(r["dt"] for r in rows)
    mean = lambda k: sum(r[k] * r["dt"] for r in rows) / wall  # noqa: E731 -- time-weighted
    return dict(steps=len(rows), wall=wall, tok_s=sum(r["train_tokens"] for r in rows) / wall,
                gen_busy=mean("gen_busy"), train_busy=mean("train_busy"), lag=mean("lag_mean"),
                mixed=mean("mixed_version_frac"), reward=sum(r["reward"] for r in rows) / len(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out (start-up)")
    ap.add_argument("--threads", default="1,2", help="torch threads of the single-process runs")
    ap.add_argument("rest", nargs="*", help="scalerl options, after --")
    a = ap.parse_args()
    stamp = time.strftime("%H%M%S")
    common = [f"--max_steps={a.steps}", f"--eval_every={a.steps}", "--eval_prompts=16", "--dist_timeout=300", *a.rest]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores | {a.steps} steps, first {a.skip} skipped")
    res = {}
    for t in a.threads.split(","):
        res[f"1 process, {t} thread(s)"] = run("single", [sys.executable, "scalerl.py", f"--threads={t}", *common],
                                              f"out/bench-dist-{stamp}-single{t}")
    res["2 ranks (gen + train)"] = run("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node=2", "scalerl.py", "--threads=1", *common],
                                       f"out/bench-dist-{stamp}-2ranks")
    print(f"{'run':26s} {'trained tok/s':>13s} {'step s':>7s} {'gen busy':>8s} {'train busy':>10s} {'lag':>5s} "
          f"{'mixed':>6s} {'reward':>7s} {'total s':>8s}")
    base = None
    for name, (rows, total) in res.items():
        s = summary(rows, a.skip)
        base = base or s["tok_s"]
        print(f"{name:26s} {s['tok_s']:13.0f} {s['wall'] / s['steps']:7.3f} {s['gen_busy']:8.2f} "
              f"{s['train_busy']:10.2f} {s['lag']:5.2f} {s['mixed']:6.2f} {s['reward']:+7.3f} {total:8.0f}"
              f"   x{s['tok_s'] / base:.2f}")


if __name__ == "__main__":
    main()
