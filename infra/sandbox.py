"""The code sandbox: runs untrusted programs against stdin/stdout tests, confined by the kernel, or not at all.

`check_program` never raises and passes a program only if every test's output matches. What confines a program
(namespaces, Landlock, a uid of its own, limits) and what each guarantee rests on: docs/sandbox.md."""
import contextlib
import functools
import os
import pathlib
import queue
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading

from data import CODE_TIME_LIMIT, code_tests

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


@functools.lru_cache(maxsize=4096)  # a group often holds the same answer several times: run it once
def check_answer(problem, text, time_limit):
    """The "code" checker of data.CHECKERS: the program in the answer (its first ```python block when there is one,
    else all of it) against the problem's hidden tests."""
    fenced = _FENCE.search(text)
    return check_program(fenced[1] if fenced else text, code_tests(problem.answer), min(time_limit, CODE_TIME_LIMIT))


# bytes of address space a process, bytes of output a test; a program's processes and threads
_MEMORY, _OUTPUT, _TASKS = 512 << 20, 1 << 20, 3
_NO_LANDLOCK = "files are guarded by the uid alone (a user namespace's: the run's own files), the audit hook aside"
_SANDBOX_MODE, _SANDBOX_LOCK = [], threading.Lock()  # sandbox_mode's verdict, found once per process
_SLOTS = queue.SimpleQueue()  # a uid per concurrent check (as root)
for _slot in range(64):
    _SLOTS.put(_slot)


def check_program(program, tests, time_limit=CODE_TIME_LIMIT):
    """True iff `program` (Python source) prints the expected stdout for every (stdin, stdout) test; never raises."""
    try:
        mode = sandbox_mode()  # no program or no tests: no pass; 16 tests per interpreter, two open files each
        return bool(mode and tests and program.strip()) and all(
            _run_tests(program, tests[k:k + 16], float(time_limit), mode) for k in range(0, len(tests), 16))
    except Exception:  # noqa: BLE001 -- a verifier never takes down the run
        return False


def sandbox_mode():
    """(unshare command, own uid?, Landlock?) of the sandbox that runs a canary here, or None; a verdict is kept."""
    with _SANDBOX_LOCK:
        if not _SANDBOX_MODE:
            prefix, root = _prefix(), os.geteuid() == 0
            canary = ("import math\nprint(int(input())+1)", [("41\n", "42")], 10.0)  # a program, its tests, a limit
            modes = ((prefix, root, True), (prefix, root, False)) if shutil.which("unshare") else ()
            try:
                _SANDBOX_MODE.append(next((m for m in modes if _run_tests(*canary, m)), None))
            except OSError:  # a fault (no temporary directory, unshare cannot start, a stalled start), not a verdict
                return None
            if _SANDBOX_MODE[0] and not _SANDBOX_MODE[0][2]:
                print(f"warning: the code sandbox runs without Landlock: {_NO_LANDLOCK}", file=sys.stderr)
        return _SANDBOX_MODE[0]


def sandbox_description():
    """What confines a program here, in one line for the run's header; without a sandbox, why and what to do."""
    mode = sandbox_mode()
    if mode is None:
        try:  # the kernel's refusal, in its own words
            probe = subprocess.run(_prefix() + ["true"], capture_output=True, text=True, timeout=30)
            error = probe.returncode and (probe.stderr.strip() or f"unshare: exit code {probe.returncode}")
        except OSError as e:
            error = f"unshare (util-linux): {e.strerror}"
        if not error:
            return ("no code sandbox works here: namespaces do, but a program in them failed (before Linux 5.14 a user "
                    "other than root has every process of its uid counted against the sandbox's RLIMIT_NPROC)")
        return (f"the code sandbox needs network, PID and IPC namespaces, which this machine refuses ({error}); allow "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 23.10 and later "
                "kernel.apparmor_restrict_unprivileged_userns=0) or, in a container, give it CAP_SYS_ADMIN")
    landlock = f"no Landlock: {_NO_LANDLOCK}"
    if mode[2]:
        import ctypes
        abi = ctypes.CDLL(None).syscall(444, None, 0, 1)  # landlock_create_ruleset(LANDLOCK_CREATE_RULESET_VERSION)
        landlock = f"Landlock ABI {abi} (no file writes; reads: the standard library)"
    uid = f"uids {1_000_000 + os.getpid() % 4_000_000 * 64}+ (one per check)" if mode[1] else "a user namespace"
    return (f"namespaces: net, pid, ipc; {uid}; {landlock}; {_MEMORY >> 20} MB a process, {_TASKS} processes or "
            "threads a program; audit hook (a tripwire)")


