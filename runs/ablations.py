"""runs/ablations.py: the paper's comparisons in miniature, on the CPU task, each fitted with sigmoid_fit.

    python runs/ablations.py                 # every run (2 at a time; 2-process runs alone), then the report
    python runs/ablations.py --jobs 1 --only scalerl,ppo
    python runs/ablations.py --report        # fits and figures from whatever runs have finished

Each run is `python scalerl.py --out_dir=OUT/<name> <flags>` with the defaults of the tiny preset otherwise,
so every run has the same length. A finished run (an eval row at its last step) is skipped; an interrupted one is
continued with --resume. Logs go to OUT/<name>/stdout.log. The report fits every comparison against cpu_hours (the
training process's CPU time; device_hours is wall time and grows with the machine's load when runs share it),
writes OUT/<comparison>.png and OUT/results.md. The 2-process runs are `torchrun --nproc_per_node=2 scalerl.py ...`
(a generator rank and a trainer rank, one thread each), launched one at a time after the others, and fitted against
device_hours (wall time x 2 ranks, the paper's axis: where a generator never idles, it shows).

The comparisons (the paper's section in brackets):
  predictability  fit the default run on its first half, predict the second        (Sec. 2.1, Fig. 1)
  off_policy      PipelineRL-2 vs PPO-off-policy-2, in one process                  (Sec. 3.1, Fig. 4a)
  off_policy_2proc  the same with a generator rank and a trainer rank (torchrun)    (Sec. 3.1, Fig. 4a)
  precision       FP32 head + FP32 body vs bf16 head + bf16 body                     (Sec. 3.2, Fig. 5b)
  loss            CISPO vs DAPO, GSPO, GRPO                                          (Sec. 3.2, Fig. 5a)
  leave_one_out   ScaleRL vs one choice reverted at a time                           (Sec. 4, Fig. 8)
  noise           the default over three seeds: this task's own margin on A          (Sec. 2.1, App. A.5)
"""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sigmoid_fit  # noqa: E402

RUNS = {
    "scalerl": [],                                             # the default: ScaleRL on the tiny task, seed 0
    "seed1": ["--seed=1"],
    "seed2": ["--seed=2"],
    "ppo_off_policy": ["--off_policy=ppo"],                    # PPO-off-policy-2 (the default's k)
    "bf16_head_body": ["--dtype=bfloat16", "--fp32_head=false"],
    "dapo": ["--loss=dapo"],
    "gspo": ["--loss=gspo"],
    "grpo": ["--loss=grpo"],
    "no_zero_var_filter": ["--zero_var_filter=false"],
    "no_npr": ["--npr=false"],
    "sample_agg": ["--agg=sample"],
    "prompt_adv_norm": ["--adv_norm=prompt"],                 # per-prompt std instead of the batch's
    "pipeline_2proc": [],                                      # 2 ranks under torchrun (TORCHRUN)
    "ppo_2proc": ["--off_policy=ppo"],
}
TORCHRUN = {"pipeline_2proc", "ppo_2proc"}
COMPARISONS = {
    "off_policy": ["scalerl", "ppo_off_policy"],
    "off_policy_2proc": ["pipeline_2proc", "ppo_2proc"],
    "precision": ["scalerl", "bf16_head_body"],
    "loss": ["scalerl", "dapo", "gspo", "grpo"],
    "leave_one_out": ["scalerl", "no_zero_var_filter", "no_npr", "sample_agg", "prompt_adv_norm"],
    "noise": ["scalerl", "seed1", "seed2"],
}
COMPUTE = "cpu_hours"


def compute_key(name):
    """The compute axis a run is fitted against: CPU time in one process; wall time x ranks under torchrun."""
    return "device_hours" if name in TORCHRUN else COMPUTE


def rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line from a killed run
            pass
    return out


def finished(run_dir):
    """An eval row at the run's last step."""
    try:
        max_steps = json.load(open(os.path.join(run_dir, "config.json")))["config"]["max_steps"]
    except (OSError, ValueError, KeyError):
        return False
    return any(r.get("eval") and r["step"] == max_steps for r in rows(run_dir))


