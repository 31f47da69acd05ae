"""Preemption and resume under torchrun, as a scheduler does them.

1. SLURM signals every process of the job step (the vLLM engine core too, outside torchrun's process groups), and
   torchrun forwards the signal to each rank again: the engine core ignores it, each rank takes the repeat as the same
   stop, the run checkpoints at its step and exits resumable (143); --resume then logs every step once.
2. A stop that comes while a step trains, with the generator rank hung: the trainer reads it before sending the
   step's weights and checkpoints at once, where a weight push would wait for the hung rank until --dist_timeout.
3. --resume reads the checkpoint's shards on every rank (a trainer rank its own, a generator rank all of them): rank 0
   broadcasts no weights, and the generator's behaviour logprobs match the trainers' from the first resumed step.

Run under torchrun, this file is scalerl.py with torch.distributed.broadcast on the job's default group recorded and,
optionally, trainer rank 0 hanging the generator rank and signalling itself after a given step trains.
Run: python -m pytest tests/test_preemption.py (minutes; the vLLM test needs vllm installed).
"""
import json
import os
import runpy
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ENV, ROOT, read_jsonl, run_command, torchrun_command

pytestmark = pytest.mark.slow
ENV = {**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, ENV.get("PYTHONPATH")]))}
SMOKE = ("--config=smoke", "--threads=1")