def _prefix():
    """unshare's command: own user (unless root: a uid per check), network, PID and IPC namespaces."""
    root = os.geteuid() == 0
    return [shutil.which("unshare") or "unshare", *([] if root else ["-r"]), "-n", "-p", "-i", "-f", "--kill-child"]


def _run_tests(program, tests, time_limit, mode):
    """True iff `program` passes every test, all in one sandboxed interpreter (see _BOOT) run under `mode`."""
    namespaces, own_uid, landlock = mode
    with contextlib.ExitStack() as cleanup:  # on the way out, reversed: end it, close files, remove the box, free slot
        slot = _SLOTS.get()
        cleanup.callback(_SLOTS.put, slot)
        uid = 1_000_000 + os.getpid() % 4_000_000 * 64 + slot if own_uid else -1
        cleanup.callback(_clear_keys, uid)  # once the check is gone, before its uid serves another
        box = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="scalerl-code-", ignore_cleanup_errors=True))
        pathlib.Path(box, "prog.py").write_text(program, encoding="utf-8")
        # each test's stdin and stdout: unnamed files, nothing a program could open by a path
        files = [cleanup.enter_context(tempfile.TemporaryFile(dir=box)) for _ in range(2 * len(tests))]
        for (stdin, _), f in zip(tests, files[::2]):
            f.write(stdin.encode())
            f.seek(0)
        # RLIMIT_NPROC counts the tasks of the check's uid (or user namespace, where unshare counts too): the boot
        # interpreter, then the program's processes and threads; so the check's memory is bounded as a whole
        nproc = 1 + _TASKS + (not own_uid)
        fds = [f.fileno() for f in files]
        limits = [_MEMORY, _OUTPUT + 1, nproc, int(time_limit) + 2, uid, int(landlock), _KEYCTL or 0]
        args = [sys.executable, "-I", "-S", "-c", _BOOT, *map(str, limits + fds)]
        # on the way out its stdin closes, which ends it (see _BOOT), and unshare is waited for: it exits once the
        # namespace is empty, as the kernel kills the rest of a PID namespace before its first process is gone
        cleanup.enter_context(proc := subprocess.Popen(
            namespaces + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            pass_fds=fds, cwd=box, env={"LC_ALL": "C.UTF-8"}, start_new_session=True))
        if not select.select([proc.stdout], [], [], 10.0)[0]:
            raise TimeoutError("the sandbox's interpreter did not start in 10 s")
        if proc.stdout.readline() != b"ready\n":
            return False  # the interpreter failed to start: not the program's fault, but a fail
        for (_, want), out in zip(tests, files[1::2]):  # the wall clock of each test runs from the previous report
            if not select.select([proc.stdout], [], [], time_limit)[0] or proc.stdout.readline().strip() != b"0":
                return False
            out.seek(0)
            got = out.read(_OUTPUT + 1)
            if len(got) > _OUTPUT or _stripped_lines(got.decode(errors="replace")) != _stripped_lines(want):
                return False
        return True


