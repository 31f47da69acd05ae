"""Faults from outside the run: a second run on the same folder, a full disk, a scheduler's SIGTERM.

1. Two runs started at once on one folder: one runs, the other exits with one line naming the holder's pid (or, if
   the first got further, saying the folder holds a run); the log holds one run's rows once. A killed run's lock
   never blocks (the kill-and-resume tests in test_reliability.py resume after SIGKILL).
2. A full disk at a checkpoint: a small tmpfs where this machine lets us mount one (root), else an ENOSPC injected
   at the file layer in-process. One line naming the path, the bytes needed and what is free; no temporary file left;
   the previous checkpoint and every logged row intact; --resume finishes once there is room.
3. SIGTERM: the run finishes its step, checkpoints, exits 143 with a message; --resume then logs every step once.
   Two signals: the second exits at once. Under torchrun every rank stops at the same step.
4. Under torchrun, a generator rank that cannot write its part of the checkpoint ends the job with one line.

Run: python -m pytest tests/test_faults.py
"""
import errno
import fcntl
import json
import os
import signal
import subprocess
import time

import pytest
import torch

import scalerl
from conftest import (ENV, ROOT, copy_run, one_line_error, read_jsonl, refused, run_base, run_command,
                      scalerl_command, torchrun_command, tree_hashes)

pytestmark = pytest.mark.slow


def command(out, *args):
    return scalerl_command("--config", "smoke", "--threads=1", f"--out_dir={out}", *args)


@pytest.fixture(scope="module")
def base(tmp_path_factory, finished_run):
    """A base directory whose warm-start cache the finished run has filled, so runs reach their loop in seconds."""
    return run_base(tmp_path_factory, "faults")


def train_steps(out):
    return [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "eval" not in r]


