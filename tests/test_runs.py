"""runs/ablations.py, as a user runs it: launches runs into their own directories, passes extra flags to every run,
skips finished ones, and writes its report even when the runs are too short to fit; and its verdicts, on curves
drawn from known sigmoids."""
import json
import os
import sys
import zlib

import numpy as np
import pytest

from conftest import ROOT, run_command
sys.path.insert(0, os.path.join(ROOT, "runs"))
import ablations  # noqa: E402
import sigmoid_fit  # noqa: E402
SMOKE = ["--max_steps=2", "--eval_every=1", "--eval_prompts=8", "--eval_samples=2", "--n_train=200", "--sft_steps=20",
         "--batch_prompts=4", "--group_size=4", "--slots=16", "--ckpt_every=1"]


def run_ablations(out, *args):
    return run_command([sys.executable, os.path.join(ROOT, "runs", "ablations.py"), "--out", str(out), *args])


@pytest.mark.slow
def test_launch_skip_resume_and_report(tmp_path):
    p = run_ablations(tmp_path, "--only", "dapo", "--seeds", "0,1", "--jobs", "2", *SMOKE)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for name in ("dapo-s0", "dapo-s1"):
        assert os.path.exists(tmp_path / name / "ckpt.pt") and os.path.exists(tmp_path / name / "stdout.log")
    config = open(tmp_path / "dapo-s1" / "config.json").read()
    assert '"loss": "dapo"' in config and '"rl_seed": 1' in config and '"levels": "1,2,3,4,5,6,7,8"' in config
    assert os.path.exists(tmp_path / "results.md")  # written even though 2 steps are too few to fit
    assert len(ablations.load_curves(str(tmp_path))) == 2  # curves.json's source: every finished run
    # a finished run level by level: each of the miniature's 8 levels, its pass rate beside the budget's bound
    p = run_command([sys.executable, os.path.join(ROOT, "runs", "levels.py"), str(tmp_path / "dapo-s0")])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 9)) and all(0 <= float(r[3]) <= 1 for r in rows)
    assert [float(r[4]) for r in rows][:4] == [1.0] * 4 and float(rows[-1][4]) == 0.0  # levels 7-8 outgrow 36-48
    # a second launch skips the finished runs and leaves them untouched
    before = open(tmp_path / "dapo-s0" / "metrics.jsonl").read()
    p = run_ablations(tmp_path, "--only", "dapo", "--seeds", "0,1", *SMOKE)
    assert p.returncode == 0 and p.stdout.count("finished, skipped") == 2
    assert open(tmp_path / "dapo-s0" / "metrics.jsonl").read() == before


@pytest.mark.slow
def test_a_two_process_run_goes_through_torchrun(tmp_path):
    """The off-policy comparison where generation and training overlap: a generator rank and a trainer rank."""
    p = run_ablations(tmp_path, "--only", "pipeline_2proc", "--seeds", "0", *SMOKE)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "torch.distributed.run --standalone --nproc_per_node=2" in p.stdout
    log = open(tmp_path / "pipeline_2proc-s0" / "stdout.log").read()
    assert "torchrun: 2 ranks | trainer ranks [0] | generator ranks [1]" in log, log[-2000:]
    assert os.path.exists(tmp_path / "pipeline_2proc-s0" / "ckpt.pt") and os.path.exists(tmp_path / "results.md")


def test_unknown_run_is_refused(tmp_path, monkeypatch, capsys):
    """In this process (ablations.main, what the command runs): a refusal needs no process of its own."""
    for argv, needle in ((["--only", "scalerl,nonsense"], "unknown variant(s) nonsense"),
                         (["--seeds", "0,one"], "--seeds must be comma-separated integers >= 0, got '0,one'")):
        monkeypatch.setattr(sys, "argv", ["ablations.py", "--out", str(tmp_path), *argv])
        with pytest.raises(SystemExit) as e:
            ablations.main()
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing launched


def synthetic(variant, seed, A, B=1.5, c_mid=0.02, r0=0.3, noise=0.01, reach=8):
    """A run's curve drawn from a known sigmoid, 30 evaluations out to `reach` x C_mid, with Gaussian noise."""
    C = np.linspace(reach * c_mid / 30, reach * c_mid, 30)
    rng = np.random.default_rng([seed, zlib.crc32(variant.encode())])
    R = sigmoid_fit.sigmoid(C, A, B, c_mid, r0) + rng.normal(0, noise, 30)
    return dict(variant=variant, seed=seed, compute="cpu_hours", C=list(C), R=list(R), R0=r0, steps=300,
                mismatch_kl=0.0, trunc_rate=0.1, zero_var_frac=0.3)


