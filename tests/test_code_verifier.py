"""The code verifier (infra/sandbox.py), the built-in code task (data.py), the math+code mixture, per-task curves.

1. An adversarial table for `check_program`: each hostile program (endless loop, fork bomb, memory hog, huge output,
   writes outside its directory, reads of secrets in the environment and in files, network, killing its parent,
   leaving a process behind, slow imports, tampering with the audit hook) fails within its time limit plus slack;
   afterwards no process of the sandbox is alive, no file was created outside the temporary directory (which is gone),
   and the next verification works. File isolation (files made by mkfifo, mknod, a socket bind, ctypes, /proc/self
   paths; a world-writable file changed through mmap; reads of /etc/passwd, the project, /proc/1 and of / itself,
   also by patching the functions the hook resolves paths with; a program filling its own directory) must hold by
   the kernel alone: those programs run again with the audit hook removed. The sandbox says what confines it. A
   check dies with its grader, a CPU-time limit backs the wall clock, and a fault while probing is no verdict.
2. The built-in code task: the reference programs pass their hidden tests, slipped ones fail; extraction and rewards.
3. DeepCoder-style files with a `tests` column; the mixture sampler keeps its shares and a curriculum per task.
4. Per-task fits in sigmoid_fit; a real `scalerl.py --task arith+code` smoke run logs pass_rate_<task> (slow).

Run: python -m pytest tests/test_code_verifier.py (add -m "not slow" to skip the run).
"""
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest

import data
import pipeline_rl
import sigmoid_fit
from infra import sandbox, sources
from conftest import refused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT, SLACK = 1.0, 3.0  # hostile programs: seconds per test; slack for start-up and cleanup on a busy machine
OK_LIMIT = 5.0  # programs that must pass: generous, so a loaded machine does not fail them
ADD = "a,b=map(int,input().split())\nprint(a+b)\n"
ADD_TESTS = [("2 3\n", "5\n"), ("-4 10\n", "6")]
MANY = [(f"{i} 1\n", f"{i + 1}\n") for i in range(40)]  # 16 tests per sandboxed interpreter: three of them


def sandbox_processes():
    """Live processes of this host's sandbox uids (a uid per concurrent check) or, without them, its descendants."""
    mode = sandbox.sandbox_mode()
    base = 1_000_000 + os.getpid() % 4_000_000 * 64
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            st = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
        except OSError:
            continue
        uid, ppid = int(st["Uid"].split()[0]), int(st["PPid"])
        if st["State"].strip()[0] != "Z" and (base <= uid < base + 64 if mode[1] else ppid == os.getpid()):
            found.append((pid, st["Name"].strip()))
    return found


@pytest.fixture
def box_dir(tmp_path, monkeypatch):
    """Sandboxes' temporary directories go under tmp_path/boxes, so the test can see that they are removed."""
    boxes = tmp_path / "boxes"
    boxes.mkdir()
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(boxes))
    return boxes


def test_sandbox_is_available():
    mode = sandbox.sandbox_mode()
    assert mode is not None, "no sandbox works on this machine"
    if os.geteuid() == 0:
        assert mode[1], "as root, programs must run under a uid of their own"
    assert sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT)


