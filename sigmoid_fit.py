"""sigmoid_fit.py: predict where an RL run will plateau, from the first part of its curve.

The paper's curve (Sec. 2.1, App. A.4-A.7): R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B), the pass rate from R0
before RL (measured) to the asymptote A over compute C (device-hours); B: efficiency; C_mid: half the gain. Choices:
1. Grid search (App. A) over A and C_mid with the least-squares B in every cell: the paper's grid, or by default one
   that adapts to the data and zooms in (ours: a CPU run counts thousandths of a device-hour, its A can be below 0.45).
2. Early points can be left out (App. A: below ~1.5k of a ~16k GPU-hour run, an almost linear regime).
3. Extrapolation check (Sec. 2.1): fit on the first half of the compute budget, compare with the rest of the run.
4. Noise margin (App. A): A varies by about +-0.015 across identical runs, the paper treats +-0.02 as noise; we add a
   residual bootstrap of A. Recipes whose A agree within 0.02 are compared by B at their mean A.
5. Power-law baseline R = A - D / C**B (App. A): it overshoots the ceiling when fitted early.
6. "Slope equals B" (Fig. 7): log((R - R0) / (A - R)) is a straight line of slope B in log C.
"""
import argparse
from collections import namedtuple
import csv
import json
import os
import re
import sys

import numpy as np
from scipy.optimize import least_squares, minimize_scalar
from scipy.optimize.elementwise import find_minimum
from scipy.special import expit

# The paper's grid (App. A): C_mid in GPU-hours, evenly spaced (the paper does not say). Ours: A in [R0, 1], B_BOUNDS.
PAPER_A_GRID = np.round(np.arange(0.450, 0.8001, 0.005), 3)
PAPER_CMID_GRID = np.linspace(100.0, 40000.0, 100)
B_BOUNDS = (0.05, 20.0)
MIN_POINTS = 4  # one more than the three fitted parameters
NOISE_MARGIN = 0.02


class TooFewPoints(ValueError):
    """Fewer than MIN_POINTS points in the fit window: a report on several runs notes the run and fits the rest."""


def _check(ok, message, error=ValueError):
    if not ok:
        raise error(message)


def sigmoid(C, A, B, C_mid, R0):
    """The paper's curve, as R0 + (A - R0) * expit(B * (log C - log C_mid)): no overflow, and R0 at C = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logc = np.log(np.asarray(C, dtype=float))
    return R0 + (A - R0) * expit(B * (logc - np.log(C_mid)))


class SigmoidFit(namedtuple("SigmoidFit", "A B C_mid R0 sse rmse window n_points A_std A_ci")):
    """sse, rmse: over the n_points fitted points, window: their compute range; A_std, A_ci: bootstrap std, 5-95%."""
    def predict(self, C):
        return sigmoid(C, self.A, self.B, self.C_mid, self.R0)


class PowerLawFit(namedtuple("PowerLawFit", "A D B sse rmse")):
    def predict(self, C):
        return self.A - self.D / np.asarray(C, dtype=float) ** self.B


def _window(C, R, c_min, c_max):
    C, R = np.asarray(C, dtype=float).ravel(), np.asarray(R, dtype=float).ravel()
    _check(C.shape == R.shape and np.all(np.isfinite(C)) and np.all(np.isfinite(R)),
           f"compute and pass rate must be finite numbers of equal length ({C.size} vs {R.size})")
    keep = (C > 0) & (C >= (c_min if c_min is not None else 0)) & (C <= (c_max if c_max is not None else np.inf))
    _check(keep.sum() >= MIN_POINTS, f"need at least {MIN_POINTS} points with compute > 0 in the fit window, got "
           f"{keep.sum()}", TooFewPoints)
    return C[keep], R[keep]


def _grid_search(a_vals, logcm_vals, logc, R, R0, n_grid=25):
    """Every (A, C_mid) pair of the two grids with its least-squares B, all cells at once: a coarse log-grid of B
    brackets the minimum, scipy's elementwise minimizer narrows it. Returns (A, B, log C_mid, sse) of the best cell."""
    A, L = (m.ravel() for m in np.meshgrid(a_vals, logcm_vals, indexing="ij"))
    # Elementwise over cells (gain A - R0, log C_mid as arguments): find_minimum passes only the cells still searching.
    def sse(logb, gain, logcm):
        return ((R0 + gain[..., None] * expit(np.exp(logb)[..., None] * (logc - logcm[..., None])) - R) ** 2).sum(-1)
    grid = np.linspace(np.log(B_BOUNDS[0]), np.log(B_BOUNDS[1]), n_grid)
    on_grid = np.stack([sse(g, A - R0, L) for g in grid])
    j = on_grid.argmin(0)
    # The best grid point and its neighbours bracket the minimum; at a bound of B (no bracket) the grid point stays.
    k = np.clip(j, 1, n_grid - 2)
    res = find_minimum(sse, (grid[k - 1], grid[k], grid[k + 1]), args=(A - R0, L))
    logb, err = np.where(res.success, res.x, grid[j]), np.where(res.success, res.f_x, on_grid.min(0))
    i = err.argmin()
    return A[i], np.exp(logb[i]), L[i], err[i]


