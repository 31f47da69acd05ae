"""Shared test setup: run fully offline, import the flat modules from the project root, small threads, skip the
tests marked `vllm` where vLLM is not installed; and the helpers several test files use (import them with
`from conftest import ROOT, read_jsonl, ...`: pytest puts tests/ on sys.path). What several files' tests only read
is made once a session: one finished smoke run (finished_run, copied by each test that needs a run directory) and
one warm-start cache (run_base). A refusal runs in-process (refused); a subprocess is kept where the process is what
is tested (signals, kills, torchrun, exit codes of the real command).

Run the whole suite with `python -m pytest` from the project root; `PYTHONPATH=tests/without_vllm python -m pytest`
runs it as if vLLM were not installed.
"""
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.set_num_threads(1)  # the test models are tiny: one thread is deterministic and fair to a shared machine


# The files that take longest, longest first (seconds on 2 quiet cores, 2026-12-02): pytest.ini hands the two workers a
# file at a time in collection order (--no-loadscope-reorder), so the short files fill the end and the workers finish
# together (xdist's own order, by test count, left a long file for last: a minute or more of one idle worker).
SLOWEST_FIRST = ("test_vllm.py", "test_distributed.py", "test_reliability.py", "test_faults.py", "test_preemption.py",
                 "test_torchrun_eval.py", "test_runs.py", "test_notebooks.py", "test_scalerl.py",
                 "test_architectures.py", "test_code_verifier.py", "test_own_model.py")