SECRET = "hunter2-not-a-real-secret"
HOSTILE = {  # name -> program; the tests below say what it must print, so a program that got through would pass
    "endless loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(60)\nprint(5)\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "fork and setsid": "import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n        os.setsid()\n"
                       "        time.sleep(60)\n        os._exit(0)\nprint(5)\ntime.sleep(60)\n",
    "memory hog": "x = bytearray(4 << 30)\nprint(5)\n",
    "slow memory hog": "x = []\nwhile True:\n    x.append(' ' * (1 << 20))\n",
    "huge output": "while True:\n    print('x' * 100000)\n",
    "huge line": "print('5' + ' ' * (1 << 22) + '5')\n",
    "write outside": "open({outside!r}, 'w').write('pwned')\nprint(5)\n",
    "os.open outside": "import os\nos.write(os.open({outside!r}, os.O_WRONLY | os.O_CREAT), b'x')\nprint(5)\n",
    "write own dir": "open('pwned.txt', 'w').write('x')\nprint(5)\n",
    "env secret": "import os\nprint(os.environ.get('SCALERL_FAKE_SECRET', 'none'))\n",
    "proc environ": "print(open('/proc/self/environ').read() + open('/proc/1/environ').read())\n",
    "secret file": "print(open({secret_file!r}).read())\n",
    "network": "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
               "s.sendall(b'x')\nprint(5)\n",
    "kill parent": "import os\nos.kill(os.getppid(), 9)\nprint(5)\n",
    "kill everyone": "import os\nos.kill(-1, 9)\nprint(5)\n",
    "subprocess": "import subprocess\nprint(subprocess.run(['echo', '5'], capture_output=True).stdout.decode())\n",
    "ctypes": "import ctypes\nprint(5)\n",
    "untamper hook": "import sys\nm = sys.modules['__main__']\nm.hook.__defaults__ = (None,) * 9\n"
                     "open({outside!r}, 'w').write('x')\nprint(5)\n",
    "slow import": "import torch\nprint(5)\n",
    "slow import via path": "import sys\nsys.path[:0] = {site!r}\nimport torch\nprint(5)\n",
    "syntax error": "print(5\n",
    "exit code": "print(5)\nraise SystemExit(3)\n",
    "touch outside": "import os\nos.utime({canary!r})\nprint(5)\n",  # metadata: the uid and the hook refuse it
    "xattr outside": "import os\nos.setxattr({canary!r}, 'user.pwned', b'1')\nprint(5)\n",
}
FILES = {  # file isolation by the kernel: these also run with the audit hook removed ({public} is in /tmp)
    "mkfifo outside": "import os\nos.mkfifo({public!r})\nprint(5)\n",
    "mknod outside": "import os, stat\nos.mknod({public!r}, stat.S_IFREG | 0o644)\nprint(5)\n",
    "unix socket bind": "import _socket\n_socket.socket(_socket.AF_UNIX).bind({public!r})\nprint(5)\n",
    "ctypes mkfifo": "import ctypes\nassert ctypes.CDLL(None).mkfifo({public!r}.encode(), 0o644) == 0\nprint(5)\n",
    "via /proc/self/root": "import os\nos.mkfifo('/proc/self/root' + {public!r})\nprint(5)\n",
    "via /proc/self/cwd": "open('/proc/self/cwd/../pwned.txt', 'w').write('x')\nprint(5)\n",  # beside the box
    "shared memory": "import _posixshmem, os\n_posixshmem.shm_open({shm!r}, os.O_CREAT | os.O_RDWR)\nprint(5)\n",
    "mmap outside": "import mmap, os\nm = mmap.mmap(os.open({canary!r}, os.O_RDWR), 0)\nm[:5] = b'pwned'\nprint(5)\n",
    "etc passwd": "print(open('/etc/passwd').readline())\n",
    "project file": "print(open({project!r}).readline())\n",
    "proc 1 cmdline": "print(open('/proc/1/cmdline').read())\n",
    "list root": "import os\nprint(sorted(os.listdir('/')))\n",
    "patch realpath": "import posixpath\nposixpath.abspath = lambda path: {stdlib_file!r}\n"
                      "print(open('/etc/passwd').readline())\n",  # the hook now takes /etc/passwd for the stdlib
    "fill own dir": "import os\ni = 0\nwhile True:\n    for make in (lambda p: open(p, 'wb').write(b'x' * (1 << 20)), "
                    "os.mkfifo, os.mknod):\n        try:\n            make(f'f{{i}}')\n        except OSError:\n"
                    "            pass\n    i += 1\n",
}
HOSTILE.update(FILES)
KERNEL_ONLY = list(FILES) + ["write outside", "os.open outside", "write own dir", "secret file"]


def expected(name):
    """What the program would print had it got out: a program that printed it would pass."""
    with open("/etc/passwd") as passwd, open(os.path.join(ROOT, "data.py")) as project, open("/proc/1/cmdline") as init:
        outside = {"etc passwd": passwd.readline(), "project file": project.readline(), "proc 1 cmdline": init.read()}
    outside.update({"patch realpath": outside["etc passwd"], "list root": str(sorted(os.listdir("/")))})
    return {"env secret": SECRET, "secret file": SECRET, "proc environ": SECRET, **outside}.get(name, "5")


def stamp(path):  # what any change to a file shows in: its kind and mode, owner, size, times of writes and changes
    st = os.lstat(path)
    return st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def tree(path):  # every file beneath path, stamped, but the sandboxes' directory (boxes)
    return sorted((os.path.join(d, f), stamp(os.path.join(d, f))) for d, ds, fs in os.walk(path) for f in ds + fs
                  if f != "boxes")


def watch(path, seen, done):
    while not done.wait(0.01):
        seen.update(os.path.relpath(os.path.join(d, f), path) for d, ds, fs in os.walk(path) for f in ds + fs)


@pytest.mark.parametrize("name, hook", [pytest.param(n, True, id=n) for n in HOSTILE]
                         + [pytest.param(n, False, id=n + ", no hook") for n in KERNEL_ONLY])
