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
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from scipy.stats import norm as stats_norm
from scipy.stats import t as stats_t

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import scalerl  # noqa: E402
import sigmoid_fit  # noqa: E402
from infra import cli, sources  # noqa: E402

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
    # lag 8: the trust region against stale samples decides; each loss at the lr where they separate and at a lower one
    **{f"stale_{name}{lr}": ["--config=miniature_stale", *flags, *([f"--lr={lr[3:]}"] if lr else [])]
       for lr in ("", "_lr5e-5") for name, flags in (
           ("cispo", []), ("dapo", ["--loss=dapo"]), ("gspo", ["--loss=gspo"]),
           ("dapo_no_low_clip", ["--loss=dapo", "--eps_low=1"]),
           ("dapo_no_high_clip", ["--loss=dapo", "--eps_high=100"]))},
    # later answers to stale samples, lag 8, lr 1.5e-4 (docs/metrics.md): DPPO's divergence mask; CISPO with
    # sequence-level masked importance sampling, at a cap that bites here (ln 1.1 = 0.095: ~3 standard deviations
    # of a 40-token mean of DAPO's per-token log-ratios, sd ~0.2)
    "stale_dppo": ["--config=miniature_stale", "--loss=dppo"],
    "stale_cispo_mis": ["--config=miniature_stale", "--is_correction=mis", "--is_cap=1.1"],
    # a 64-72 token budget that every level fits: a ceiling set by learning
    **{f"long_{name}": ["--config=miniature_long", *flags] for name, flags in (
        ("scalerl", []), ("dapo", ["--loss=dapo"]), ("gspo", ["--loss=gspo"]), ("batch_32", ["--batch_prompts=32"]))},
}
TORCHRUN = {"pipeline_2proc", "ppo_2proc"}
# (claim, paper section and number, kind, variants): "ceiling": the first variant's A above the second's;
# "efficiency": A the same, B / C_mid may move; "B": the first's fitted B above the second's (each its own fit)
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
    # at the paper's own lag (PipelineRL-8), where the trust region against stale samples decides
    ("CISPO above DAPO, lag 8", "Sec. 3.2, Fig. 5a (PipelineRL-8)", "ceiling", ["stale_cispo", "stale_dapo"]),
    ("GSPO above DAPO, lag 8", "Sec. 3.2, Fig. 5a (PipelineRL-8)", "ceiling", ["stale_gspo", "stale_dapo"]),
    ("CISPO above DAPO, lag 8, lr 5e-5", "Sec. 3.2, Fig. 5a (PipelineRL-8)", "ceiling",
     ["stale_cispo_lr5e-5", "stale_dapo_lr5e-5"]),
    ("GSPO above DAPO, lag 8, lr 5e-5", "Sec. 3.2, Fig. 5a (PipelineRL-8)", "ceiling",
     ["stale_gspo_lr5e-5", "stale_dapo_lr5e-5"]),
    ("no upper clip above DAPO (rare tokens keep their gradient), lag 8", "Sec. 3.2: CISPO's reason, eps_high 0.28",
     "ceiling", ["stale_dapo_no_high_clip", "stale_dapo"]),
    ("DAPO's lower clip: a mechanism here, no claim of the paper's", "DAPO keeps eps_low 0.2 (Sec. 3.2)", "ceiling",
     ["stale_dapo", "stale_dapo_no_low_clip"]),
    ("DPPO above CISPO, lag 8 (a trust region on |pi - pi_gen| keeps DAPO's stability)",
     "DPPO, arXiv 2602.04879: CISPO drifts and collapses as the gap grows", "ceiling", ["stale_dppo", "stale_cispo"]),
    ("CISPO with MIS above CISPO, lag 8", "masked importance sampling corrects the gap itself", "ceiling",
     ["stale_cispo_mis", "stale_cispo"]),
    # a 64-72 token budget that every level fits: the ceiling is set by learning, not by the task
    ("CISPO above DAPO, budget-free", "Sec. 3.2, Fig. 5a", "ceiling", ["long_scalerl", "long_dapo"]),
    ("GSPO above DAPO, budget-free", "Sec. 3.2, Fig. 5a", "ceiling", ["long_gspo", "long_dapo"]),
    ("a larger batch raises A, budget-free", "Sec. 5, Table 1: 512 -> 2048 prompts, A 0.605 -> 0.645", "ceiling",
     ["long_batch_32", "long_scalerl"]),
]
FIGURES = {"precision": ["bf16_fp32_head", "bf16_bf16_head"], "loss": ["scalerl", "gspo", "dapo"],
           "batch": ["scalerl", "batch_32"], "length": ["scalerl", "think_64"],
           "leave_one_out": ["scalerl", "sample_agg", "prompt_adv_norm", "no_zero_var_filter", "no_npr"],
           "off_policy_2proc": ["pipeline_2proc", "ppo_2proc"], "noise": ["scalerl"],
           "stale_loss": ["stale_cispo", "stale_dapo", "stale_gspo"],
           "stale_clips": ["stale_dapo", "stale_dapo_no_low_clip", "stale_dapo_no_high_clip"],
           "stale_2026": ["stale_cispo", "stale_dapo", "stale_dppo", "stale_cispo_mis"],
           "stale_loss_lr5e-5": ["stale_cispo_lr5e-5", "stale_dapo_lr5e-5", "stale_gspo_lr5e-5"],
           "long_loss": ["long_scalerl", "long_dapo", "long_gspo"], "long_batch": ["long_scalerl", "long_batch_32"]}