def fit_sigmoid(C, R, R0, c_min=None, c_max=None, paper_grid=False, n_boot=100, seed=0, fix_A=None):
    """A, B, C_mid with R0 fixed, on the points with C > 0 in [c_min, c_max] (choices 1, 2); n_boot refits give A's
    spread (~0.2 s per 100 for 50 points); fix_A fits B, C_mid at that A (choice 4)."""
    _check(0 <= R0 < 1, f"R0 must be a pass rate in [0, 1), got {R0}")
    _check(fix_A is None or R0 < fix_A <= 1, f"fix_A must lie in (R0, 1] = ({R0}, 1], got {fix_A}")
    C, R = _window(C, R, c_min, c_max)
    _check(np.all(np.diff(C) >= 0), "compute must not decrease from one point to the next")
    _check(R.max() - R0 >= 0.01, f"pass rate never rises above R0={R0:.3f} by 0.01 (max {R.max():.3f}); nothing to fit")
    logc, (a_lo, a_hi) = np.log(C), (fix_A, fix_A) if fix_A is not None else (R0, 1.0)
    if paper_grid:
        a_vals = PAPER_A_GRID[PAPER_A_GRID >= R0] if fix_A is None else np.array([fix_A])
        _check(a_vals.size > 0, f"R0={R0} is above the paper's A grid (0.45..0.80); use the adaptive grid")
        l_vals = np.log(PAPER_CMID_GRID)
    else:
        a_vals = np.unique(np.linspace(a_lo, a_hi, 41))
        l_vals = np.linspace(logc.min() - np.log(10), logc.max() + np.log(100), 61)
    A, B, L, sse = _grid_search(a_vals, l_vals, logc, R, R0)
    da, dl = (a_hi - a_lo) / 40, l_vals[1] - l_vals[0]
    # Zoom the adaptive grid in; A and C_mid trade off along a narrow valley, so a best cell on the edge is followed.
    for _ in range(0 if paper_grid else 50):
        a_z = np.unique(np.clip(np.linspace(A - 2 * da, A + 2 * da, 11), a_lo, a_hi))
        l_z = np.linspace(L - 2 * dl, L + 2 * dl, 11)
        A, B, L, sse = _grid_search(a_z, l_z, logc, R, R0)
        if not (L in (l_z[0], l_z[-1]) or (A in (a_z[0], a_z[-1]) and a_lo < A < a_hi)):
            da, dl = da / 2, dl / 2
        if dl < 1e-4:
            break
    lo, hi = [R0, B_BOUNDS[0], min(l_vals.min(), L)], [1.0, B_BOUNDS[1], max(l_vals.max(), L)]
    def curve(p):
        return R0 + (p[0] - R0) * expit(p[1] * (logc - p[2]))
    # Residual bootstrap: least squares in p = (A, B, log C_mid) on the fitted curve plus resampled residuals.
    def refit(y):
        p0 = np.clip([A, B, L], np.add(lo, 1e-9), np.subtract(hi, 1e-9))
        return least_squares(lambda p: curve(p) - y, p0, bounds=(lo, hi)).x
    fitted, rng = curve([A, B, L]), np.random.default_rng(seed)
    a = [A] if fix_A is not None else [refit(fitted + rng.choice(R - fitted, size=R.size))[0] for _ in range(n_boot)]
    a_std, a_ci = (float(np.std(a)), tuple(np.percentile(a, [5, 95]).tolist())) if a else (np.nan, (np.nan, np.nan))
    return SigmoidFit(float(A), float(B), float(np.exp(L)), float(R0), float(sse), float(np.sqrt(sse / len(C))),
                      (float(C.min()), float(C.max())), len(C), a_std, a_ci)