def test_claims_separate_what_differs_and_not_what_does_not():
    """Three seeds each: a 0.10 gap in A is seen in its direction, a reversed one is opposite, equal A's are within
    the noise (and pass as an efficiency-only choice); each fit recovers its A and predicts its end from half."""
    curves = [synthetic(v, s, A) for v, A in [("bf16_fp32_head", 0.65), ("bf16_bf16_head", 0.55), ("scalerl", 0.6),
                                              ("dapo", 0.7), ("sample_agg", 0.6)] for s in range(3)]
    stats = ablations.summarize(curves)
    assert abs(stats["scalerl"]["A_mean"] - 0.6) < 0.02 and stats["scalerl"]["A_sd"] < 0.02
    assert stats["scalerl"]["reach_mean"] > 3 and abs(stats["scalerl"]["pred_last3_mean"]) < 0.02
    fit_for_purpose = ablations.checks(stats)  # 0.01 of noise per evaluation: seed spread and identification pass
    assert len(fit_for_purpose) == 5 and all(line.endswith("| yes |") for line in fit_for_purpose[2:4])
    assert " of 15 (worst " in fit_for_purpose[4]  # a single evaluation's noise alone can miss by 0.02
    table = "\n".join(ablations.claims(stats))
    assert "| FP32 head raises A (same bf16 body) |" in table
    row = lambda claim: next(line for line in table.splitlines() if line.startswith(f"| {claim} |"))  # noqa: E731
    assert row("FP32 head raises A (same bf16 body)").endswith("| seen, the paper's direction |")
    assert row("CISPO above DAPO").endswith("| opposite to the paper |")
    assert "| A within the noise" in row("aggregation moves efficiency only")  # (t-interval of 3 seeds a side)
    assert "no fitted run yet of gspo" in row("GSPO above DAPO")
    same = ablations.summarize([synthetic("scalerl", s, 0.6) for s in range(3)] +
                               [synthetic("think_64", s, 0.61) for s in range(3)])
    assert ablations.verdict("ceiling", same["think_64"], same["scalerl"])[2] == "not separated (within the noise)"
    one = ablations.summarize([synthetic("scalerl", 0, 0.6), synthetic("dapo", 0, 0.5)])  # one seed: no verdict
    assert ablations.verdict("ceiling", one["scalerl"], one["dapo"])[2].startswith("fewer than 2 fitted seeds")
    flat = dict(synthetic("no_npr", 0, 0.6), R=[0.3] * 30)  # never rises above R0: named, in no mean
    s = ablations.summarize([flat, synthetic("no_npr", 1, 0.6)])["no_npr"]
    assert s["n"] == 1 and s["unfitted"][0][0] == "no_npr-s0" and "never rises above R0" in s["unfitted"][0][1]


def test_the_stated_tests_on_seed_samples_with_known_answers():
    """The exact permutation test: 3 vs 3 seeds can never reach p < 0.05 however far apart (20 splits, the observed
    one and its mirror count); 4 vs 4 can (2 of 70). Identical distributions pass the equivalence test; a large gap
    over 5 seeds is separated by both tests; the same gap over 3 seeds is undecided, and 4 seeds a side would decide;
    a gap inside the evaluation-noise floor is not separated even when the seeds agree exactly."""
    lo, hi = [0.50, 0.51, 0.52], [0.80, 0.81, 0.82]
    assert ablations.permutation_p(np.array(hi), np.array(lo)) == pytest.approx(0.1)
    assert ablations.permutation_p(np.array(hi + [0.83]), np.array(lo + [0.53])) == pytest.approx(2 / 70)
    three = ablations.compare(hi, lo)
    assert three["p_welch"] < 1e-4 and three["p_perm"] == pytest.approx(0.1)
    assert three["outcome"] == "undecided" and three["seeds"] == 4
    assert ablations.word("ceiling", three) == "undecided: 4 seeds a side would decide"
    rng = np.random.default_rng(0)
    same = rng.normal(0.6, 0.005, 10)
    eq = ablations.compare(same[:5], same[5:])
    assert eq["outcome"] == "equivalent" and eq["p_tost"] < 0.05 and ablations.word("ceiling", eq) == "not separated"
    assert ablations.word("efficiency", eq) == "shown (the same within ±0.02)"
    far = ablations.compare(same[:5] + 0.1, same[5:])
    assert far["outcome"] == "separated" and ablations.word("ceiling", far) == "shown"
    assert ablations.word("ceiling", ablations.compare(same[5:], same[:5] + 0.1)) == "reversed"
    assert ablations.word("efficiency", far).startswith("reversed (moved +0.1")
    # seeds that agree exactly, 0.004 apart: separated with no floor, not with the evaluation noise's 0.01 under them
    assert ablations.compare([0.604] * 5, [0.6] * 5)["outcome"] == "separated"
    floored = ablations.compare([0.604] * 5, [0.6] * 5, floor=0.01)
    assert floored["outcome"] == "equivalent" and floored["p_welch"] > 0.4
    # a gap of 0.01 with a spread of 0.02: undecided; the seeds for 80% power grow as the gap shrinks
    n = [ablations.compare(x + g, x)["seeds"] for g in (0.03, 0.06) for x in [rng.normal(0.6, 0.02, 3)]]
    assert n[0] > n[1] >= 4