NOISE = sigmoid_fit.NOISE_MARGIN  # the paper's margin on A (0.02)
# step metrics averaged over the second half of a run (docs/metrics.md): the trust region's mechanism at work; and
# over the first EARLY steps (`<metric>_early`), where the collapses happen
MECHANISM = ("logratio_sd", "dapo_clip_low", "dapo_clip_high", "dapo_grad_low", "dapo_grad_high", "fresh_mismatch",
             "grad_norm", "lag_mean", "clip_frac", "seq_ess")
EARLY = 100
# kept step by step over those first EARLY steps (`early_series`), rounded to 4 significant digits
SERIES = ("dapo_clip_low", "dapo_clip_high", "dapo_grad_low", "dapo_grad_high", "logratio_sd", "clip_frac")


def compute_key(variant):
    """The compute axis a run is fitted against: CPU time in one process; wall time x ranks under torchrun."""
    return "device_hours" if variant in TORCHRUN else "cpu_hours"


def preset(variant):
    """The miniature preset, unless the variant names its own."""
    return [] if any(f.startswith("--config=") for f in VARIANTS[variant]) else PRESET


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


def max_steps(run_dir):
    """The run's own --max_steps, from its config.json (None if that is missing or unreadable)."""
    try:
        return json.load(open(os.path.join(run_dir, "config.json")))["config"]["max_steps"]
    except (OSError, ValueError, KeyError):
        return None


def finished(run_dir):
    """An eval row at the run's last step."""
    n = max_steps(run_dir)
    return n is not None and any(r.get("eval") and r["step"] == n for r in rows(run_dir))