def children(pid):
    """{pid: (its parent, its command line)} of every process below `pid`."""
    procs = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            procs[int(p)] = (ppid, open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for p, (ppid, cmd) in procs.items():
            if ppid == parent and p not in out:
                out[p] = (ppid, cmd)
                todo.append(p)
    return out


def rank_pid(rank, below):
    """The pid of torchrun's worker of global rank `rank`."""
    for p in children(below):
        try:
            if f"RANK={rank}".encode() in open(f"/proc/{p}/environ", "rb").read().split(b"\0"):
                return p
        except OSError:
            continue


def train_rows(out, torn_ok=False):
    return [r for r in read_jsonl(out / "metrics.jsonl", torn_ok=torn_ok) if "reward" in r]


def wait_for(what, proc, timeout):
    t_end = time.time() + timeout
    while not what():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < t_end, f"not within {timeout} s"
        time.sleep(0.2)


def launch(out, record, hang_at, *args, nproc=2):
    """torchrun of this file (scalerl.py, recorded) in a session of its own, as a scheduler's job step."""
    cmd = torchrun_command("--standalone", f"--nproc_per_node={nproc}", __file__, str(record), str(hang_at), *SMOKE,
                           f"--out_dir={out}", *args)
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def broadcast_bytes(record, rank=0):
    path = f"{record}.{rank}"
    return sum(int(n) for n in open(path)) if os.path.exists(path) else 0


@pytest.mark.vllm
def test_slurm_signals_every_process_and_the_run_checkpoints_and_resumes(tmp_path):
    pytest.importorskip("vllm")
    out, record = tmp_path / "run", tmp_path / "broadcasts"
    args = ("--engine=vllm", "--max_steps=8", "--eval_every=3", "--ckpt_every=100", "--zero_var_filter=false",
            "--dist_timeout=600")  # vLLM starts slowly on a busy machine
    proc = launch(out, record, 0, *args)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out, torn_ok=True)) >= 2, proc, 900)
        job = children(proc.pid)
        generator = rank_pid(1, proc.pid)
        core = [p for p, (ppid, cmd) in job.items() if ppid == generator and "EngineCore" in cmd]
        assert len(core) == 1, job
        # as slurmd does: every process of the step, the engine core first (its own process group: torchrun's
        # forwarded signal never reaches it), then the ranks, then torchrun, which signals each rank again
        for p in core + [p for p in job if p not in core] + [proc.pid]:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 2 <= step < 8 and f"stopped by SIGTERM at step {step}" in stdout, stdout[-2000:] + stderr[-3000:]
    assert open(f"{record}.exit.0").read() == "143"  # trainer rank 0 exited resumable
    assert train_rows(out)[-1]["step"] == step  # the checkpoint is the last logged step
    p = run_command(torchrun_command("--standalone", "--nproc_per_node=2", "scalerl.py", *SMOKE, f"--out_dir={out}",
                                     *args, "--resume"), timeout=1500, env=dict(OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    train = train_rows(out)
    assert [r["step"] for r in train] == list(range(1, 9)) and sum(r["gen_tok_s"] for r in train) > 0
    assert all(r["policy_version"] == r["step"] and r["lag_max"] <= 2 for r in train)


def test_a_stop_while_the_generator_hangs_checkpoints_without_waiting_for_it(tmp_path):
    """Trainer rank 0 hangs the generator rank (SIGSTOP) and takes a SIGTERM while step 3 trains. The model is wide
    enough (50 MB of weights) that a weight broadcast to the hung rank cannot land in the sockets' buffers."""
    out, record = tmp_path / "run", tmp_path / "broadcasts"
    args = ("--max_steps=40", "--eval_every=100", "--ckpt_every=100", "--n_embd=512", "--sft_steps=0",
            "--dist_timeout=60")
    proc = launch(out, record, 3, *args)
    try:
        wait_for(lambda: (out / "ckpt.pt").exists() and torch.load(out / "ckpt.pt", weights_only=True)["step"] == 3,
                 proc, 300)
        t = time.time()
        generator = rank_pid(1, proc.pid)
        assert open(f"/proc/{generator}/stat").read().rsplit(")", 1)[1].split()[0] == "T"  # still hung
        os.kill(generator, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "stopped by SIGTERM at step 3" in stdout and open(f"{record}.exit.0").read() == "143", stderr[-3000:]
    assert time.time() - t < 60 and [r["step"] for r in train_rows(out)] == [1, 2, 3]
    assert "gave up waiting" not in stderr, stderr[-3000:]


def test_a_resume_reads_the_shards_on_every_rank_and_broadcasts_no_weights(tmp_path):
    """3 ranks: 2 FSDP2 trainers and a generator. The fresh run broadcasts rank 0's warm start (the record counts
    it); the resumed one broadcasts nothing on the job's group, and its first step's behaviour logprobs are the
    trainers' to round-off (both read the same shards: a rank left with other weights would show here)."""
    out, record = tmp_path / "run", tmp_path / "broadcasts"
    args = ("--gen_ranks=1", "--zero_var_filter=false", "--eval_every=2", "--ckpt_every=2")
    proc = launch(out, record, 0, *args, "--max_steps=2", nproc=3)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    n_params = json.load(open(out / "config.json"))["n_params"]
    assert broadcast_bytes(record) >= 4 * n_params  # the whole model, fp32, went out from rank 0
    for r in range(3):
        os.remove(f"{record}.{r}")
    proc = launch(out, record, 0, *args, "--max_steps=4", "--resume", nproc=3)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "resumed" in stdout and [broadcast_bytes(record, r) for r in range(3)] == [0, 0, 0]
    train = train_rows(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "pass_rate" in r] == [0, 2, 4]
    assert all(r["policy_version"] == r["step"] and r["lag_max"] <= 2 for r in train)
    # step 3 trains on completions sampled by the weights the generator read at the resume (lag 0 at version 2)
    assert abs(train[2]["mismatch_kl"]) < 1e-6 and train[2]["ratio_max"] < 1.001, train[2]
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 4 and sorted(os.listdir(out / ck["shards"])) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


if __name__ == "__main__":
    # torchrun runs this as each rank: sys.argv[1] the record's path, sys.argv[2] the step after whose training trainer
    # rank 0 hangs the generator rank and takes a SIGTERM (0: never), the rest scalerl.py's arguments
    record, hang_at = sys.argv.pop(1), int(sys.argv.pop(1))
    rank, broadcast = int(os.environ["RANK"]), torch.distributed.broadcast

    def recorded(tensor, src=None, group=None, **kw):
        if group is None:
            with open(f"{record}.{rank}", "a") as f:
                f.write(f"{tensor.nbytes}\n")
        return broadcast(tensor, src, group, **kw)
    torch.distributed.broadcast = recorded
    import trainer
    train_step = trainer.train_step

    def hanging(policy, opt, batch, cfg, step, comm=None):
        stats = train_step(policy, opt, batch, cfg, step, comm)
        if step + 1 == hang_at and rank == 0:
            os.kill(rank_pid(int(os.environ["WORLD_SIZE"]) - 1, os.getppid()), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGTERM)
        return stats
    trainer.train_step = hanging
    sys.argv[0] = os.path.join(ROOT, "scalerl.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        open(f"{record}.exit.{rank}", "w").write(str(e.code))
        raise