def test_verdicts_need_identified_fits_and_matched_compute():
    """A is judged only on identified fits (a run whose window ends before 3 x C_mid, or whose A is above the task's
    bound, is named instead); a variant that spends twice the compute on the same curve is compared at the cheaper
    one's compute (the plain plateau would credit it with the extra compute); the noise floor comes from R0."""
    curves = [dict(synthetic(v, s, 0.6, r0=0.3 + 0.01 * s), bound=0.7) for v in ("scalerl", "no_npr")
              for s in range(5)]
    curves += [dict(synthetic("batch_32", s, 0.6, reach=16, r0=0.3 + 0.01 * s), bound=0.7) for s in range(5)]
    curves[5] = dict(synthetic("no_npr", 0, 0.6, reach=2), bound=0.7)  # its window ends at 2 x C_mid
    stats = ablations.summarize(curves)
    rows = {(claim, key): (t, note) for claim, _, _, _, key, t, note in ablations.judged(stats)}
    t, note = rows[("No-Positive-Resampling moves efficiency only", "A")]
    assert t is None and note.startswith("not identified: no_npr-s0 (") and "x C_mid < 3)" in note
    t, note = rows[("a larger batch raises A", "plateau")]
    assert note.startswith("compute-matched at 0.16") and abs(t["d"]) < 0.01 and t["outcome"] == "equivalent"
    plain = np.mean([ablations.plateau(c["R"]) for c in stats["batch_32"]["curves"]])
    assert plain - stats["scalerl"]["plateau_mean"] > 0.01 > 2 * abs(t["d"])  # what equal steps would have shown
    assert t["floor"] == pytest.approx(np.std([0.3, 0.31, 0.32, 0.33, 0.34], ddof=1) / np.sqrt(15))
    t, _ = rows[("a larger batch raises A", "A")]  # both identified: A judged, the same sigmoid's A
    assert t is not None and t["outcome"] == "equivalent"
    high = ablations.summarize([dict(c, bound=0.55) for c in curves[:5]])  # A 0.6 above a bound of 0.55
    assert all("above the task's bound 0.550" in ablations.unidentified(r) for r in high["scalerl"]["runs"])
    table = "\n".join(ablations.tests_table(stats))
    assert "| a larger batch raises A | plateau (compute-matched at 0.16" in table