def launch(variant, seed, out, extra):
    name = run_name(variant, seed)
    run_dir = os.path.join(out, name)
    if finished(run_dir):
        print(f"{name}: finished, skipped", flush=True)
        return 0
    resume = ["--resume"] if os.path.exists(os.path.join(run_dir, "ckpt.pt")) else []
    if not resume and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        print(f"{name}: {run_dir} holds a run without a checkpoint; start it over with `rm -r {run_dir}`",
              file=sys.stderr, flush=True)
        return 1
    os.makedirs(run_dir, exist_ok=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*(torchrun if variant in TORCHRUN else [sys.executable]), os.path.join(ROOT, "scalerl.py"),
           f"--out_dir={run_dir}", "--threads=1", *preset(variant), f"--rl_seed={seed}", *VARIANTS[variant], *extra,
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
    if r0 is None:
        raise ValueError(f"{run_dir}: no evaluation before RL (R0)")
    steps = [r for r in rows(run_dir) if not r.get("eval")]
    late = [r for r in steps if 2 * r["step"] > len(steps)]  # the second half of training: the mechanism at work
    early = [r for r in steps if r["step"] <= EARLY]

    def mean(k, of=steps):  # over the rows that have it (older runs lack the mechanism's metrics)
        xs = [r[k] for r in of if r.get(k) is not None]
        return float(np.mean(xs)) if xs else None
    return dict(variant=variant, seed=seed, compute=compute_key(variant), C=[float(c) for c in C],
                R=[float(r) for r in R], R0=r0, steps=len(steps), mismatch_kl=mean("mismatch_kl"),
                trunc_rate=mean("trunc_rate"), zero_var_frac=mean("zero_var_frac"),
                bound=bound(run_config(run_dir)),
                **{k: mean(k, late) for k in MECHANISM}, **{f"{k}_early": mean(k, early) for k in MECHANISM},
                early_series=early_series(early))


def early_series(steps):
    """{metric: [its value at step 1, 2, ..., min(EARLY, the last step)]} for the SERIES metrics, to 4 significant
    digits; None where the step's row lacks it (older runs, a step not logged, a non-finite value). A step logged
    twice (a resumed run) keeps its last row."""
    at = {r["step"]: r for r in steps if 1 <= r["step"] <= EARLY}
    n = max(at, default=0)

    def value(r, k):
        x = r.get(k) if r else None
        return float(f"{x:.4g}") if x is not None and np.isfinite(x) else None
    return {k: [value(at.get(i), k) for i in range(1, n + 1)] for k in SERIES}


def plateau(R):
    """The mean of the later half of a run's evaluations (after R0; evenly spaced): where it settled."""
    return float(np.mean(R[len(R) // 2:]))


def run_config(run_dir):
    """A run's options, read from its config.json as --resume reads them."""
    return cli.restore_options(scalerl.Config(out_dir=run_dir), os.path.join(run_dir, "config.json"), {})


def bound(cfg):
    """The pass rate a never-slipping policy reaches when its thinking must fit the budget, on a run's own held-out
    set (data.feasible_share): the ceiling the task sets, beside the fitted A."""
    _, val, _ = sources.load_data(cfg)
    return data.feasible_share(val, (cfg.think_min, cfg.think_max))


def fit_run(c):
    """A run's fit (with its 90% bootstrap band), how far its window reaches in units of C_mid, and the fit on the
    first half of its compute: its prediction of the final evaluation, and of the mean of the last three (NaN if
    the first half holds too few evaluations to fit)."""
    C, R = np.array(c["C"]), np.array(c["R"])
    fit = sigmoid_fit.fit_sigmoid(C, R, c["R0"])
    try:
        half = sigmoid_fit.fit_sigmoid(C, R, c["R0"], c_max=C.max() / 2, n_boot=0)
        pred_final, pred_last3 = half.predict(C[-1:])[0] - R[-1], half.predict(C[-3:]).mean() - R[-3:].mean()
    except ValueError:
        pred_final = pred_last3 = float("nan")
    return dict(fit=fit, reach=C.max() / fit.C_mid, band=fit.A_ci[1] - fit.A_ci[0], pred_final=float(pred_final),
                pred_last3=float(pred_last3))


def summarize(curves):
    """Per variant: its fitted runs, A and B as mean and std over seeds, C_mid as a geometric mean, and the runs
    that could not be fitted (`unfitted`: (run, why); they count in no mean, and the tables name them); the
    mechanism's means, and step by step over steps 1-EARLY (`early_series`, over the `early_series_n` runs that
    kept one)."""
    out, unfitted = {}, {}
    for c in curves:
        try:
            out.setdefault(c["variant"], []).append(dict(c, **fit_run(c)))
        except ValueError as e:  # too few evaluations, or no rise above R0
            unfitted.setdefault(c["variant"], []).append((run_name(c["variant"], c["seed"]), str(e)))
    stats = {}
    for v in dict.fromkeys([c["variant"] for c in curves]):
        runs = out.get(v, [])
        get = lambda k: np.array([getattr(r["fit"], k) if k in ("A", "B", "C_mid") else r[k]  # noqa: E731
                                  for r in runs], dtype=float)
        sd = lambda x: float(x.std(ddof=1)) if len(x) > 1 else float("nan")  # noqa: E731
        mean = lambda x: float(np.nanmean(x)) if len(x) and not np.isnan(x).all() else float("nan")  # noqa: E731
        # the plateau and the mechanism over every finished run, fitted or not
        every = [c for c in curves if c["variant"] == v]
        settled = np.array([plateau(c["R"]) for c in every], dtype=float)
        series_n, series = series_mean(every)  # steps 1-EARLY, step by step, over the runs that kept them
        stats[v] = dict(runs=runs, n=len(runs), unfitted=unfitted.get(v, []), A_sd=sd(get("A")), B_sd=sd(get("B")),
                        curves=every,
                        C_mid_mean=float(np.exp(np.log(get("C_mid")).mean())) if runs else float("nan"),
                        **{f"{k}_mean": mean(get(k)) for k in ("A", "B", "band", "reach", "pred_final", "pred_last3")},
                        final_mean=mean(np.array([r["R"][-1] for r in runs])), plateau_n=len(every),
                        plateau_mean=mean(settled), plateau_sd=sd(settled), bound=every[0].get("bound", np.nan),
                        **{k: mean(np.array([c.get(k) for c in every], dtype=float))
                           for k in ("mismatch_kl", "trunc_rate", *MECHANISM, *(f"{k}_early" for k in MECHANISM))},
                        early_series_n=series_n, early_series=series)
    return stats


def series_mean(curves):
    """Step by step, the mean over the runs that kept an `early_series` (a curves.json written before it has none)
    of each SERIES metric: (how many runs had one, {metric: [mean at step 1, 2, ...]}), None at a step where no run
    has a value."""
    have = [c["early_series"] for c in curves if c.get("early_series")]
    out = {}
    for k in SERIES:
        cols = [s.get(k) or [] for s in have]
        out[k] = [float(np.mean(xs)) if (xs := [col[i] for col in cols if i < len(col) and col[i] is not None])
                  else None for i in range(max(map(len, cols), default=0))]
    return len(have), out


def verdict(kind, a, b, key=None):
    """One claim judged against the seed spread: the difference of the means against the larger of the paper's
    margin (0.02, for A and the plateau) and the 95% half-width of a Welch t-interval over seeds (with 3 seeds a
    side, about 2.8-4.3 standard errors). Fewer than 2 seeds on either side: no spread to judge against."""
    key = key or ("B" if kind == "B" else "A")
    d, n = a[f"{key}_mean"] - b[f"{key}_mean"], "plateau_n" if key == "plateau" else "n"
    a, b = dict(a, n=a[n]), dict(b, n=b[n])
    if min(a["n"], b["n"]) < 2:
        return d, float("nan"), "fewer than 2 fitted seeds: no spread to judge against"
    va, vb = a[f"{key}_sd"] ** 2 / a["n"], b[f"{key}_sd"] ** 2 / b["n"]
    se = np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a["n"] - 1) + vb ** 2 / (b["n"] - 1)) if se > 0 else 1.0
    margin = max(NOISE if key != "B" else 0.0, float(stats_t.ppf(0.975, df)) * se)
    if kind == "efficiency":
        word = (f"{key} moved beyond the noise" if abs(d) > margin else f"{key} within the noise, as in the paper"
                if margin <= NOISE else f"{key} within the noise, which is wider than the paper's {NOISE}")
    else:
        word = ("seen, the paper's direction" if d > margin else "opposite to the paper" if d < -margin
                else "not separated (within the noise)")
    return d, margin, word


# ----------------------------------------------------------------------------- verdicts by a stated test
ALPHA, POWER = 0.05, 0.8  # two-sided tests at 5%; seeds to decide: 80% power at the observed gap
MATCH = 1.1  # compute differs when one variant's mean final compute exceeds the other's by more than 10%


def permutation_p(x, y):
    """Exact two-sided permutation test of mean(x) - mean(y): the share of all splits of the pooled seeds into groups
    of len(x) and len(y) whose |difference of means| reaches the observed one. With 3 vs 3 seeds there are 20 splits,
    and the observed one and its mirror image always count: p >= 0.10, never below 0.05."""
    pooled, n = np.concatenate([x, y]), len(x)
    obs = abs(np.mean(x) - np.mean(y))
    diffs = [abs(pooled[list(i)].mean() - np.delete(pooled, list(i)).mean())
             for i in itertools.combinations(range(len(pooled)), n)]
    return float(np.mean(np.array(diffs) >= obs - 1e-12))


def seeds_needed(d, sd, equivalence):
    """Seeds per side for 80% power (normal approximation), at least the 4 a side with which an exact permutation
    test can reach p < 0.05: to show a gap d two-sided at 5%, or (equivalence) to pass TOST at +-0.02 when the true
    gap is d. None: no number of seeds would (an equivalence test on a gap of 0.02 or more)."""
    gap = NOISE - abs(d) if equivalence else abs(d)
    z = stats_norm.ppf(1 - ALPHA) + stats_norm.ppf(1 - (1 - POWER) / 2) if equivalence else \
        stats_norm.ppf(1 - ALPHA / 2) + stats_norm.ppf(POWER)
    return max(4, int(np.ceil(2 * (z * sd / gap) ** 2))) if gap > 0 else None


def compare(x, y, floor=0.0, margin=NOISE):
    """mean(x) - mean(y) over seeds, judged by the stated rule: separated (two-sided Welch AND exact permutation test
    at p < 0.05), else equivalent (TOST at +-margin passes at 5%; margin 0: no equivalence test), else undecided with
    the seeds that would decide. Each side's standard deviation is at least `floor` (the evaluation noise)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    d = float(x.mean() - y.mean()) if len(x) and len(y) else float("nan")
    out = dict(d=d, n=(len(x), len(y)), p_welch=float("nan"), p_perm=float("nan"), p_tost=float("nan"), floor=floor)
    if min(len(x), len(y)) < 2:
        return dict(out, outcome="undecided", seeds=None)
    vx, vy = (max(float(np.var(v, ddof=1)), floor ** 2) / len(v) for v in (x, y))
    se = max(float(np.sqrt(vx + vy)), 1e-12)  # equal seeds and no floor: any gap is beyond their (zero) spread
    df = (vx + vy) ** 2 / max(vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1), 1e-300) if vx + vy else 1.0
    out.update(p_welch=float(2 * stats_t.sf(abs(d) / se, df)), p_perm=permutation_p(x, y))
    if margin:  # two one-sided tests: the gap is above -margin, and below +margin
        out["p_tost"] = float(max(stats_t.sf((d + margin) / se, df), stats_t.cdf((d - margin) / se, df)))
    if out["p_welch"] < ALPHA and out["p_perm"] < ALPHA:
        return dict(out, outcome="separated", seeds=None)
    if out["p_tost"] < ALPHA:
        return dict(out, outcome="equivalent", seeds=None)
    sd = float(np.sqrt((vx * len(x) + vy * len(y)) / 2))  # the sides' (floored) spreads pooled
    return dict(out, outcome="undecided", seeds=seeds_needed(d, sd, equivalence=bool(margin) and abs(d) < margin / 2))


def word(kind, t):
    """A comparison's outcome in the claim's terms: for a ceiling (or B) claim, the first above the second is shown,
    below it reversed; for an efficiency-only claim, the same A is shown and a moved one reversed."""
    if t["outcome"] == "undecided":
        return ("undecided: fewer than 2 seeds a side" if min(t["n"]) < 2 else
                f"undecided: {t['seeds']} seeds a side would decide" if t["seeds"] else
                "undecided: no seed count decides a gap this size at +-0.02")
    if kind == "efficiency":
        return "shown (the same within ±0.02)" if t["outcome"] == "equivalent" else f"reversed (moved {t['d']:+.3f})"
    return "not separated" if t["outcome"] == "equivalent" else "shown" if t["d"] > 0 else "reversed"


def unidentified(r):
    """Why a run's fit does not identify A ('' if it does): A's 90% band wider than 0.05 or touching 1, B at a bound
    of its search, a window under 3 x C_mid, or A above the task's bound (data.feasible_share)."""
    f, why = r["fit"], []
    if f.A_ci[1] - f.A_ci[0] > 0.05:
        why.append(f"A's band {f.A_ci[1] - f.A_ci[0]:.3f} > 0.05")
    if f.A_ci[1] >= 0.999:
        why.append("A's band touches 1")
    if min(abs(np.log(f.B / b)) for b in sigmoid_fit.B_BOUNDS) < 0.01:
        why.append(f"B {f.B:.2f} at its bound")
    if r["reach"] < 3:
        why.append(f"window {r['reach']:.1f} x C_mid < 3")
    if f.A > r.get("bound", 1.0):
        why.append(f"A {f.A:.3f} above the task's bound {r['bound']:.3f}")
    return ", ".join(why)


def noise_floor(a, b):
    """The evaluation noise under a seed's spread of a mean over the later half of the evaluations: R0 is one set of
    weights evaluated under each seed's draws, so its spread over seeds is one evaluation's noise; a mean over k
    evaluations has 1/sqrt(k) of it. (Used for A too: A rests on the same evaluations.)"""
    r0 = {c["seed"]: c["R0"] for v in (a, b) for c in v["curves"]}
    k = min(len(c["R"]) - len(c["R"]) // 2 for v in (a, b) for c in v["curves"])
    return float(np.std(list(r0.values()), ddof=1) / np.sqrt(k)) if len(r0) > 1 else 0.0


def plateaus(a, b):
    """Each run's plateau, compute-matched where the two variants' compute differs (by more than MATCH): R
    interpolated over the later half of the cheaper variant's mean final compute. Returns (xs, ys, C or None)."""
    ends = [np.mean([c["C"][-1] for c in v["curves"]]) for v in (a, b)]
    if max(ends) <= MATCH * min(ends):
        return [plateau(c["R"]) for c in a["curves"]], [plateau(c["R"]) for c in b["curves"]], None
    grid = np.linspace(min(ends) / 2, min(ends), 16)
    at = lambda v: [float(np.mean(np.interp(grid, c["C"], c["R"]))) for c in v["curves"]]  # noqa: E731
    return at(a), at(b), float(min(ends))


def judged(stats):
    """Per claim, the tests on A (identified fits only) and on the plateau (compute-matched where compute differs):
    [(claim, kind, x, y, measure, comparison or None, note)]."""
    out = []
    for claim, _, kind, (x, y) in CLAIMS:
        if not (stats.get(x, {}).get("curves") and stats.get(y, {}).get("curves")):
            continue
        a, b = stats[x], stats[y]
        floor, key = noise_floor(a, b), "B" if kind == "B" else "A"
        bad = [f"{run_name(r['variant'], r['seed'])} ({why})" for v in (a, b) for r in v["runs"]
               if (why := unidentified(r))] + [f"{run} (not fitted)" for v in (a, b) for run, _ in v["unfitted"]]
        vals = [[getattr(r["fit"], key) for r in v["runs"]] for v in (a, b)]
        if kind == "B" or not bad:
            out.append((claim, kind, x, y, key, compare(*vals, 0.0 if kind == "B" else floor,
                                                         0.0 if kind == "B" else NOISE), ""))
        else:
            out.append((claim, kind, x, y, key, None, "not identified: " + "; ".join(bad)))
        if kind != "B":
            xs, ys, c = plateaus(a, b)
            out.append((claim, kind, x, y, "plateau", compare(xs, ys, floor),
                        f"compute-matched at {c:.3g} {compute_key(x)}" if c else ""))
    return out


def spread(name, xs):
    """'name mean ± sd (n)' over seeds."""
    return f"{name} {np.mean(xs):.3f} ± {np.std(xs, ddof=1) if len(xs) > 1 else float('nan'):.3f} ({len(xs)})"


def tests_table(stats):
    """The verdicts by the stated test: each claim's test on A and on the plateau, both p's and the seeds."""
    lines = ["| claim | measure | first: mean ± sd (seeds) | second | difference | Welch p | permutation p | "
             "TOST p (±0.02) | noise floor | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for claim, kind, x, y, key, t, note in judged(stats):
        if t is None:
            lines.append(f"| {claim} | {key} | {x} | {y} | | | | | | no verdict on {key}: {note} |")
            continue
        xs, ys = ([getattr(r["fit"], key) for r in stats[v]["runs"]] for v in (x, y)) if key != "plateau" else \
            plateaus(stats[x], stats[y])[:2]
        lines.append(f"| {claim} | {key}{f' ({note})' if note else ''} | {spread(x, xs)} | {spread(y, ys)} | "
                     f"{t['d']:+.3f} | {t['p_welch']:.3f} | {t['p_perm']:.3f} | {t['p_tost']:.3f} | "
                     f"{t['floor']:.4f} | {word(kind, t)} |")
    return lines


def claims(stats):
    """The claims table: each claim, the paper's number, ours (mean +- std over fitted seeds), and a verdict. The
    B claim compares each variant's own fits (B trades off against A and C_mid; the A column says how far apart the
    ceilings are)."""
    fmt = lambda v: f"{v} {stats[v]['A_mean']:.3f} ± {stats[v]['A_sd']:.3f} ({stats[v]['n']})"  # noqa: E731
    lines = ["| claim | paper | ours: A, mean ± std over (n) fitted seeds | B | difference (noise) | verdict | "
             "plateau (later half of the evaluations) | plateau difference (noise) | verdict on the plateau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for claim, paper, kind, (x, y) in CLAIMS:
        if not (stats.get(x, {}).get("n") and stats.get(y, {}).get("n")):
            lines.append(f"| {claim} | {paper} | no fitted run yet of {x if not stats.get(x, {}).get('n') else y} "
                         "| | | | | | |")
            continue
        d, margin, word = verdict(kind, stats[x], stats[y])
        p = " vs ".join(f"{stats[v]['plateau_mean']:.3f} ± {stats[v]['plateau_sd']:.3f}" for v in (x, y))
        pd, pmargin, pword = verdict(kind, stats[x], stats[y], "plateau")
        settled = f"{p} | {pd:+.3f} ({pmargin:.3f}) | {pword}" if kind != "B" else f"{p} | |"
        lines.append(f"| {claim} | {paper} | {fmt(x)}; {fmt(y)} | {stats[x]['B_mean']:.2f} vs "
                     f"{stats[y]['B_mean']:.2f} | {'B' if kind == 'B' else 'A'} {d:+.3f} ({margin:.3f}) | {word} | "
                     f"{settled} |")
    return lines


def checks(stats):
    """Is the miniature fit for judging claims: the default's seed spread and identified fits, and how well every
    run's first half predicts its end."""
    lines = ["| check | target | ours | met |", "|---|---|---|---|"]
    s = stats.get("scalerl")
    if s and s["n"]:
        lines.append(f"| seed spread of A, default recipe (seeds: {s['n']}) | std <= {NOISE} (paper: ±0.015) | "
                     f"{s['A_mean']:.3f} ± {s['A_sd']:.3f} | {'yes' if s['A_sd'] <= NOISE else 'no'} |")
        each = lambda key, fmt: ", ".join(format(r[key], fmt) for r in s["runs"])  # noqa: E731
        ok = not s["unfitted"] and all(r["reach"] >= 3 and r["fit"].A < 0.99 and r["band"] <= 0.05 for r in s["runs"])
        lines.append(f"| identified: window >= 3 x C_mid, A below its bound 1, 90% band <= 0.05 | every seed | "
                     f"reach {each('reach', '.1f')}; A {', '.join(format(r['fit'].A, '.3f') for r in s['runs'])}; "
                     f"band {each('band', '.3f')} | {'yes' if ok else 'no'} |")
    runs = [r for v in stats.values() for r in v["runs"] if not np.isnan(r["pred_final"])]
    if runs:
        final = sum(abs(r["pred_final"]) <= NOISE for r in runs)
        last3 = sum(abs(r["pred_last3"]) <= NOISE for r in runs)
        worst = max(abs(r["pred_final"]) for r in runs)
        lines.append(f"| the fit on the first half predicts the final evaluation | within {NOISE}, every run | "
                     f"{final} of {len(runs)} (worst {worst:.3f}); the mean of the last 3: {last3} of {len(runs)} | "
                     f"{'yes' if final == len(runs) else 'no'} |")
    return lines


def variants_table(stats):
    lines = ["| variant | flags | seeds | final | plateau | A (mean ± std) | the budget's bound | 90% band | "
             "window / C_mid | B | C_mid (geo. mean) | first half predicts final / last 3 | mismatch_kl | trunc |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v, s in stats.items():
        lines.append(f"| {v} | {' '.join(VARIANTS[v]) or '(preset)'} | {s['n']} | {s['final_mean']:.3f} | "
                     f"{s['plateau_mean']:.3f} ± {s['plateau_sd']:.3f} | {s['A_mean']:.3f} ± {s['A_sd']:.3f} | "
                     f"{s['bound']:.3f} | {s['band_mean']:.3f} | {s['reach_mean']:.1f} | "
                     f"{s['B_mean']:.2f} | {s['C_mid_mean']:.3g} | {s['pred_final_mean']:+.3f} / "
                     f"{s['pred_last3_mean']:+.3f} | {s['mismatch_kl']:+.1e} | {s['trunc_rate']:.3f} |")
    mech = [v for v, s in stats.items() if not np.isnan(s["logratio_sd"])]
    share = lambda x: "n/a" if np.isnan(x) else f"{x:.4f}"  # noqa: E731  (runs logged before the gradient weight)
    for when, sfx in (("the second half of each run's steps", ""),
                      (f"steps 1-{EARLY}, where collapses happen", "_early")):
        lines += ["", f"The mechanism, over {when} (means over seeds; docs/metrics.md):", "",
                  "| variant | lag | sd log(pi_train / pi_gen) | DAPO's rule would clip: below / above | "
                  "their gradient weight: below / above | the loss clips | mismatch on fresh tokens | gradient norm |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {v} | {m['lag_mean' + sfx]:.1f} | {m['logratio_sd' + sfx]:.3f} | "
                  f"{m['dapo_clip_low' + sfx]:.4f} / {m['dapo_clip_high' + sfx]:.4f} | "
                  f"{share(m['dapo_grad_low' + sfx])} / {share(m['dapo_grad_high' + sfx])} | "
                  f"{m['clip_frac' + sfx]:.4f} | {m['fresh_mismatch' + sfx]:.1e} | {m['grad_norm' + sfx]:.3f} |"
                  for v in mech if not np.isnan((m := stats[v])["logratio_sd" + sfx])]
    return lines + [f"Not fitted: {run}: {why}." for s in stats.values() for run, why in s["unfitted"]]


def figure(stats, names, path):
    runs = [dict(label=run_name(r["variant"], r["seed"]), C=r["C"], R=r["R"], R0=r["R0"], fit=r["fit"])
            for v in names if v in stats for r in stats[v]["runs"]]
    if runs:
        fig = sigmoid_fit.plot_runs(runs, path, xlabel=f"compute ({compute_key(names[0])})")
        # the task's ceiling beside A: what a never-slipping policy passes within the thinking budget
        for b in sorted({stats[v]["bound"] for v in names if v in stats and np.isfinite(stats[v]["bound"])}):
            fig.axes[0].axhline(b, color="k", ls=":", lw=1, label=f"the budget's bound {b:.3f}")
        fig.axes[0].legend(fontsize=7)
        fig.savefig(path, dpi=120)


def load_curves(out):
    """Every finished run's curve, from the run directories under `out` (<variant>-s<seed>, any seed). A directory
    that cannot be read is named on stderr and left out."""
    curves = []
    for d in sorted(os.listdir(out)):
        variant, _, seed = d.rpartition("-s")
        if variant in VARIANTS and seed.isdigit() and finished(os.path.join(out, d)):
            try:
                curves.append(dict(curve(out, variant, int(seed)), max_steps=max_steps(os.path.join(out, d))))
            except (ValueError, OSError) as e:
                print(f"{d}: left out of the report: {e}", file=sys.stderr)
    return curves


def kept_curves(path, have):
    """The runs of an earlier curves.json (e.g. the committed assets/ablations/curves.json) that `have` lacks; what
    it did not record is filled in: the bound; the mechanism's metrics and its early_series stay unknown (absent:
    summarize and the notebook read them with .get)."""
    done = {(c["variant"], c["seed"]) for c in have}
    old = [c for c in json.load(open(path)) if (c["variant"], c["seed"]) not in done and c["variant"] in VARIANTS]
    for c in old:
        c.setdefault("bound", bound(scalerl.parse_args([*preset(c["variant"]), *VARIANTS[c["variant"]]])))
    return old


def report(out, seeds=SEEDS, keep=None):
    curves = load_curves(out)
    curves += kept_curves(keep, curves) if keep else []
    json.dump(curves, open(os.path.join(out, "curves.json"), "w"), indent=0)
    stats = summarize(curves)
    lengths = sorted({c["max_steps"] for c in curves})
    lines = ["# The paper in miniature (`--config=miniature`, seeds are --rl_seed; compute: cpu_hours, "
             "2-process runs: device_hours)", "", "Regenerate: `python runs/ablations.py` (finished runs are skipped).",
             ""] + ([f"Warning: the runs have different lengths ({', '.join(map(str, lengths))} steps); compare runs "
                     "of one length.", ""] if len(lengths) > 1 else []) + [
             "## Fit for purpose", "", *checks(stats), "", "## Verdicts by a stated test", "",
             "Shown / reversed: a two-sided Welch test and an exact permutation test over seeds both at p < 0.05; not "
             "separated: TOST at ±0.02 passes at 5%; else undecided, with the seeds a side for 80% power at the "
             "observed gap. A only from identified fits; each spread at least the evaluation noise (R0's spread over "
             "seeds / sqrt(evaluations averaged)).", "", *tests_table(stats), "",
             "## Claims (the earlier rule: the gap against 0.02 and a Welch t-interval)", "", *claims(stats), "",
             "## Variants", "",
             *variants_table(stats), ""]
    for name, names in FIGURES.items():
        if any(stats.get(v, {}).get("n") for v in names):
            figure(stats, names, os.path.join(out, f"{name}.png"))
            lines += [f"![{name}]({name}.png)", ""]
    missing = [run_name(v, s) for v in VARIANTS for s in seeds if not any(
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
    ap.add_argument("--keep", help="an earlier curves.json: its runs that --out lacks join the report")
    args, extra = ap.parse_known_args()  # anything else goes to every scalerl.py run, e.g. --max_steps=100
    names = list(dict.fromkeys(args.only.split(","))) if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",")))
    except ValueError:
        seeds = [-1]
    if min(seeds) < 0:
        ap.error(f"--seeds must be comma-separated integers >= 0, got {args.seeds!r}")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    os.makedirs(args.out, exist_ok=True)
    codes = []
    if not args.report:
        order = [(v, s) for s in seeds for v in names]  # the first seed of every variant first: a partial set compares
        with ThreadPoolExecutor(args.jobs) as pool:  # the 2-process runs after, alone: each takes both cores
            codes = list(pool.map(lambda vs: launch(*vs, args.out, extra), [x for x in order if x[0] not in TORCHRUN]))
        codes += [launch(v, s, args.out, extra) for v, s in order if v in TORCHRUN]
    report(args.out, seeds, args.keep)
    if any(codes):
        sys.exit(f"{sum(c != 0 for c in codes)} run(s) failed; see their stdout.log")


if __name__ == "__main__":
    main()