def test_hostile_program_fails_and_leaves_nothing(name, hook, tmp_path, box_dir, monkeypatch):
    if name in FILES or not hook:  # file isolation is the kernel's (Landlock); without it, sandbox_mode warned
        if not sandbox.sandbox_mode()[2]:
            pytest.skip("no Landlock here: files outside are guarded by the uid and the audit hook only")
    if not hook:
        assert "sys.addaudithook(hook)\n" in sandbox._BOOT
        monkeypatch.setattr(sandbox, "_BOOT", sandbox._BOOT.replace("sys.addaudithook(hook)\n", ""))
    monkeypatch.setenv("SCALERL_FAKE_SECRET", SECRET)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, 0o600)
    outside = str(tmp_path / "pwned.txt")
    public = f"/tmp/scalerl-pwned-{os.getpid()}-{tmp_path.name}"  # world-writable /tmp, where any uid may create
    canary = f"/tmp/scalerl-canary-{os.getpid()}-{tmp_path.name}"  # world-writable: any uid may open it to write
    with open(canary, "w") as f:
        f.write("canary")
    os.chmod(canary, 0o666)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.05)
    site = [p for p in sys.path if "site-packages" in p]
    program = HOSTILE[name].format(outside=outside, secret_file=str(secret_file), port=server.getsockname()[1],
                                   site=site, public=public, shm=public[4:], canary=canary,
                                   project=os.path.join(ROOT, "data.py"), stdlib_file=os.path.realpath(os.__file__))
    before, files = set(os.listdir("/tmp")), tree(tmp_path) + [stamp(canary)]
    seen, done = set(), threading.Event()  # every name beneath box_dir while the check runs: its disk use
    watcher = threading.Thread(target=watch, args=(box_dir, seen, done))
    watcher.start()
    t0 = time.time()
    try:
        ok = sandbox.check_program(program, [("1 2\n", expected(name))], LIMIT)
        took = time.time() - t0
        done.set()
        watcher.join()
        assert not {p for p in seen if not re.fullmatch(r"scalerl-code-\w+(/prog\.py)?", p)}, f"{name}: made files"
        assert ok is False
        assert took < LIMIT + SLACK, f"{name}: took {took:.1f} s"
        time.sleep(0.05)
        assert sandbox_processes() == [], f"{name}: processes left behind"
        assert not any(os.path.lexists(path) for path in (outside, public, "/dev/shm" + public[4:]))
        assert sorted(os.listdir(tmp_path)) == ["boxes", "secret.txt"] and tree(tmp_path) + [stamp(canary)] == files
        assert open(canary).read() == "canary" and not os.listxattr(canary)
        assert os.listdir(box_dir) == [], f"{name}: temporary directory left behind"
        assert not {f for f in set(os.listdir("/tmp")) - before if "pwned" in f}
        with pytest.raises(socket.timeout):
            server.accept()  # nobody connected
    finally:
        done.set()
        server.close()
        for path in (canary, public, "/dev/shm" + public[4:]):
            if os.path.lexists(path):
                os.remove(path)
    assert sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT), f"{name}: the next verification failed"


def test_sandbox_says_what_confines_it_and_what_is_missing(monkeypatch, capsys):
    mode, text = sandbox.sandbox_mode(), sandbox.sandbox_description()
    assert text.endswith("audit hook (a tripwire)") and ("Landlock ABI" in text) == mode[2] and "net, pid" in text
    monkeypatch.setattr(sandbox, "_SANDBOX_MODE", [])  # a kernel without Landlock: the next mode, said once
    monkeypatch.setattr(sandbox, "_BOOT", sandbox._BOOT.replace("abi = libc.syscall(444, None, 0, 1)", "abi = -1"))
    assert sandbox.sandbox_mode() == (mode[0], mode[1], False) == sandbox.sandbox_mode()
    assert capsys.readouterr().err.count("warning: the code sandbox runs without Landlock") == 1
    assert "no Landlock" in sandbox.sandbox_description() and sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT)


def test_without_namespaces_code_is_refused_and_says_how_to_enable_them(monkeypatch, tmp_path, capsys):
    """A container without CAP_SYS_ADMIN, or a distribution that restricts unprivileged user namespaces: no weaker
    mode runs programs (those leaked UDP, signals and daemons); every check fails, and the reason is one line."""
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(sandbox, "_SANDBOX_MODE", [])
    assert sandbox.sandbox_mode() is None and not sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT)
    why = sandbox.sandbox_description()
    assert "Operation not permitted" in why and "kernel.apparmor_restrict_unprivileged_userns=0" in why
    assert "Traceback" not in capsys.readouterr().err
    # a run with code in its task stops at start, in one line, with nothing written
    out = tmp_path / "run"
    line = refused(capsys, "--config=smoke", "--task=arith+code", f"--out_dir={out}")  # in this process
    assert line.startswith("error: --task=arith+code runs programs: the code sandbox needs") and not out.exists()
    # a machine without unshare at all: the same, in its own words
    fake.unlink()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sandbox, "_SANDBOX_MODE", [])
    assert sandbox.sandbox_mode() is None and "unshare (util-linux): No such file" in sandbox.sandbox_description()