def pytest_collection_modifyitems(config, items):
    """The slowest files first (the rest in their order); without vLLM (the optional extra, requirements-vllm.txt)
    the tests marked `vllm` skip, saying so."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="needs vLLM: pip install -r requirements-vllm.txt")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the environment of every subprocess the tests start: offline, whatever the caller's shell says
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# added to ENV: a subprocess that runs as if vLLM were not installed (tests/without_vllm/sitecustomize.py)
WITHOUT_VLLM = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "tests", "without_vllm"),
                                                            os.environ.get("PYTHONPATH")]))}


# a torchrun job's environment: one thread a rank, and the project importable by a test file torchrun runs as a script
TORCHRUN_ENV = {**ENV, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, ENV.get("PYTHONPATH")]))}


TIMING = {"dt", "device_hours", "cpu_hours", "gen_tok_s", "train_tok_s", "gen_busy", "train_busy",
          "sync_s", "resubmit_wait_s"}  # wall-clock fields of a metrics row: the rest of a run repeats exactly


def scalerl_command(*args):
    """The real command line: `python scalerl.py ARGS`."""
    return [sys.executable, os.path.join(ROOT, "scalerl.py"), *args]


def torchrun_command(*args):
    """`torchrun ARGS` through this interpreter (no reliance on a torchrun script on PATH)."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_command(cmd, timeout=600, env=None, cwd=ROOT):
    """Run `cmd` from the project root (or `cwd`) with ENV (plus `env`), its output captured; the CompletedProcess."""
    return subprocess.run(cmd, cwd=cwd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def one_line_error(p):
    """A failed run's stderr is exactly one `error: ...` line (no traceback); returns that line."""
    assert p.returncode != 0, p.stdout[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    return lines[0]


def refused(capsys, *argv):
    """`python scalerl.py ARGV` run in this process where the command line must be refused: exit code 2 and stderr
    exactly one `error: ...` line (any other exception fails the test, as a traceback would); returns that line.
    Refusals need no process of their own: a process start costs seconds, and the subprocess runs test the rest."""
    import scalerl
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        scalerl.main(scalerl.parse_args(list(argv)))
    out, err = capsys.readouterr()
    print(out, end="")  # what it printed stays the test's to read (capsys)
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (e.value.code, err[-3000:])
    return lines[0]


def run_base(tmp_path_factory, name):
    """A fresh base directory for runs (their --out_dir inside it) whose supervised warm-start cache,
    `<base>/warmstart/`, is one folder for the whole session, both xdist workers' (their base folders share a parent):
    a warm start with the same options is computed once (side by side, each writes its own file, then renames it)."""
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "warmstart"
    base = tmp_path_factory.mktemp(name)
    shared.mkdir(exist_ok=True)
    (base / "warmstart").symlink_to(shared, target_is_directory=True)
    return base


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished `python scalerl.py --config smoke --threads=1 --max_steps=2 --zero_var_filter=false` (the real
    command), for the tests that inspect, damage or resume a run directory: each copies it (copy_run) instead of
    running one of its own. The filter off: every step takes an optimizer step, so the optimizer state matters."""
    out = run_base(tmp_path_factory, "finished") / "run"
    p = run_command(scalerl_command("--config", "smoke", "--threads=1", f"--out_dir={out}", "--max_steps=2",
                                    "--zero_var_filter=false"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (out.parent / "stdout.txt").write_text(p.stdout)  # what it printed, beside it (tests/test_docs.py reads it)
    return out


def python_blocks(page):
    """The ```python blocks of a docs page, in order: the examples a test runs as written."""
    return re.findall(r"^```python\n(.*?)^```$", open(page, encoding="utf-8").read(), flags=re.M | re.S)


def scalerl_commands(page):
    """The `python scalerl.py ...` and `torchrun ... scalerl.py ...` commands of a page's code blocks (a line ending in
    a backslash continues on the next), without --help: (the command, its words after scalerl.py)."""
    text = re.sub(r" \\\n +", " ", open(page, encoding="utf-8").read())
    for line in text.split("\n"):
        code = line.strip().partition("  #")[0].rpartition("&& ")[2]  # pip install ... && python scalerl.py
        if line.startswith("    ") and (code.startswith("python scalerl.py") or code.startswith("torchrun")):
            words = shlex.split(code)
            if "scalerl.py" in words and "--help" not in words:
                yield code, words[words.index("scalerl.py") + 1:]


def copy_run(src, dest):
    """A copy of run directory `src` at `dest` (its lock file, from a process that has ended, included)."""
    shutil.copytree(src, dest)
    return dest


def read_jsonl(path, torn_ok=False):
    """The rows of a JSONL file. torn_ok: leave out a last line without its newline (a run still writing, or killed
    mid-write); otherwise such a line fails to parse, as a finished log must not hold one."""
    with open(path) as f:
        return [json.loads(line) for line in f if not torn_ok or line.endswith("\n")]


def tree_hashes(d):
    """{relative path: sha256} of every file under directory `d`: compare before and after to prove it untouched."""
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, d)] = hashlib.sha256(f.read()).hexdigest()
    return out


# Launches of one rank each, as nodes on this machine: a rank killed in one does not make torchrun end the others


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(launchers):
    """{global rank: (pid, its launcher's pid)} of the processes torchrun started (children of the launchers, RANK in
    their environment)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid in launchers:
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank:
                out[int(rank[0])] = (int(pid), ppid)
    return out


def wait_for_steps(path, n, procs, timeout=180):
    """Until metrics.jsonl at `path` holds `n` training rows; fails at once if one of `procs` has ended."""
    t = time.time()
    while time.time() - t < timeout:
        if os.path.exists(path) and sum("pass_rate" not in r for r in read_jsonl(path, torn_ok=True)) >= n:
            return
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs if p.poll()]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {timeout} s")


def launch(args, log):
    return subprocess.Popen(args, cwd=ROOT, env=TORCHRUN_ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            text=True)


def nodes(n, log, *args):
    """`n` torchrun launches of one rank each of `args` (the script and its options) on this machine, as n nodes
    (torchrun passes no death to another launch), their output in log<i>.log."""
    port = free_port()
    return [launch(torchrun_command(f"--nnodes={n}", f"--node_rank={i}", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                    f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=scalerl-{log.name}", *args),
                   f"{log}{i}.log") for i in range(n)]


def kill(pid, procs):
    """SIGKILL `pid`; the seconds until every launch has ended."""
    os.kill(pid, signal.SIGKILL)
    t = time.time()
    for p in procs:
        p.wait(timeout=120)
    return time.time() - t
