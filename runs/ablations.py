"""runs/ablations.py: the paper's comparisons in miniature, each variant over three RL seeds, fitted with sigmoid_fit.

    python runs/ablations.py                    # every run (2 at a time; 2-process runs alone), then the report
    python runs/ablations.py --only scalerl,dapo --seeds 0
    python runs/ablations.py --report           # fits, verdicts and figures from whatever runs have finished

Each run is `python scalerl.py --config=miniature --rl_seed=S --out_dir=OUT/<variant>-s<S> <the variant's flags>`:
the same task, held-out set and warm start for every run; only what RL draws changes with the seed (the paper's
notion of seed noise, Sec. 2.1). A finished run (an eval row at its last step) is skipped; an interrupted one is
continued with --resume. Logs go to OUT/<run>/stdout.log. The report fits every run against cpu_hours (the training
process's CPU time: unlike wall time it does not grow when two runs share the machine), judges each of the paper's
claims against the seed spread (`claims`), and writes OUT/results.md, OUT/curves.json (every run's evaluations:
what notebooks/ablations.ipynb reads) and one figure per comparison. The 2-process runs are
`torchrun --nproc_per_node=2 scalerl.py ...` (a generator rank and a trainer rank, one thread each), launched one
at a time after the others, and fitted against device_hours (wall time x 2 ranks: the paper's axis, where a
generator that never idles shows).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sigmoid_fit  # noqa: E402

PRESET = ["--config=miniature"]
SEEDS = (0, 1, 2)
VARIANTS = {  # name -> flags on top of the preset (the paper's section in the claims below)
    "scalerl": [],                                                  # ScaleRL: CISPO, FP32 head, PipelineRL-2, ...
    "bf16_fp32_head": ["--dtype=bfloat16"],                         # bf16 body, FP32 head (the paper's setting)
    "bf16_bf16_head": ["--dtype=bfloat16", "--fp32_head=false"],    # the same body, the head in bf16 too
    "dapo": ["--loss=dapo"],
    "gspo": ["--loss=gspo"],
    "batch_32": ["--batch_prompts=32"],                             # twice the prompts per step
    "think_64": ["--think_min=52", "--think_max=64"],              # a longer thinking budget (interruption on)
    "sample_agg": ["--agg=sample"],
    "prompt_adv_norm": ["--adv_norm=prompt"],
    "no_zero_var_filter": ["--zero_var_filter=false"],
    "no_npr": ["--npr=false"],
    "pipeline_2proc": [],                                           # 2 ranks under torchrun (TORCHRUN)
    "ppo_2proc": ["--off_policy=ppo"],
}
TORCHRUN = {"pipeline_2proc", "ppo_2proc"}
# (claim, paper section and number, kind, variants): "ceiling": the first variant's A above the second's;
# "efficiency": A the same, B / C_mid may move; "B": the first's B above the second's at the same A
CLAIMS = [
    ("FP32 head raises A (same bf16 body)", "Sec. 3.2, Fig. 5b: A 0.52 -> 0.61", "ceiling",
     ["bf16_fp32_head", "bf16_bf16_head"]),
    ("CISPO above DAPO", "Sec. 3.2, Fig. 5a: CISPO/GSPO > DAPO in A", "ceiling", ["scalerl", "dapo"]),
    ("GSPO above DAPO", "Sec. 3.2, Fig. 5a", "ceiling", ["gspo", "dapo"]),
    ("a larger batch raises A", "Sec. 5, Table 1: 512 -> 2048 prompts, A 0.605 -> 0.645", "ceiling",
     ["batch_32", "scalerl"]),
    ("a longer length budget raises A", "Sec. 5, Table 1: 14k -> 32k, A 0.610 -> 0.645", "ceiling",
     ["think_64", "scalerl"]),
    ("aggregation moves efficiency only", "Sec. 4, Fig. 8", "efficiency", ["scalerl", "sample_agg"]),
    ("advantage normalisation moves efficiency only", "Sec. 4, Fig. 8", "efficiency", ["scalerl", "prompt_adv_norm"]),
    ("zero-variance filtering moves efficiency only", "Sec. 4, Fig. 8", "efficiency",
     ["scalerl", "no_zero_var_filter"]),
    ("No-Positive-Resampling moves efficiency only", "Sec. 4, Fig. 8", "efficiency", ["scalerl", "no_npr"]),
    ("PipelineRL-k: higher B than PPO-off-policy-k", "Sec. 3.1, Fig. 4a: same or higher A, much higher B", "B",
     ["pipeline_2proc", "ppo_2proc"]),
]
FIGURES = {"precision": ["bf16_fp32_head", "bf16_bf16_head"], "loss": ["scalerl", "gspo", "dapo"],
           "batch": ["scalerl", "batch_32"], "length": ["scalerl", "think_64"],
           "leave_one_out": ["scalerl", "sample_agg", "prompt_adv_norm", "no_zero_var_filter", "no_npr"],
           "off_policy_2proc": ["pipeline_2proc", "ppo_2proc"], "noise": ["scalerl"]}
NOISE = sigmoid_fit.NOISE_MARGIN  # the paper's margin on A (0.02)


def compute_key(variant):
    """The compute axis a run is fitted against: CPU time in one process; wall time x ranks under torchrun."""
    return "device_hours" if variant in TORCHRUN else "cpu_hours"


def run_name(variant, seed):
    return f"{variant}-s{seed}"


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


def launch(variant, seed, out, extra):
    name = run_name(variant, seed)
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
    cmd = [*(torchrun if variant in TORCHRUN else [sys.executable]), os.path.join(ROOT, "scalerl.py"),
           f"--out_dir={run_dir}", "--threads=1", *PRESET, f"--rl_seed={seed}", *VARIANTS[variant], *extra,
           *resume]  # one thread per run or rank
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    with open(os.path.join(run_dir, "stdout.log"), "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    last = [r for r in rows(run_dir) if r.get("eval")][-1:] or [{}]
    print(f"{name}: exit {rc} after {(time.time() - t0) / 60:.1f} min, last pass rate {last[0].get('pass_rate')}",
          flush=True)
    return rc


def curve(out, variant, seed):
    """One finished run's evaluations and step diagnostics (what curves.json holds per run)."""
    run_dir = os.path.join(out, run_name(variant, seed))
    C, R, r0 = sigmoid_fit.read_points(run_dir, compute_key=compute_key(variant))
    steps = [r for r in rows(run_dir) if not r.get("eval")]
    mean = lambda k: float(np.mean([r[k] for r in steps])) if steps else float("nan")  # noqa: E731
    return dict(variant=variant, seed=seed, compute=compute_key(variant), C=[float(c) for c in C],
                R=[float(r) for r in R], R0=r0, steps=len(steps), mismatch_kl=mean("mismatch_kl"),
                trunc_rate=mean("trunc_rate"), zero_var_frac=mean("zero_var_frac"))