def test_a_check_holds_three_processes_or_threads_at_most():
    """Memory is bounded per check, not only per process: RLIMIT_NPROC counts the check's own uid (or user namespace),
    so a program runs at most 3 tasks of 512 MB each, where 16 were 8 GB."""
    forks = ("import os, time\nn = 0\ntry:\n    while n < 16:\n        if os.fork() == 0:\n"
             "            x = bytearray(200 << 20)\n            time.sleep(2)\n            os._exit(0)\n"
             "        n += 1\nexcept OSError:\n    pass\nprint(n)\n")
    threads = ("import threading\nev, n = threading.Event(), 0\ntry:\n    while n < 16:\n"
               "        threading.Thread(target=ev.wait).start()\n        n += 1\nexcept RuntimeError:\n    pass\n"
               "ev.set()\nprint(n)\n")
    for program in (forks, threads):
        assert [n for n in range(17) if sandbox.check_program(program, [("", str(n))], OK_LIMIT)] == [2]


def test_good_program_that_leaves_a_process_passes_and_is_cleaned_up(box_dir):
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint(5)\n"
    assert sandbox.check_program(program, [("\n", "5"), ("\n", "5")], OK_LIMIT)
    time.sleep(0.05)
    assert sandbox_processes() == [] and os.listdir(box_dir) == []


def test_a_check_that_cannot_make_its_directory_fails_and_keeps_its_slot(monkeypatch, tmp_path):
    """A full disk or a missing TMPDIR fails the check, and its slot comes back: 64 lost slots would block every later
    check for ever, and the run would go silent."""
    assert sandbox.sandbox_mode() is not None  # found once, before the temporary directory goes missing
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    assert not any(sandbox.check_program("print(1)", [("", "1\n")]) for _ in range(10))
    assert sandbox._SLOTS.qsize() == 64
    monkeypatch.undo()
    assert sandbox.check_program("print(1)", [("", "1\n")])


def test_a_fault_in_the_first_probe_is_not_kept_as_a_verdict(monkeypatch, tmp_path):
    """The first check of a process finds the sandbox; a fault meanwhile (its temporary directory gone) fails that
    check, and the next one, the fault gone, asks again: not "no sandbox" for the rest of the run."""
    tempdir = tempfile.tempdir
    monkeypatch.setattr(sandbox, "_SANDBOX_MODE", [])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    assert sandbox.sandbox_mode() is None and not sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT)
    assert sandbox._SANDBOX_MODE == []
    monkeypatch.setattr(tempfile, "tempdir", tempdir)
    assert sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT) and sandbox.sandbox_mode() is not None