def launch(name, out, extra):
    run_dir = os.path.join(out, name)
    if finished(run_dir):
        print(f"{name}: finished, skipped", flush=True)
        return 0
    resume = ["--resume"] if os.path.exists(os.path.join(run_dir, "ckpt.pt")) else []
    if not resume and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        print(f"{name}: {run_dir} holds a run without a checkpoint; remove it to start over", flush=True)
        return 1
    os.makedirs(run_dir, exist_ok=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*(torchrun if name in TORCHRUN else [sys.executable]), os.path.join(ROOT, "scalerl.py"),
           f"--out_dir={run_dir}", "--threads=1", *RUNS[name], *extra, *resume]  # one thread per run or rank
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    with open(os.path.join(run_dir, "stdout.log"), "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    last = [r for r in rows(run_dir) if r.get("eval")][-1:] or [{}]
    print(f"{name}: exit {rc} after {(time.time() - t0) / 60:.1f} min, last pass rate {last[0].get('pass_rate')}",
          flush=True)
    return rc


def fit_row(name, fit, rs):
    evals = [r for r in rs if r.get("eval")]
    steps = [r for r in rs if not r.get("eval")]
    mean = lambda k: sum(r[k] for r in steps) / max(len(steps), 1)  # noqa: E731
    return (f"| {name} | {evals[0]['pass_rate']:.3f} | {evals[-1]['pass_rate']:.3f} | {fit.A:.3f} ± {fit.A_std:.3f} "
            f"| {fit.B:.2f} | {fit.C_mid:.3g} | {evals[-1][compute_key(name)]:.3g} | {mean('mismatch_kl'):+.1e} "
            f"| {mean('trunc_rate'):.3f} | {mean('zero_var_frac'):.2f} |")


def predictability(out):
    """Fit the default run on its first half, predict the second (errors in pass-rate points)."""
    C, R, r0 = sigmoid_fit.read_points(os.path.join(out, "scalerl"), compute_key=compute_key("scalerl"))
    ex = sigmoid_fit.extrapolation_check(C, R, r0, fit_fraction=0.5, n_boot=0)
    full = sigmoid_fit.fit_sigmoid(C, R, r0)
    sigmoid_fit.plot_runs([dict(label="scalerl, first half", C=C, R=R, R0=r0, fit=ex.fit)],
                          os.path.join(out, "predictability.png"), xlabel=f"compute ({compute_key('scalerl')})")
    return [f"Fit on C <= {ex.fit.window[1]:.3g} ({ex.n_fit} evals): A={ex.fit.A:.3f} B={ex.fit.B:.2f} "
            f"C_mid={ex.fit.C_mid:.3g}; on all {full.n_points} evals: A={full.A:.3f} B={full.B:.2f} "
            f"C_mid={full.C_mid:.3g}. Prediction of the {ex.n_test} later evals: mean |err| "
            f"{100 * ex.mean_abs_err:.1f} points, max {100 * ex.max_abs_err:.1f}, at the end "
            f"{100 * ex.final_err:+.1f} (prediction - measured).", "", "![](predictability.png)", ""]


def comparison(out, comp, names):
    """One figure of the runs' fitted curves, and their table rows."""
    paths = [os.path.join(out, n) for n in names]
    sigmoid_fit.analyze(paths, plot=os.path.join(out, f"{comp}.png"), compute_key=compute_key(names[0]))
    lines = ["| run | R0 | final | A ± boot. std | B | C_mid | C end | mismatch_kl | trunc | zero-var |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n, p in zip(names, paths):
        C, R, r0 = sigmoid_fit.read_points(p, compute_key=compute_key(n))
        lines.append(fit_row(n, sigmoid_fit.fit_sigmoid(C, R, r0), rows(p)))
    return lines + ["", f"![]({comp}.png)", ""]


def report(out):
    lines = [f"# Ablations on the tiny task (compute axis: {COMPUTE}; 2-process runs: device_hours)", "",
             "Regenerate: `python runs/ablations.py` (finished runs are skipped), then this report is rewritten.", ""]
    done = {n for n in RUNS if finished(os.path.join(out, n))}
    sections = ([("predictability", lambda: predictability(out))] if "scalerl" in done else []) + [
        (comp, lambda names=names, comp=comp: comparison(out, comp, [n for n in names if n in done]))
        for comp, names in COMPARISONS.items() if len([n for n in names if n in done]) >= 2]
    for title, make in sections:
        try:
            body = make()
        except ValueError as e:  # too few evals, or no rise above R0, to fit
            body = [f"not fitted: {e}", ""]
        lines += [f"## {title}", "", *body]
    missing = [n for n in RUNS if n not in done]
    if missing:
        lines.append(f"Not finished yet: {', '.join(missing)}.")
    open(os.path.join(out, "results.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {os.path.join(out, 'results.md')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "ablations"), help="parent of the run directories")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one CPU thread)")
    ap.add_argument("--only", help="comma-separated run names (default: all): " + ", ".join(RUNS))
    ap.add_argument("--report", action="store_true", help="only fit and plot the finished runs")
    args, extra = ap.parse_known_args()  # anything else goes to every scalerl.py run, e.g. --max_steps=100
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if not args.report:
        with ThreadPoolExecutor(args.jobs) as pool:  # the 2-process runs after, alone: each takes both cores
            codes = list(pool.map(lambda n: launch(n, args.out, extra), [n for n in names if n not in TORCHRUN]))
        codes += [launch(n, args.out, extra) for n in names if n in TORCHRUN]
        if any(codes):
            print(f"{sum(c != 0 for c in codes)} run(s) failed; see their stdout.log", file=sys.stderr)
    report(args.out)


if __name__ == "__main__":
    main()