def fit_run(c):
    """A run's fit (with its 90% bootstrap band), how far its window reaches in units of C_mid, and the fit on the
    first half of its compute: its prediction of the final evaluation, and of the mean of the last three."""
    C, R = np.array(c["C"]), np.array(c["R"])
    fit = sigmoid_fit.fit_sigmoid(C, R, c["R0"])
    half = sigmoid_fit.fit_sigmoid(C, R, c["R0"], c_max=C.max() / 2, n_boot=0)
    return dict(fit=fit, reach=C.max() / fit.C_mid, band=fit.A_ci[1] - fit.A_ci[0],
                pred_final=float(half.predict(C[-1:])[0] - R[-1]),
                pred_last3=float(half.predict(C[-3:]).mean() - R[-3:].mean()))


def summarize(curves):
    """Per variant: its runs' fits, and A, B, C_mid as mean and std over seeds."""
    out = {}
    for c in curves:
        try:
            f = fit_run(c)
        except ValueError as e:  # too few evaluations, or no rise above R0
            print(f"{run_name(c['variant'], c['seed'])}: not fitted: {e}", file=sys.stderr)
            continue
        out.setdefault(c["variant"], []).append(dict(c, **f))
    stats = {}
    for v, runs in out.items():
        get = lambda k: np.array([r["fit"].__dict__[k] if k in ("A", "B", "C_mid") else r[k]  # noqa: E731
                                  for r in runs], dtype=float)
        sd = lambda x: float(x.std(ddof=1)) if len(x) > 1 else float("nan")  # noqa: E731
        stats[v] = dict(runs=runs, n=len(runs), **{f"{k}_mean": float(get(k).mean()) for k in
                                                   ("A", "B", "C_mid", "band", "reach", "pred_final", "pred_last3")},
                        A_sd=sd(get("A")), B_sd=sd(get("B")), final_mean=float(np.mean([r["R"][-1] for r in runs])),
                        mismatch_kl=float(np.mean([r["mismatch_kl"] for r in runs])),
                        trunc_rate=float(np.mean([r["trunc_rate"] for r in runs])))
    return stats