def process_tree(root):
    """{pid: (start time, parent pid, CPU ticks)} of `root`'s live descendants, from /proc."""
    stats = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(") ")[2].split()
        except OSError:
            continue
        if fields[0] != "Z":  # state, ppid, ..., utime 11, stime 12, ..., starttime 19 (fields after the name)
            stats[int(pid)] = (fields[19], int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, grew = {}, True
    while grew:
        new = {p: v for p, v in stats.items() if (v[1] == root or v[1] in tree) and p not in tree}
        tree.update(new)
        grew = bool(new)
    return tree


def alive(processes):
    """Those of `processes` ({pid: (start time, ...)}) still running: the same pid and start time, not a zombie."""
    now = {}
    for pid, (start, *_) in processes.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(") ")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and fields[19] == start:
            now[pid] = fields[0]
    return now


def test_a_check_dies_with_its_grader():
    """A grader killed mid-check (SIGKILL: no clean-up runs) takes its check with it: the sandbox's processes, an
    endless loop among them, are gone within seconds, not spinning on for its 60 s limit or for ever."""
    grader = subprocess.Popen([sys.executable, "-c", "from infra import sandbox\n"
                               "sandbox.check_program('while True:\\n    pass\\n', [('', '1')], 60.0)"], cwd=ROOT)
    check = {}
    try:
        deadline = time.time() + 60
        # the loop is running: a process three below the grader (unshare, the boot interpreter, the test) using CPU
        while not any(ticks > 30 for _, ppid, ticks in check.values() if ppid in check and check[ppid][1] in check):
            assert time.time() < deadline and grader.poll() is None, "the check never started"
            time.sleep(0.1)
            check = process_tree(grader.pid)
        grader.kill()
        grader.wait()
        for _ in range(100):
            if not alive(check):
                break
            time.sleep(0.1)
        assert not alive(check), f"left running after its grader died: {alive(check)}"
    finally:
        grader.kill()
        for pid in alive(check):
            os.kill(pid, 9)


def test_cpu_time_ends_a_check_its_wall_clock_does_not(monkeypatch):
    """RLIMIT_CPU backs the wall clock: with the grader's timer stretched to 60 s, an endless loop under a 1 s limit
    is still killed by the kernel after 3 s of CPU (the limit and 2 s, whole seconds), and the check fails then (on a
    busy machine 3 s of CPU can take several seconds of wall clock: the bound is half the timer)."""
    real = select.select
    monkeypatch.setattr(sandbox, "select", types.SimpleNamespace(select=lambda r, w, x, t: real(r, w, x, 60.0)))
    t0 = time.time()
    assert sandbox.check_program("while True:\n    pass\n", [("", "1")], LIMIT) is False
    assert time.time() - t0 < 30
    assert sandbox.check_program(ADD, ADD_TESTS, OK_LIMIT)


@pytest.mark.parametrize("program, tests, want", [
    (ADD, ADD_TESTS, True),
    ("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, ' ')\n", ADD_TESTS, True),  # trailing space
    ("a,b=map(int,open(0).read().split())\nprint(a+b)\nprint()\n", ADD_TESTS, True),  # open(0) and trailing blank line
    ("import math, collections, heapq\nprint(math.gcd(*map(int, input().split())) * 0 + 5)\n", [("3 6", "5")], True),
    ("a,b=map(int,input().split())\nprint(a-b)\n", ADD_TESTS, False),
    ("a,b=map(int,input().split())\nprint(a+b if a > 0 else 0)\n", ADD_TESTS, False),  # wrong on the second test only
    ("print(5)\nprint(6)\n", [("", "5")], False),  # extra output
    ("", ADD_TESTS, False), (ADD, [], False), (None, ADD_TESTS, False), (ADD, [("1 2",)], False),
    ("print('é')\n", [("", "é")], True),
    (ADD, MANY, True), (ADD.replace("a+b", "a+b if a != 35 else 0"), MANY, False),  # wrong in the third interpreter
])
def test_right_and_wrong_programs(program, tests, want):
    assert sandbox.check_program(program, tests, OK_LIMIT) is want


def test_checks_run_in_parallel():
    slow = "import time\ntime.sleep(1.5)\na,b=map(int,input().split())\nprint(a+b)\n"
    t0 = time.time()
    assert data.parallel_map(lambda _: sandbox.check_program(slow, ADD_TESTS[:1], OK_LIMIT), range(4)) == [True] * 4
    assert data.CODE_WORKERS >= 4 and time.time() - t0 < 4 * 1.5  # side by side, not one after another


def test_checks_from_many_threads_do_not_mix():
    programs = [(f"print(int(input()) + {k})\n", [(f"{i}\n", f"{i + k}\n") for i in range(3)]) for k in range(12)]
    out = data.parallel_map(lambda pt: sandbox.check_program(pt[0], pt[1], OK_LIMIT), programs)
    assert out == [True] * 12
    swapped = [(programs[k][0], programs[(k + 1) % 12][1]) for k in range(12)]
    assert data.parallel_map(lambda pt: sandbox.check_program(pt[0], pt[1], OK_LIMIT), swapped) == [False] * 12

# ---------------------------------------------------------------------------------------------------------------------
# 2. The built-in code task


def program_of(p):
    return data.format_target(p).split(data.THINK_CLOSE, 1)[1]


def computes(p):
    """Whether the expression the program prints gives the expected output on every hidden test (by eval)."""
    expr = program_of(p).split("print(", 1)[1][:-1]
    return all(eval(expr, dict(zip("ab", map(int, i.split())))) == int(o) for i, o in data.code_tests(p.answer))


def test_builtin_reference_programs_pass_and_slipped_ones_fail():
    good = data.code_problems(40, seed=3)
    assert [sandbox.check_program(program_of(p), data.code_tests(p.answer), OK_LIMIT) for p in good] == [True] * 40
    bad = data.code_problems(40, seed=3, error_rate=1.0)  # the same questions, every step slipped
    assert [p.question for p in bad] == [p.question for p in good]
    verdicts = [sandbox.check_program(program_of(p), data.code_tests(p.answer), OK_LIMIT) for p in bad]
    assert verdicts == [computes(p) for p in bad]  # slips that cancel ("5b-5b" -> "5a-5a") are still right
    assert verdicts.count(False) >= 36


def test_builtin_code_task_shape():
    ps = data.code_problems(60, seed=0, error_rate=0.3)
    assert ps == data.code_problems(60, seed=0, error_rate=0.3) and ps != data.code_problems(60, seed=1, error_rate=0.3)
    assert {p.level for p in ps} == {1, 2, 3} and all(p.task == "code" for p in ps)
    assert all(p.trace.count(",") == p.level - 1 for p in ps)
    assert sum(program_of(p) != program_of(q) for p, q in zip(ps, data.code_problems(60, seed=0))) > 5  # some slipped
    for p in ps:  # the tiny model's characters cover prompts and targets; the answer budget covers the program
        text = data.format_prompt(p.question) + data.format_target(p)
        assert set(text.replace(data.THINK_OPEN, "").replace(data.THINK_CLOSE, "")) <= set(
            data.CODE_CHARS + data.ARITH_CHARS)
        assert len(program_of(p)) < data.CODE_ANSWER_TOKENS
        assert len(data.code_tests(p.answer)) == 3
    train, val = sources.load_problems("code", n_val=40, n_train=200)
    assert not {p.question for p in train} & {p.question for p in val}  # the hashed split
    assert not {p.id for p in train} & {p.id for p in val}
    with pytest.raises(AssertionError):
        data.code_problems(3, levels=(4,))
    with pytest.raises(ValueError, match="unknown options"):
        sources.load_problems("code", n_val=2, nope=1)


@pytest.mark.parametrize("completion, want", [
    ("3*a</think>a,b=map(int,input().split())\nprint(3*a)", 1.0),
    ("x</think>Here it is:\n```python\na,b=map(int,input().split())\nprint(3*a)\n```\nDone.", 1.0),
    ("x</think>```py\na,b=map(int,input().split())\nprint(3*a)", 1.0),  # an unclosed fence
    ("x</think>a,b=map(int,input().split())\nprint(3*b)", -1.0),
    ("a,b=map(int,input().split())\nprint(3*a)", -1.0),  # no </think>: no answer
    ("x</think>", -1.0), (None, -1.0), ("x</think>" + "print(1)\n" * 100000, -1.0),
], ids=lambda x: repr(x)[:40] if isinstance(x, str) else None)
def test_code_reward(completion, want):
    p = data.Problem(0, "f(a,b)=3a", json.dumps([["2 5\n", "6\n"], ["-3 4\n", "-9\n"]]), "code")
    assert data.reward(p, completion) == want


# ---------------------------------------------------------------------------------------------------------------------
# 3. DeepCoder-style files, combining sources, the mixture sampler


def test_deepcoder_style_file(tmp_path):
    rows = [dict(problem=f"Print the sum of two numbers plus {i}.", tests=json.dumps(
        [{"input": "1 2\n", "output": f"{3 + i}\n", "testtype": "stdin"},
         {"input": "5 5\n", "output": f"{10 + i}\n", "testtype": "stdin"},
         {"input": "f(1)", "output": "2", "testtype": "functional"}])) for i in range(8)]
    rows.append(dict(problem="Only a function test.",
                     tests=json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [2]})))
    rows.append(dict(problem="TACO style.", tests=json.dumps({"inputs": ["3\n"], "outputs": ["9\n"]})))
    rows.append(dict(problem="Broken tests.", tests="{not json"))
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val = sources.load_problems(str(path), n_val=2, seed=0)
    ps = train + val
    assert len(ps) == 9 and all(p.task == "code" and p.question.endswith(data.CODE_INSTRUCTION) for p in ps)
    taco = next(p for p in ps if p.question.startswith("TACO"))
    assert data.code_tests(taco.answer) == [("3\n", "9\n")]
    p = next(p for p in ps if p.question.startswith("Print the sum of two numbers plus 4."))
    assert len(data.code_tests(p.answer)) == 2  # the functional test is left out
    good = "ok</think>```python\na, b = map(int, input().split())\nprint(a + b + 4)\n```"
    assert data.reward(p, good) == 1.0 and data.reward(p, good.replace("+ 4", "+ 5")) == -1.0
    (tmp_path / "none.jsonl").write_text(json.dumps(dict(problem="x", tests="[]")) + "\n")
    with pytest.raises(ValueError, match="no row has stdin/stdout tests"):
        sources.load_problems(str(tmp_path / "none.jsonl"), n_val=1)