def test_two_runs_on_one_folder(base):
    out = base / "dup"
    procs = [subprocess.Popen(command(out, "--max_steps=6"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.pid, *p.communicate(timeout=300), p.returncode) for p in procs]
    winners = [r for r in results if r[3] == 0]
    losers = [r for r in results if r[3] != 0]
    assert len(winners) == 1 and len(losers) == 1, [r[2][-500:] for r in results]
    line = one_line_error(subprocess.CompletedProcess([], losers[0][3], losers[0][1], losers[0][2]))
    assert f"in use by a live run (pid {winners[0][0]})" in line or "already holds a run" in line, line
    assert train_steps(out) == [1, 2, 3, 4, 5, 6]  # one run's rows, each once


def small_fs(path, megabytes):
    """Mount a tmpfs of `megabytes` at path; False where this machine does not allow it (not root)."""
    path.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_disk_at_a_checkpoint(base, finished_run):
    first = finished_run  # 2 steps
    fs = base / "fs"
    used = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(first) for f in files) / 2 ** 20
    if not small_fs(fs, int(used + 5)):  # room for what is there, not for a second checkpoint beside it
        pytest.skip("cannot mount a small filesystem here (test_full_disk_injected covers the same path)")
    try:
        out = fs / "run"
        subprocess.run(["cp", "-r", str(first), str(out)], check=True)
        before = (out / "ckpt.pt").read_bytes()
        p = run_command(command(out, "--resume", "--max_steps=4"))
        line = one_line_error(p)
        assert f"cannot write {out / 'ckpt.pt'}: no space left" in line and "MB needed" in line and "free" in line
        assert (out / "ckpt.pt").read_bytes() == before and not (out / "ckpt.pt.tmp").exists()
        assert train_steps(out)[:2] == [1, 2] and torch.load(out / "ckpt.pt", weights_only=True)["step"] == 2
        subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)  # space freed
        p = run_command(command(out, "--resume", "--max_steps=4"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert train_steps(out) == [1, 2, 3, 4]
    finally:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def test_full_disk_injected(base, finished_run, monkeypatch, capsys):
    """The same at the file layer, in-process: torch.save meets ENOSPC at the step-4 checkpoint."""
    out = copy_run(finished_run, base / "disk_injected")  # 2 steps
    before = (out / "ckpt.pt").read_bytes()
    real_save = torch.save

    def full(obj, path, *a, **kw):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit) as e:
        scalerl.main(scalerl.parse_args(["--config", "smoke", "--threads=1", f"--out_dir={out}", "--resume",
                                         "--max_steps=4"]))
    assert e.value.code == 2
    assert f"cannot write {out / 'ckpt.pt'}: no space left" in capsys.readouterr().err
    assert (out / "ckpt.pt").read_bytes() == before and not (out / "ckpt.pt.tmp").exists()
    monkeypatch.setattr(torch, "save", real_save)


def wait_for_steps(out, n, proc, timeout=120):
    t_end = time.time() + timeout
    while time.time() < t_end and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(train_steps_torn(out)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps")


def train_steps_torn(out):
    return [r["step"] for r in read_jsonl(out / "metrics.jsonl", torn_ok=True) if "eval" not in r]


def test_sigterm_checkpoints_and_resumes(base):
    out = base / "sigterm"
    args = ("--max_steps=16", "--ckpt_every=100", "--eval_every=100")  # only the step-0 and final checkpoints
    proc = subprocess.Popen(command(out, *args), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_steps(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 3 <= step < 16 and f"stopped by SIGTERM at step {step}" in stdout and "--resume" in stdout
    assert train_steps(out)[-1] == step  # the checkpoint is the last logged step
    p = run_command(command(out, *args, "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert train_steps(out) == list(range(1, 17))


def test_second_signal_exits_at_once(base):
    out = base / "twice"  # the run under way: the first signal asks for a checkpoint, the second exits at once
    proc = subprocess.Popen(command(out, "--max_steps=1000", "--batch_prompts=256", "--group_size=8", "--slots=256"),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while not lines or not lines[-1].startswith("step    1/"):
        lines.append(proc.stdout.readline())
        assert proc.poll() is None, lines
    time.sleep(0.2)  # into step 2 (2,048 completions: a second or more): a stop is read between steps too
    proc.send_signal(signal.SIGUSR1)
    while not lines[-1].startswith("SIGUSR1: the run stops after this step"):  # the first is taken: now the second
        lines.append(proc.stdout.readline())
        assert lines[-1], lines
    proc.send_signal(signal.SIGUSR1)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGUSR1 and "stopped by" not in stdout, lines + [stdout]


def test_sigterm_during_the_warm_start_stops_within_seconds(tmp_path):
    """Before the run has started (here: a 3,000-step warm start) nothing of it is written, so one SIGTERM stops it at
    once, exit code 143, the run directory never made and no half-written warm-start cache left."""
    out = tmp_path / "early"
    proc = subprocess.Popen(command(out, "--sft_steps=3000"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while "warm start    0/" not in proc.stdout.readline():  # the warm start is under way
        assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    t = time.time()
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - t < 20 and "before the run started" in stdout
    assert not out.exists() and not list(tmp_path.glob("warmstart/*"))  # neither the run nor a partial cache


def test_torchrun_sigterm_every_rank_stops_at_one_step(base):
    out = base / "torchrun_sigterm"
    args = ("--max_steps=16", "--ckpt_every=100", "--eval_every=100", "--gen_ranks=1")
    cmd = torchrun_command("--standalone", "--nproc_per_node=3", *command(out, *args)[1:])
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_steps(out, 3, proc, timeout=240)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: every process of the job
    stdout, stderr = proc.communicate(timeout=240)
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 3 <= step < 16 and f"stopped by SIGTERM at step {step}" in stdout, stdout[-2000:] + stderr[-3000:]
    assert train_steps(out)[-1] == step
    p = run_command(torchrun_command("--standalone", "--nproc_per_node=3", *command(out, *args, "--resume")[1:]),
                    env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert train_steps(out) == list(range(1, 17))


def test_torchrun_generator_write_fails_cleanly(base):
    """A generator rank that cannot write its part of the checkpoint (here its path is taken by a directory) ends
    the job with one line naming the file, not a traceback; nothing half-written is left."""
    out = base / "torchrun_genfail"
    (out / "generator2.pt").mkdir(parents=True)
    (out / "generator2.pt" / "keep").write_text("x")
    cmd = torchrun_command("--standalone", "--nproc_per_node=3", *command(out, "--max_steps=4", "--gen_ranks=1",
                                                                          "--dist_timeout=20")[1:])
    p = run_command(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode != 0
    assert f"generator rank 2 cannot write {out / 'generator2.pt'}" in p.stderr, p.stderr[-3000:]
    # no traceback through our code (torchrun's agent prints its own summary of the failed worker)
    for module in ("scalerl.py", "pipeline_rl.py", "trainer.py", "infra/dist.py", "infra/run.py", "infra/rundir.py"):
        assert f'{module}", line' not in p.stderr, p.stderr[-3000:]
    assert not (out / "generator2.pt.tmp").exists()


def test_resume_of_a_live_run_is_refused_before_it_says_anything(base, finished_run, capsys):
    """--resume while another process holds the run's lock: one line naming that pid, nothing printed before it (no
    "resumed ... at step"), nothing in the directory changed. The run in this process: a flock taken through another
    open file conflicts as another process's would."""
    out = copy_run(finished_run, base / "live")
    fd = os.open(out / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run holds it
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"4242", 0)
        before = tree_hashes(out)
        capsys.readouterr()
        line = refused(capsys, "--config", "smoke", "--threads=1", f"--out_dir={out}", "--resume", "--max_steps=4")
        assert "in use by a live run (pid 4242)" in line and "resumed" not in capsys.readouterr().out
        assert tree_hashes(out) == before
    finally:
        os.close(fd)


def test_a_read_only_run_directory_is_refused_in_one_line_at_start(base, capsys):
    path = base / "ro"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        line = refused(capsys, "--config", "smoke", "--threads=1", f"--out_dir={path / 'run'}")
        assert "cannot write run directory" in line and "warm start" not in capsys.readouterr().out
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_torn_evaluation_row_is_evaluated_again_on_resume(base, finished_run):
    """A kill while the last row (the checkpoint step's evaluation) was being written leaves it torn: --resume drops
    the torn line and evaluates that step again. A row of an earlier step that is missing (under torchrun an
    evaluation may end after the checkpoint that follows it) cannot be: its weights are gone; the resume names it."""
    out = copy_run(finished_run, base / "torn")  # 2 steps, --eval_every=2 (smoke's)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert '"eval": true' in lines[-1] and '"step": 2' in lines[-1]
    kept = [x for x in lines[:-1] if not (json.loads(x)["step"] == 0 and "eval" in json.loads(x))]
    (out / "metrics.jsonl").write_text("".join(kept) + lines[-1][:40])  # step 0's row lost, step 2's torn mid-write
    p = run_command(command(out, "--resume", "--max_steps=4", "--eval_every=2"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "eval" in r] == [2, 4]
    assert "held-out rows lost: steps [0]" in p.stdout, p.stdout[-2000:]