def fit_power_law(C, R, c_min=None, c_max=None):
    """R = A - D / C**B with A <= 1 (choice 5): (A, D) by linear least squares for each B, B on a log-grid, refined."""
    C, R = _window(C, R, c_min, c_max)
    def solve(b):
        x = C ** -b
        (A, D), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), -x], axis=1), R, rcond=None)
        if A > 1.0:
            A, D = 1.0, float(x @ (1.0 - R) / (x @ x))
        return A, D, float(((A - D * x - R) ** 2).sum())
    grid = np.linspace(np.log(1e-3), np.log(10.0), 80)
    j = int(np.argmin([solve(np.exp(g))[2] for g in grid]))
    lo, hi = grid[max(j - 1, 0)], grid[min(j + 1, len(grid) - 1)]
    B = float(np.exp(minimize_scalar(lambda g: solve(np.exp(g))[2], bounds=(lo, hi), method="bounded").x))
    A, D, sse = solve(B)
    return PowerLawFit(float(A), float(D), B, sse, float(np.sqrt(sse / len(C))))


# The errors on the points after the fit window; final_err is signed: prediction minus measurement.
ExtrapolationCheck = namedtuple("ExtrapolationCheck", "fit max_abs_err mean_abs_err final_err n_test")


def extrapolation_check(C, R, R0, fit_fraction=0.5, fit_until=None, **fit_kw):
    """Fit on C <= fit_until (default: fit_fraction of the budget), measure the prediction's error after (choice 3)."""
    C, R = np.asarray(C, dtype=float), np.asarray(R, dtype=float)
    cut = fit_until if fit_until is not None else fit_fraction * C.max()
    fit = fit_sigmoid(C, R, R0, c_max=cut, **fit_kw)
    test = C > cut
    _check(test.any(), f"no points after the fit window (C <= {cut:.4g}) to check the extrapolation on")
    err = fit.predict(C[test]) - R[test]
    return ExtrapolationCheck(fit, float(np.abs(err).max()), float(np.abs(err).mean()), float(err[-1]), int(test.sum()))


def slope_transform(C, R, A, R0):
    """(log C, log((R - R0) / (A - R))), NaN unless R0 < R < A: on the curve, a line of slope B through log C_mid."""
    C, R = np.asarray(C, dtype=float), np.asarray(R, dtype=float)
    ok = (C > 0) & (R > R0) & (R < A)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(C > 0, np.log(C), np.nan), np.where(ok, np.log((R - R0) / (A - R)), np.nan)