def test_combine_keeps_ids_unique_and_tasks():
    train, val = sources.combine([sources.load_problems("arith", n_val=10, n_train=50),
                               sources.load_problems("code", n_val=10, n_train=50)])
    ids = [p.id for p in train + val]
    assert len(ids) == len(set(ids)) == 120
    assert [p.task for p in val] == ["arith"] * 10 + ["code"] * 10
    assert sources.combine([sources.load_problems("arith", n_val=10, n_train=50)]) == sources.load_problems(
        "arith", n_val=10, n_train=50)


@pytest.mark.parametrize("code_share", [0.25, 0.5, 0.8])
def test_mixture_sampler_keeps_its_shares(code_share):
    train, _ = sources.combine([sources.load_problems("arith", n_val=10, n_train=300),
                             sources.load_problems("code", n_val=10, n_train=300)])
    pool = pipeline_rl.MixedPool(train, {"arith": 1 - code_share, "code": code_share}, seed=0)
    draws = [pool.next().task for _ in range(400)]
    for k in range(0, 400, 16):  # every batch of 16 prompts holds the share, to within one prompt
        assert abs(draws[k:k + 16].count("code") - 16 * code_share) <= 1
    assert abs(draws.count("code") - 400 * code_share) <= 1
    only = pipeline_rl.MixedPool(train, {"arith": 1.0, "code": 0.0})
    assert {only.next().task for _ in range(50)} == {"arith"}