def test_report_reads_run_directories_by_name(tmp_path):
    """Finished runs named <variant>-s<seed> (seeds of any width) are read, a run killed before its last step and a
    directory of another name are not; the report writes its tables, curves.json and figures."""
    for variant, seed, A in [("bf16_fp32_head", 0, 0.65), ("bf16_fp32_head", 12, 0.64), ("no_zero_var_filter", 1, 0.6),
                             ("scalerl", 0, 0.6), ("notes", 0, 0.6)]:
        c, d = synthetic(variant, seed, A), tmp_path / f"{variant}-s{seed}"
        d.mkdir()
        (d / "config.json").write_text('{"config": {"max_steps": 300}}')
        evals = [dict(step=10 * i, eval=True, pass_rate=r, cpu_hours=x)
                 for i, (x, r) in enumerate(zip([0.0] + c["C"], [c["R0"]] + c["R"]))]
        steps = [dict(step=i, mismatch_kl=1e-4, trunc_rate=0.1, zero_var_frac=0.3, logratio_sd=0.1,
                      dapo_grad_high=0.75 if i <= 100 else 0.25 if i > 150 else 0.5) for i in range(1, 301)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in evals + steps) + "\n")
    (tmp_path / "scalerl-s0" / "config.json").write_text('{"config": {"max_steps": 400}}')  # not at its end
    ablations.report(str(tmp_path))
    curves = json.load(open(tmp_path / "curves.json"))
    assert sorted((c["variant"], c["seed"]) for c in curves) == [("bf16_fp32_head", 0), ("bf16_fp32_head", 12),
                                                                 ("no_zero_var_filter", 1)]
    # the mechanism kept twice: over steps 1-100, where collapses happen, and over the later half
    kept = {(c["dapo_grad_high_early"], c["dapo_grad_high"], c["dapo_grad_low"]) for c in curves}
    assert kept == {(0.75, 0.25, None)}
    assert all(c["early_series"]["dapo_grad_high"] == [0.75] * 100 for c in curves)  # and step by step
    md = open(tmp_path / "results.md").read()
    assert "| 0.100 | nan / nan | n/a / 0.7500 |" in md.split("steps 1-100")[1]
    assert "| bf16_fp32_head | --dtype=bfloat16 | 2 |" in md and "scalerl-s0" in md.split("Not finished yet:")[1]
    assert os.path.exists(tmp_path / "precision.png") and not os.path.exists(tmp_path / "loss.png")


def test_the_first_steps_are_kept_step_by_step(tmp_path):
    """curves.json keeps each run's mechanism over steps 1-100 step by step (4 significant digits; None where a row
    lacks a metric or a step was not logged; a resumed run's repeated step keeps its last row), beside the means;
    summarize averages the series over the runs that have one, and a run from an older curves.json without one
    counts in no series."""
    c, d = synthetic("stale_dapo", 0, 0.6), tmp_path / "stale_dapo-s0"
    d.mkdir()
    (d / "config.json").write_text('{"config": {"max_steps": 150}}')
    evals = [dict(step=5 * i, eval=True, pass_rate=r, cpu_hours=x)
             for i, (x, r) in enumerate(zip([0.0] + c["C"], [c["R0"]] + c["R"]))]
    steps = [dict(step=i, logratio_sd=0.123456789 * i, dapo_clip_low=0.01, dapo_clip_high=0.0, dapo_grad_high=1e-5 * i,
                  clip_frac=0.02, **({} if i == 3 else {"dapo_grad_low": 0.5})) for i in range(1, 151) if i != 7]
    steps.insert(18, dict(steps[18], logratio_sd=9.0))  # step 20 logged twice: a resumed run repeats it, then goes on
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in evals + steps) + "\n")
    run = ablations.load_curves(str(tmp_path))[0]
    s = run["early_series"]
    assert sorted(s) == sorted(ablations.SERIES) and all(len(x) == ablations.EARLY for x in s.values())
    assert s["logratio_sd"][:3] == [0.1235, 0.2469, 0.3704] and s["logratio_sd"][99] == 12.35
    assert s["logratio_sd"][19] == 2.469  # the repeated step's last row (not the 9.0 before it)
    assert s["dapo_grad_high"][99] == 0.001 and s["clip_frac"][0] == 0.02
    assert s["dapo_grad_low"][2] is None and s["dapo_grad_low"][3] == 0.5 and s["clip_frac"][6] is None
    assert run["dapo_grad_low_early"] == 0.5 and run == json.loads(json.dumps(run))  # what curves.json holds
    old = {k: v for k, v in run.items() if k != "early_series"}  # a run from a curves.json written before the series
    stats = ablations.summarize([run, dict(old, seed=1), dict(run, seed=2, early_series=dict(
        s, logratio_sd=[None if x is None else 2 * x for x in s["logratio_sd"]]))])["stale_dapo"]
    assert stats["early_series_n"] == 2 and stats["early_series"]["logratio_sd"][0] == pytest.approx(1.5 * 0.1235)
    assert stats["early_series"]["clip_frac"][6] is None and stats["early_series"]["dapo_grad_low"][2] is None
    none = ablations.summarize([old, dict(old, seed=1)])["stale_dapo"]
    assert none["early_series_n"] == 0 and none["early_series"] == {k: [] for k in ablations.SERIES}