# The interpreter: limits, Landlock, as root its own uid, the audit hook; then a child per test, exit code on stdout.
_BOOT = r"""# scalerl sandbox
import os, resource as R, select, sys
mem, fsize, nproc, cpu, uid, landlock, keyctl, *fds = map(int, sys.argv[1:])
for k, v in ((R.RLIMIT_AS, mem), (R.RLIMIT_FSIZE, fsize), (R.RLIMIT_NPROC, nproc), (R.RLIMIT_CORE, 0),
             (R.RLIMIT_NOFILE, 64), (R.RLIMIT_CPU, cpu)):
    R.setrlimit(k, (v, v))
code, null = compile(open("prog.py", encoding="utf-8").read(), "prog.py", "exec"), os.open(os.devnull, os.O_WRONLY)
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
if keyctl:  # a session keyring of its own (KEYCTL_JOIN_SESSION_KEYRING): not the run's, and gone with the check
    libc.syscall(keyctl, 1, None)
if landlock:  # system calls 444-446: landlock_create_ruleset, landlock_add_rule, landlock_restrict_self
    abi = libc.syscall(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    # refused: every file access this ABI knows (13, REFER from 2, TRUNCATE from 3, IOCTL_DEV from 5), TCP bind and
    # connect (from 4), abstract unix sockets and signals reaching outside (from 6); allowed: one rule, below
    access = struct.pack("QQQ", (1 << 13 + (abi >= 2) + (abi >= 3) + (abi >= 5)) - 1, 3 * (abi >= 4), 3 * (abi >= 6))
    ruleset, lib = libc.syscall(444, access, 24, 0), os.open(os.path.dirname(os.__file__), os.O_PATH)
    rule = struct.pack("=Qi", 4 | 8, lib)  # READ_FILE | READ_DIR beneath the standard library
    if (abi < 1 or ruleset < 0 or libc.syscall(445, ruleset, 1, rule, 0) or libc.prctl(38, 1, 0, 0, 0)
            or libc.syscall(446, ruleset, 0)):  # PR_SET_NO_NEW_PRIVS, then restrict this process and its children
        raise SystemExit("sandbox: Landlock failed: " + os.strerror(ctypes.get_errno()))
    os.close(ruleset)
    os.close(lib)
del ctypes, struct, libc
for m in ("ctypes", "ctypes._endian", "_ctypes"):
    sys.modules.pop(m, None)
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, 0, 0)
    if not os.access(os.__file__, os.R_OK):  # the standard library is closed to other users: load the usual now
        import array, bisect, collections, copy, decimal, fractions, functools, heapq, itertools, json, math, \
            operator, random, re, string, threading, typing
    os.setresuid(uid, uid, uid)
def hook(event, args, lib=os.path.realpath(os.path.dirname(os.__file__)) + os.sep, real=os.path.realpath,
         write=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, isinstance=isinstance,
         deny=("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.ch",
               "signal.pthread_kill", "pty.", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink",
               "os.link", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.", "ctypes."),
         Err=PermissionError):
    if (event.startswith(deny) or event == "object.__setattr__" and args[0] is hook
            or event == "import" and args[0].partition(".")[0] in ("ctypes", "_ctypes", "_posixsubprocess")
            or event == "open" and not isinstance(args[0], int)
            and ((args[2] or 0) & write or not real(args[0]).startswith(lib))):  # reads of the standard library only
        raise Err("sandbox: " + event + " is not allowed")
sys.addaudithook(hook)
sys.argv = ["prog.py"]
os.write(1, b"ready\n")
for i in range(0, len(fds), 2):
    pid = os.fork()
    if pid == 0:  # one test: its input and output files, nothing else open
        for fd, std in ((fds[i], 0), (fds[i + 1], 1), (null, 2)):
            os.dup2(fd, std)
        os.closerange(3, 1 << 16)
        # then it leaves the loop and exits as `python prog.py` would: its exit code, stdout flushed
        exec(code, {"__name__": "__main__"})
        break
    # the test's end, or this check's grader's (stdin, a pipe only it writes to, closes): then the namespace's first
    # process exits, and the kernel kills the rest
    done = os.pidfd_open(pid)
    if 0 in select.select([0, done], [], [])[0]:
        os._exit(1)
    os.close(done)
    os.write(1, b"%d\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


# keyctl's number (asm-generic 219 on aarch64 and riscv64); elsewhere a root run's keys stay, within the uid's quota
_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280}.get(os.uname().machine)
# as the check's uid: empty, then invalidate (so the kernel frees) its user, user-session and persistent keyrings
_CLEAR_KEYS = """import ctypes, functools, os, sys
keyctl, uid = functools.partial(ctypes.CDLL(None).syscall, int(sys.argv[2])), int(sys.argv[1])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
# KEYCTL_GET_KEYRING_ID of @u and @us (ids first: a lookup by name would make them again), KEYCTL_GET_PERSISTENT
for ring in (keyctl(0, -4, 0), keyctl(0, -5, 0), keyctl(22, -1, -2)):
    if ring > 0:
        keyctl(7, ring), keyctl(21, ring)  # KEYCTL_CLEAR, KEYCTL_INVALIDATE
"""


def _clear_keys(uid):
    """A root run's check has no user namespace, so kernel keys its program added to its uid's keyrings would outlive
    it (`add_key`, `keyctl`): where /proc/key-users lists the uid, a process of that uid removes them."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        # a line of /proc/key-users: "<uid>: <usage> ..."
        if uid >= 0 and _KEYCTL and f"{uid}:" in pathlib.Path("/proc/key-users").read_text().split():
            subprocess.run([sys.executable, "-I", "-S", "-c", _CLEAR_KEYS, str(uid), str(_KEYCTL)], env={}, timeout=30,
                           stdin=subprocess.DEVNULL, capture_output=True)


def _stripped_lines(text):  # outputs compare line by line, trailing whitespace ignored
    return [line.rstrip() for line in text.rstrip().splitlines()]