def test_mixture_keeps_a_curriculum_per_task():
    train, _ = sources.combine([sources.load_problems("arith", n_val=5, n_train=20),
                             sources.load_problems("code", n_val=5, n_train=20)])
    pool = pipeline_rl.MixedPool(train, {"arith": 0.5, "code": 0.5}, seed=0)
    seen = [pool.next() for _ in range(40)]  # one epoch of each task
    for p in seen:  # every code prompt passes every time: NPR retires all of them, zero-variance drops their groups
        assert pool.record(p.id, [1.0] * 4 if p.task == "code" else [1.0, -1.0, -1.0, -1.0]) is (p.task != "code")
    assert pool.pools["code"].npr_removed == 20 and pool.pools["arith"].npr_removed == 0 and pool.npr_removed == 20
    assert pool.pools["code"].zero_var_dropped == 20 and pool.pools["arith"].zero_var_dropped == 0
    with pytest.raises(RuntimeError, match="No-Positive-Resampling"):
        [pool.next() for _ in range(40)]  # the code pool is empty in its next epoch
    state = pool.state_dict()
    again = pipeline_rl.MixedPool(train, {"arith": 0.5, "code": 0.5}, seed=0)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.state_dict() == json.loads(json.dumps(state))
    with pytest.raises(KeyError):  # no task holds it
        pool.record(10 ** 9, [1.0, -1.0])
    with pytest.raises(ValueError, match="tasks"):
        pipeline_rl.MixedPool(train, {"arith": 1.0}).load_state_dict(state)

# ---------------------------------------------------------------------------------------------------------------------
# 4. One curve per task


def write_log(path, curves):
    """A metrics.jsonl with eval rows for each task's sigmoid (A, B, C_mid, R0) and the equal-weight overall rate."""
    rows = []
    for k, c in enumerate([0.0] + [0.01 * 1.25 ** i for i in range(16)]):
        row = dict(step=k, device_hours=c, eval=True)
        for task, (A, B, C_mid, R0) in curves.items():
            row[f"pass_rate_{task}"] = R0 if c == 0 else float(sigmoid_fit.sigmoid(c, A, B, C_mid, R0))
        row["pass_rate"] = sum(row[f"pass_rate_{t}"] for t in curves) / len(curves)
        rows.append(row)
        rows.append(dict(step=k, device_hours=c, reward=0.0))  # a step row: no pass rate
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_per_task_fit(tmp_path, capsys):
    run = tmp_path / "mt"
    run.mkdir()
    curves = {"arith": (0.9, 1.8, 0.05, 0.4), "code": (0.7, 1.1, 0.02, 0.2)}
    write_log(run / "metrics.jsonl", curves)
    assert sigmoid_fit.per_task_metrics(str(run)) == ["pass_rate_arith", "pass_rate_code"]
    plot = tmp_path / "tasks.png"
    assert sigmoid_fit.main([str(run), "--per-task", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert os.path.getsize(plot) > 1000
    for task, (A, B, C_mid, R0) in curves.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"mt:{task} "))
        fields = line.split()
        assert float(fields[4]) == pytest.approx(R0) and float(fields[5]) == pytest.approx(A, abs=0.01)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "metrics.jsonl").write_text(json.dumps(dict(step=0, device_hours=0.0, pass_rate=0.5)) + "\n")
    assert sigmoid_fit.main([str(tmp_path / "one"), "--per-task"]) == 2
    assert "pass_rate_<task>" in capsys.readouterr().err