def verdict(kind, a, b):
    """One claim judged against the seed spread: the difference of means against max(0.02, 2 standard errors)."""
    key = "B" if kind == "B" else "A"
    d = a[f"{key}_mean"] - b[f"{key}_mean"]
    se = np.sqrt(np.nan_to_num(a[f"{key}_sd"]) ** 2 / a["n"] + np.nan_to_num(b[f"{key}_sd"]) ** 2 / b["n"])
    margin = max(NOISE if key == "A" else 0.0, 2 * se)
    if kind == "efficiency":
        word = "A within the noise, as in the paper" if abs(d) <= margin else "A moved beyond the noise"
    else:
        word = ("seen, the paper's direction" if d > margin else "opposite to the paper" if d < -margin
                else "not separated (within the noise)")
    return d, margin, word


def claims(stats):
    """The claims table: each claim, the paper's number, ours (mean +- std over seeds), and a verdict."""
    fmt = lambda s: f"{s['A_mean']:.3f} ± {s['A_sd']:.3f}"  # noqa: E731
    lines = ["| claim | paper | ours: A (mean ± std over seeds) | B | difference | verdict |", "|---|---|---|---|---|---|"]
    for claim, paper, kind, (x, y) in CLAIMS:
        if x not in stats or y not in stats:
            lines.append(f"| {claim} | {paper} | not run yet ({x}, {y}) | | | |")
            continue
        d, margin, word = verdict(kind, stats[x], stats[y])
        lines.append(f"| {claim} | {paper} | {x} {fmt(stats[x])}; {y} {fmt(stats[y])} | {stats[x]['B_mean']:.2f} vs "
                     f"{stats[y]['B_mean']:.2f} | {'B' if kind == 'B' else 'A'} {d:+.3f} (noise {margin:.3f}) "
                     f"| {word} |")
    return lines


def checks(stats):
    """Is the miniature fit for judging claims: the default's seed spread and identified fits, and how well every
    run's first half predicts its end."""
    lines = ["| check | target | ours | met |", "|---|---|---|---|"]
    s = stats.get("scalerl")
    if s:
        lines.append(f"| seed spread of A, default recipe ({s['n']} seeds) | std <= {NOISE} (paper: ±0.015) | "
                     f"{s['A_mean']:.3f} ± {s['A_sd']:.3f} | {'yes' if s['A_sd'] <= NOISE else 'no'} |")
        each = lambda key, fmt: ", ".join(format(r[key], fmt) for r in s["runs"])  # noqa: E731
        ok = all(r["reach"] >= 3 and r["fit"].A < 0.99 and r["band"] <= 0.05 for r in s["runs"])
        lines.append(f"| identified: window >= 3 x C_mid, A below its bound 1, 90% band <= 0.05 | every seed | "
                     f"reach {each('reach', '.1f')}; A {', '.join(format(r['fit'].A, '.3f') for r in s['runs'])}; "
                     f"band {each('band', '.3f')} | {'yes' if ok else 'no'} |")
    runs = [r for v in stats.values() for r in v["runs"]]
    if runs:
        final = sum(abs(r["pred_final"]) <= NOISE for r in runs)
        last3 = sum(abs(r["pred_last3"]) <= NOISE for r in runs)
        worst = max(abs(r["pred_final"]) for r in runs)
        lines.append(f"| the fit on the first half predicts the final evaluation | within {NOISE}, every run | "
                     f"{final} of {len(runs)} (worst {worst:.3f}); the mean of the last 3: {last3} of {len(runs)} | "
                     f"{'yes' if final == len(runs) else 'no'} |")
    return lines


