"""Throughput of the sandboxed code verifier (infra/sandbox.py's check_program): verifications per second, limits on.

Each verification runs one built-in code problem's program against its hidden tests in a fresh sandbox (as on
the training path, minus the reward's cache of repeated programs): half the programs are the reference solution
(all tests run), half have slipped steps (the first failing test ends the check). Serial, then with N threads
of `data.parallel_map`-style workers. A DeepCoder-sized case (one program, many tests) shows the per-test cost.

Run: `python bench/verifier.py` (about a minute on 2 cores); `--n`, `--workers`, `--tests` change the sizes.
"""
import argparse
import concurrent.futures
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
from infra import sandbox  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="verifications per measurement")
    ap.add_argument("--workers", default="1,2,4,8", help="comma-separated thread counts")
    ap.add_argument("--tests", type=int, default=100, help="tests in the DeepCoder-sized case")
    args = ap.parse_args()
    print(f"sandbox: {sandbox.sandbox_description()} | {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    good = data.code_problems(args.n // 2, seed=0)
    bad = data.code_problems(args.n - args.n // 2, seed=0, start_id=args.n, error_rate=1.0)
    jobs = [(data.format_target(p).split(data.THINK_CLOSE)[1], data.code_tests(p.answer)) for p in good + bad]
    want = [all(eval(p.trace.rsplit(",", 1)[-1], dict(zip("ab", map(int, i.split())))) == int(o)  # what the program
                for i, o in data.code_tests(p.answer)) for p in good + bad]                        # computes
    for w in map(int, args.workers.split(",")):
        with concurrent.futures.ThreadPoolExecutor(w) as pool:
            t0 = time.perf_counter()
            got = list(pool.map(lambda job: sandbox.check_program(*job), jobs))
            dt = time.perf_counter() - t0
        assert got == want, "a verdict changed under load"
        print(f"{w:2d} worker(s): {len(jobs) / dt:6.1f} verifications/s ({dt / len(jobs) * 1000 * w:5.0f} ms each, "
              f"{sum(want)} pass 3 tests, {len(want) - sum(want)} fail early)")
    tests = [(f"{i} {i + 1}\n", f"{2 * i + 1}\n") for i in range(args.tests)]
    t0 = time.perf_counter()
    assert sandbox.check_program("a,b=map(int,input().split())\nprint(a+b)\n", tests)
    dt = time.perf_counter() - t0
    print(f"one program, {args.tests} tests: {dt * 1000:.0f} ms ({dt / args.tests * 1000:.1f} ms per test, "
          f"16 tests per interpreter)")


if __name__ == "__main__":
    main()