@pytest.mark.slow
def test_multitask_smoke_run(tmp_path):
    out = tmp_path / "mt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scalerl.py"), "--config", "smoke", "--threads=1",
                        "--task", "arith+code", "--code_frac=0.5", f"--out_dir={out}"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in rows if "pass_rate" in r]
    steps = [r for r in rows if "pass_rate" not in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and len(steps) == 4
    for r in evals:  # the smoke preset's 8 held-out prompts: 4 per task, the overall rate their mean
        assert 0 <= r["pass_rate_arith"] <= 1 and 0 <= r["pass_rate_code"] <= 1
        assert r["pass_rate"] == pytest.approx((r["pass_rate_arith"] + r["pass_rate_code"]) / 2)
    # each step's reward per task its batch held (the first batch may hold arith alone: code completions end later)
    held = [{k for k in ("reward_arith", "reward_code") if k in r} for r in steps]
    assert all(held) and set().union(*held) == {"reward_arith", "reward_code"}, held
    cfg = json.load(open(out / "config.json"))["config"]
    assert cfg["task"] == "arith+code" and cfg["answer_budget"] >= data.CODE_ANSWER_TOKENS
    write_log(out / "metrics.jsonl", {"arith": (0.9, 1.8, 0.05, 0.4), "code": (0.7, 1.1, 0.02, 0.2)})
    f = subprocess.run([sys.executable, os.path.join(ROOT, "sigmoid_fit.py"), str(out), "--per-task"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert f.returncode == 0 and "mt:arith" in f.stdout and "mt:code" in f.stdout, f.stdout + f.stderr


def test_correct_programs_that_import_the_usual_modules_pass():
    """Where the standard library is closed to the sandbox's uid (a Python under /root, mode 0700), the modules
    programs usually import are loaded before the uid drops: a correct program passes, not scored wrong in silence."""
    program = ("import copy, decimal, fractions, json, random, typing\nfrom collections import Counter\n"
               "n = int(input())\nprint(json.dumps(sorted(Counter(str(n)).items())), fractions.Fraction(n, 2))")
    assert sandbox.check_program(program, [("1123", '[["1", 2], ["2", 1], ["3", 1]] 1123/2')])


def test_kernel_keys_a_program_adds_are_gone_after_its_check(monkeypatch):
    """As root a check has no user namespace of its own, so keys a program adds to its uid's user, user-session and
    persistent keyrings would outlive it, and keys in the session keyring it started with would live on in the run's:
    once the check is over, none of its uid's keys is left."""
    mode = sandbox.sandbox_mode()
    if not mode or not mode[1]:
        pytest.skip("checks run as root under uids of their own only")
    # the program reaches keyctl by ctypes: loaded before the uid drops, the audit hook (a tripwire) off
    monkeypatch.setattr(sandbox, "_BOOT", sandbox._BOOT.replace("sys.addaudithook(hook)\n", "").replace(
        "    os.setresuid(uid, uid, uid)\n", "    import ctypes\n    os.setresuid(uid, uid, uid)\n"))
    n = sandbox._KEYCTL
    # @u linked into its own session keyring first, so the persistent keyring (linked to @u) is its to write to
    program = (f"import ctypes\nc = ctypes.CDLL(None).syscall\nc({n}, 8, -4, -3)\nring = c({n}, 22, -1, -4)\n"
               f"for k, dest in ((b'a', -4), (b'b', -5), (b'c', ring), (b'd', -3)):\n"  # add_key: keyctl's less 2
               f"    assert c({n - 2}, b'user', k, b'x' * 500, 500, dest) > 0\nprint(int(input()) + 1)")
    base = 1_000_000 + os.getpid() % 4_000_000 * 64

    def key_users():
        with open("/proc/key-users") as f:
            return {int(line.split(":")[0]) for line in f} & set(range(base, base + 64))
    assert sandbox.check_program(program, [("1", "2")])
    for _ in range(100):  # the kernel frees invalidated keys in its garbage collector, soon after
        if not key_users():
            break
        time.sleep(0.05)
    assert not key_users()
    # the contrast: without the clearing, they stay
    monkeypatch.setattr(sandbox, "_KEYCTL", None)
    assert sandbox.check_program(program, [("1", "2")])
    left = key_users()
    monkeypatch.setattr(sandbox, "_KEYCTL", n)
    for uid in left:
        sandbox._clear_keys(uid)
    assert left


def test_a_check_has_its_own_ipc_namespace():
    """SysV shared memory made inside the sandbox's namespaces dies with the check: the prefix asks for an IPC
    namespace of its own, and a segment created under that prefix is gone from the host once it exits."""
    mode = sandbox.sandbox_mode()
    if not mode or not mode[0]:
        pytest.skip("no namespaces here")
    assert "-i" in mode[0]

    def segments():
        with open("/proc/sysvipc/shm") as f:
            return len(f.readlines())
    before = segments()
    make = ("import ctypes; i = ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600); assert i >= 0; "
            "print(i)")  # IPC_PRIVATE, IPC_CREAT | 0600: left behind, never removed
    subprocess.run(mode[0] + [sys.executable, "-c", make], check=True, timeout=30)
    assert segments() == before
    # the contrast, without the namespace: the segment outlives its process (removed here by its id)
    shmid = subprocess.run([sys.executable, "-c", make], check=True, timeout=30, capture_output=True, text=True).stdout
    leaked = segments() > before
    subprocess.run(["ipcrm", "-m", shmid.strip()], check=True)
    assert leaked