def plot_runs(runs, path, power_law=False, fit_until=None, xlabel="compute (device-hours)"):
    """Pass rate against log compute, saved to path; returns the figure. runs: dicts of label, C, R, R0, fit and power
    (else fitted here on C <= fit_until). Filled points: the fit window; dashed: extrapolation; band: A +- 0.02."""
    # No pyplot: draws headless and leaves the caller's backend alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter
    fig = Figure(figsize=(7, 4.5), layout="tight")
    ax = fig.subplots()
    for i, run in enumerate(runs):
        color, C, R = f"C{i}", np.asarray(run["C"], dtype=float), np.asarray(run["R"], dtype=float)
        fit = run.get("fit") or fit_sigmoid(C, R, run["R0"], c_max=fit_until, n_boot=0)
        lo, hi = fit.window
        inside = (C >= lo) & (C <= hi)
        ax.scatter(C[inside], R[inside], s=12, color=color, alpha=0.7)
        ax.scatter(C[~inside & (C > 0)], R[~inside & (C > 0)], s=12, facecolors="none", edgecolors=color)
        x_in, x_out = np.geomspace(lo, hi, 200), np.geomspace(hi, max(C.max(), hi) * 4, 100)
        pm = f"+-{fit.A_std:.3f}" if np.isfinite(fit.A_std) else ""
        ax.plot(x_in, fit.predict(x_in), color=color,
                label=f"{run['label']}: A={fit.A:.3f}{pm} B={fit.B:.2f} C_mid={fit.C_mid:.3g}")
        ax.plot(x_out, fit.predict(x_out), "--", color=color)
        ax.axhline(fit.A, color=color, lw=0.8, alpha=0.6)
        ax.axhspan(fit.A - NOISE_MARGIN, fit.A + NOISE_MARGIN, color=color, alpha=0.08)
        if power_law:
            pl = run.get("power") or fit_power_law(C, R, c_min=lo, c_max=hi)
            xs = np.concatenate([x_in, x_out])
            ax.plot(xs, np.minimum(pl.predict(xs), 1.0), ":", color=color, label=f"  power law: A={pl.A:.3f}")
    ax.set(xscale="log", xlabel=xlabel, ylabel="pass rate")
    # Readable ticks: matplotlib labels every minor tick of an axis about a decade long, and the labels overlap.
    ax.xaxis.set_minor_formatter(NullFormatter())
    c_lo, c_hi = np.log10(ax.get_xlim())
    if np.floor(c_hi) - np.ceil(c_lo) < 1:
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5) if c_hi - c_lo >= 1 else (1, 2, 3, 5)))
        ax.xaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(np.inf, np.inf)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    return fig


def _log_lines(path):
    """(path, its non-blank lines as (line number, text)); a run directory means its metrics.jsonl."""
    path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    _check(os.path.isfile(path), f"{path}: no such file (expected a metrics.jsonl, a run directory or a CSV)")
    with open(path) as f:
        return path, [(i + 1, s) for i, s in enumerate(f) if s.strip()]


def _jsonl_rows(path, lines):
    """(line number, row) of a metrics.jsonl's rows; a torn last line (a kill mid-write) is skipped with a warning."""
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            _check(n == lines[-1][0], f"{path}:{n}: not valid JSON ({e.msg})")
            print(f"warning: {path}:{n}: ignoring a torn last line ({e.msg})", file=sys.stderr)
            continue
        if isinstance(row, dict):
            yield n, row


def _csv_rows(path, lines, compute_key, metric_key):
    """(line number, compute, metric) of a CSV by its first row's column names (`compute` stands for device_hours)."""
    table = [(n, [c.strip() for c in next(csv.reader([line]))]) for n, line in lines]
    names = table.pop(0)[1] if table else [compute_key, metric_key]
    _check(not any(re.fullmatch(r"[-+.\deE]+|nan|inf", c) for c in names),
           f"{path}: the first row holds numbers, not column names; add a header row, e.g. compute,pass_rate")
    if compute_key == "device_hours" and compute_key not in names and "compute" in names:
        compute_key = "compute"
    for key, flag in ((metric_key, "--metric"), (compute_key, "--compute")):
        _check(key in names, f"{path} has no column {key!r} (columns: {', '.join(names)}); pass {flag}=NAME")
    cols = names.index(compute_key), names.index(metric_key)
    for n, cells in table:
        try:
            yield n, float(cells[cols[0]]), float(cells[cols[1]])
        except (ValueError, IndexError):
            raise ValueError(f"{path}:{n}: expected numbers in columns {compute_key!r} and {metric_key!r}, got "
                             f"{','.join(cells)!r}") from None