def variants_table(stats):
    lines = ["| variant | flags | seeds | final | A (mean ± std) | 90% band | window / C_mid | B | C_mid | "
             "first half predicts final / last 3 | mismatch_kl | trunc |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v, s in stats.items():
        lines.append(f"| {v} | {' '.join(VARIANTS[v]) or '(preset)'} | {s['n']} | {s['final_mean']:.3f} | "
                     f"{s['A_mean']:.3f} ± {s['A_sd']:.3f} | {s['band_mean']:.3f} | {s['reach_mean']:.1f} | "
                     f"{s['B_mean']:.2f} | {s['C_mid_mean']:.3g} | {s['pred_final_mean']:+.3f} / "
                     f"{s['pred_last3_mean']:+.3f} | {s['mismatch_kl']:+.1e} | {s['trunc_rate']:.3f} |")
    return lines


def figure(stats, names, path):
    runs = [dict(label=run_name(r["variant"], r["seed"]), C=r["C"], R=r["R"], R0=r["R0"], fit=r["fit"])
            for v in names if v in stats for r in stats[v]["runs"]]
    if runs:
        sigmoid_fit.plot_runs(runs, path, xlabel=f"compute ({compute_key(names[0])})")


def load_curves(out):
    """Every finished run's curve, from the run directories under `out` (<variant>-s<seed>, any seed)."""
    found = [d.rpartition("-s") for d in sorted(os.listdir(out)) if finished(os.path.join(out, d))]
    return [curve(out, v, int(s)) for v, _, s in found if v in VARIANTS and s.isdigit()]


def report(out, curves=None):
    curves = load_curves(out) if curves is None else curves
    json.dump(curves, open(os.path.join(out, "curves.json"), "w"), indent=0)
    stats = summarize(curves)
    lines = ["# The paper in miniature (`--config=miniature`, seeds are --rl_seed; compute: cpu_hours, "
             "2-process runs: device_hours)", "", "Regenerate: `python runs/ablations.py` (finished runs are skipped).",
             "", "## Fit for purpose", "", *checks(stats), "", "## Claims", "", *claims(stats), "", "## Variants", "",
             *variants_table(stats), ""]
    for name, names in FIGURES.items():
        if any(v in stats for v in names):
            figure(stats, names, os.path.join(out, f"{name}.png"))
            lines += [f"![{name}]({name}.png)", ""]
    missing = [run_name(v, s) for v in VARIANTS for s in SEEDS if not any(
        c["variant"] == v and c["seed"] == s for c in curves)]
    if missing:
        lines.append(f"Not finished yet: {', '.join(missing)}.")
    open(os.path.join(out, "results.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {os.path.join(out, 'results.md')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "ablations"), help="parent of the run directories")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one CPU thread)")
    ap.add_argument("--only", help="comma-separated variants (default: all): " + ", ".join(VARIANTS))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated RL seeds (default: 0,1,2)")
    ap.add_argument("--report", action="store_true", help="only fit and plot the finished runs")
    args, extra = ap.parse_known_args()  # anything else goes to every scalerl.py run, e.g. --max_steps=100
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        order = [(v, s) for s in seeds for v in names]  # seed 0 of every variant first: a partial set compares
        with ThreadPoolExecutor(args.jobs) as pool:  # the 2-process runs after, alone: each takes both cores
            codes = list(pool.map(lambda vs: launch(*vs, args.out, extra), [x for x in order if x[0] not in TORCHRUN]))
        codes += [launch(v, s, args.out, extra) for v, s in order if v in TORCHRUN]
        if any(codes):
            print(f"{sum(c != 0 for c in codes)} run(s) failed; see their stdout.log", file=sys.stderr)
    report(args.out)


if __name__ == "__main__":
    main()