def read_points(path, compute_key="device_hours", metric_key="pass_rate"):
    """(C, R) of the points with C > 0, and R at C = 0 (None if absent), from a metrics.jsonl's eval rows or a CSV."""
    path, lines = _log_lines(path)
    if path.lower().endswith(".csv"):
        rows = list(_csv_rows(path, lines, compute_key, metric_key))
    else:
        rows = []
        for n, row in _jsonl_rows(path, lines):
            if metric_key in row:
                _check(all(isinstance(row.get(k), (int, float)) for k in (compute_key, metric_key)),
                       f"{path}:{n}: eval row needs numbers {compute_key!r} and {metric_key!r}")
                rows.append((n, float(row[compute_key]), float(row[metric_key])))
    _check(rows, f"{path}: no points found (expected rows with {compute_key!r} and {metric_key!r})")
    n, C, R = (np.array(v) for v in zip(*rows))
    _check(np.all(np.isfinite(C)) and np.all(np.isfinite(R)) and C.min() >= 0,
           f"{path}: compute must be finite and >= 0, pass rates finite")
    if np.any(np.diff(C) < 0):
        k = int(np.argmax(np.diff(C) < 0)) + 1
        raise ValueError(f"{path}:{n[k]}: compute decreases ({C[k - 1]:.4g} then {C[k]:.4g}); it must not")
    r0 = float(R[C == 0][0]) if np.any(C == 0) else None
    return C[C > 0], R[C > 0], r0


def per_task_metrics(path):
    """The `pass_rate_<task>` columns of a run's metrics.jsonl, in order of first appearance (none in a CSV)."""
    path, lines = _log_lines(path)
    rows = [] if path.lower().endswith(".csv") else _jsonl_rows(path, lines)
    return list(dict.fromkeys(k for _, row in rows for k in row if k.startswith("pass_rate_")))


def analyze(paths, plot=None, fit_until=None, c_min=None, r0=None, power_law=False, metric_key="pass_rate",
            compute_key="device_hours"):
    """The report on every run: the fit, A's bootstrap spread, the extrapolation check. paths: run directories or
    files, or (path, metric) for one task's curve. A run too short to fit is noted, an error if no run can be fit."""
    runs, skipped, notes = [], [], []
    table = [f"{'run':<28} {'n':>4} {'window':>19} {'R0':>6} {'A':>6} {'A 90% (boot)':>13} {'B':>5} {'C_mid':>9} "
             f"{'rmse':>7}"]
    for p in paths:
        p, key = p if isinstance(p, tuple) else (p, metric_key)
        C, R, r0_guess = read_points(p, compute_key=compute_key, metric_key=key)
        R0 = r0 if r0 is not None else r0_guess
        _check(R0 is not None, f"{p}: no point at compute 0 to take R0 from; add one or pass --r0")
        # The label: the run directory's name or the file name of a CSV, and the task of a per-task curve.
        q = os.path.normpath(p)
        label = os.path.basename(os.path.dirname(q) if q.endswith("metrics.jsonl") else q) or p
        label += f":{key[len('pass_rate_'):]}" if key != metric_key and key.startswith("pass_rate_") else ""
        try:
            fit = fit_sigmoid(C, R, R0, c_min=c_min, c_max=fit_until)
            power = fit_power_law(C, R, c_min=c_min, c_max=fit_until) if power_law else None
        except TooFewPoints as e:
            skipped.append((p, label, e))
            continue
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
        runs.append(dict(label=label, C=C, R=R, R0=R0, fit=fit, power=power))
        table.append(f"{label[-28:]:<28} {fit.n_points:>4} {'[%.3g, %.3g]' % fit.window:>19} {R0:>6.3f} {fit.A:>6.3f} "
                     f"{fit.A_ci[0]:>6.3f}-{fit.A_ci[1]:.3f} {fit.B:>5.2f} {fit.C_mid:>9.3g} {fit.rmse:>7.4f}")
        notes.append(f"\n{label}: A = {fit.A:.3f} +- {fit.A_std:.3f} (bootstrap std over the fit window); "
                     f"the paper treats A differences below {NOISE_MARGIN} as noise.")
        if fit.window[1] < 3 * fit.C_mid:
            notes.append(f"  note: the fit window ends below 3 x C_mid ({fit.window[1]:.3g} < {3 * fit.C_mid:.3g}):"
                         " A is an extrapolation, train longer to pin it down.")
        try:
            ex = extrapolation_check(C, R, R0, fit_until=fit_until, c_min=c_min, n_boot=0)
            notes.append(f"  extrapolation: fit on C <= {ex.fit.window[1]:.3g} ({ex.fit.n_points} points, "
                         f"A={ex.fit.A:.3f}), predict {ex.n_test} later points: max |err| {ex.max_abs_err:.4f}, "
                         f"mean {ex.mean_abs_err:.4f}, final {ex.final_err:+.4f} (prediction - measured)")
        except ValueError as e:
            notes.append(f"  extrapolation check skipped: {e}")
        if power is not None:
            notes.append(f"  power law R = A - D/C^B: A={power.A:.3f} D={power.D:.3g} B={power.B:.3f} "
                         f"rmse={power.rmse:.4f} (A {power.A - fit.A:+.3f} vs the sigmoid)")
    _check(runs, "; ".join(dict.fromkeys(f"{p}: {e}" for p, _, e in skipped)))
    out = table + [f"{label}: skipped: {e}" for _, label, e in skipped] + notes
    if plot:
        plot_runs(runs, plot, power_law=power_law, fit_until=fit_until, xlabel=f"compute ({compute_key})")
        out.append(f"\nwrote {plot}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Fit the ScaleRL compute-performance sigmoid to run logs.")
    ap.add_argument("paths", nargs="+", help="metrics.jsonl, run directory or CSV (header: compute,pass_rate)")
    ap.add_argument("--fit-until", type=float, help="fit on compute <= X, check the prediction after it")
    ap.add_argument("--c-min", type=float, help="exclude points with compute < X (paper: 1.5k GPU-hours)")
    ap.add_argument("--r0", type=float, help="pass rate before RL (default: the log's row at compute 0)")
    ap.add_argument("--plot", help="write the figure to this PNG")
    ap.add_argument("--power-law", action="store_true", help="also fit the power-law baseline")
    ap.add_argument("--metric", default="pass_rate", help="eval column to fit (default pass_rate)")
    ap.add_argument("--compute", default="device_hours", help="compute column (default device_hours; cpu_hours: "
                    "CPU time of the training process, steady on a busy machine)")
    ap.add_argument("--per-task", action="store_true", help="fit each pass_rate_<task> column of a multi-task run")
    args = ap.parse_args(argv)
    try:
        paths = args.paths
        if args.per_task:
            paths = [(p, key) for p in args.paths for key in per_task_metrics(p)]
            for p in args.paths:
                _check(p in dict(paths), f"{p}: no pass_rate_<task> columns (a single-task run); drop --per-task")
        print(analyze(paths, plot=args.plot, fit_until=args.fit_until, c_min=args.c_min, r0=args.r0,
                      power_law=args.power_law, metric_key=args.metric, compute_key=args.compute))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
