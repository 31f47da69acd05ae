"""runs/rehearse.py: a GPU run's whole schedule in virtual time, on a CPU, before a GPU sees it (docs/gpus.md).

    python runs/rehearse.py --config 8b --plan_gpus=80 --steps 300 [--every 25] [any other scalerl.py option]

It runs the run's own scheduling code, nothing of it copied: scalerl.main's loop as trainer rank 0 runs it (the
evaluations it asks, the checkpoints and the waits on evaluation rows, the stale drops of infra.dist.TrainerLink),
infra.run.generator_rank on every generator rank (infra.dist.run_generator: admission under the lag bound with room
kept for held-out groups, weights taken between engine steps, groups sent) and the vLLM engine's own _submit for a
request's place in vLLM's queue. What it replaces is what takes a GPU's time, through the seams the loop takes: a
virtual clock (a thread per rank, one running at a time, each waiting in virtual time on one event heap), the job's
TCPStore (a dict), the transport (groups handed to trainer rank 0's inbox, a weight sync a pause) and the engine, a
fake of the interface the PyTorch and vLLM engines share whose step() jumps to the next completion, interruption or
store write: 300 steps of `8b` are some 300,000 events, not billions of decode steps.

Rates and capacities are the plan's (infra/plan.py, as --dry_run prints them): the split of the GPUs, --dist_timeout,
a trainer step, the decode time a token at each number of running requests, the KV cache (completions of mean length
it runs; vLLM queues the rest), prefill, the pause a version. Completion lengths and the interruption rate are flags
whose defaults say their source (--help). It prints a timeline every --every steps and exits 1 naming the first
failure: a wait the run's code gives up on, an evaluation not complete by the checkpoint that needs it, over
--stale_limit of the groups dropped stale, a GPU column the plan's memory verdict does not fit, or a start the run
refuses.

What it cannot know: NCCL's and the reload's real times (a weight sync is a flat pause), the real length and
interruption distributions, the real speeds (the plan's H100 estimates), vLLM's paging (its cache holds whole
completions of mean length, never preempted) and prefix cache beyond the rule (a group's prompt prefilled once, a
resubmission's prefix again after a weight update), the verifier's time, a rank's start-up.
"""
import argparse
import collections
import concurrent.futures
import contextlib
import functools
from dataclasses import replace
import heapq
import io
import math
import os
import queue
import random
import sys
import tempfile
import threading
import time
import traceback
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
import scalerl  # noqa: E402
from infra import dist, plan, run  # noqa: E402
from infra.vllm_engine import VLLMEngine  # noqa: E402

PHRASE = 24  # tokens of the interruption phrase with </think> (infra/plan.py's seq_len counts 24, generously)


# -- virtual time ------------------------------------------------------------------------------------------------------
class Actor:
    """A rank: a thread that runs only while it holds the baton, and otherwise waits for its wake time."""
    def __init__(self, name, role):
        self.name, self.role, self.sem = name, role, threading.Semaphore(0)
        self.wake, self.token, self.soon, self.idle_since = math.inf, None, None, None


class Sim:
    """The virtual clock: an event heap of (time, actor); the earliest actor runs, alone, until it waits again."""
    def __init__(self, poll_s, seed=0):
        self.now, self.heap, self.n, self.poll_s, self.phase = 0.0, [], 0, poll_s, random.Random(f"poll:{seed}")
        self.current, self.failure, self.done, self.actors = None, None, threading.Event(), []

    def spawn(self, name, role, fn, *args):
        a = Actor(name, role)
        self.actors.append(a)

        def body():
            a.sem.acquire()
            try:
                fn(*args)
                self.fail(f"{name} ended before the rehearsal did")
            except SystemExit as e:  # infra.fail: its line is on stderr already
                self.fail(f"{name} exited with code {e.code} (its error line is above)")
            except BaseException as e:  # noqa: BLE001 -- whatever it is, the rehearsal reports it
                self.fail(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        self._schedule(a, self.now)
        threading.Thread(target=body, daemon=True, name=name).start()
        return a

    def run(self):
        """Hand the baton to the first actor; return once the rehearsal ended (finish or fail)."""
        self._next(None)
        self.done.wait()

    def _schedule(self, a, t):
        self.n += 1
        a.wake, a.token = t, self.n
        heapq.heappush(self.heap, (t, self.n, a))

    def _next(self, me):
        """Pass the baton to the earliest scheduled actor (`me` waits for it again unless it is the one)."""
        while True:
            if not self.heap:
                self.fail("every rank waits and none will wake: the schedule is stuck")
            t, n, a = heapq.heappop(self.heap)
            if a.token == n:
                break
        a.token, self.now, self.current = None, t, a
        if a is not me:
            a.sem.release()
            if me is not None:
                me.sem.acquire()

    def wait(self, until, soon=None):
        """The current actor waits until `until`; with `soon`, a store write by the other role wakes it earlier, at
        max(the write + up to POLL_S, soon): a rank polls the TCPStore every POLL_S (infra.dist), at its own phase."""
        a = self.current
        a.soon = soon
        self._schedule(a, until)
        self._next(a)

    def wake(self, a, t):
        if a.token is not None and t < a.wake:
            self._schedule(a, t)

    def poke(self, actors):
        for a in actors:
            if a.soon is not None and a.role != self.current.role:
                self.wake(a, max(self.now + self.phase.uniform(0, self.poll_s), a.soon))

    def fail(self, msg):
        """The first failure ends the rehearsal; this actor never runs again."""
        if self.failure is None:
            self.failure = msg
        self.done.set()
        threading.Event().wait()

    def finish(self):
        self.done.set()
        threading.Event().wait()


class Clock:
    """A rank's clock (infra.dist.Dist.clock) in virtual time: a sleep lasts until the other role writes what this rank
    reads in the store (then POLL_S more), or just past `horizon` (--dist_timeout: no wait of the real code lets more
    pass unchecked)."""
    def __init__(self, sim, horizon):
        self.sim, self.horizon = sim, horizon

    def time(self):
        return self.sim.now

    def sleep(self, dt):
        a = self.sim.current
        if a.role == "generator" and a.idle_since is None:
            a.idle_since = self.sim.now
        self.sim.wait(self.sim.now + max(dt, self.horizon + self.sim.poll_s), soon=self.sim.now + dt)

    def hold(self, dt):
        """A pause nothing shortens (a weight sync, a train step, a checkpoint)."""
        self.sim.wait(self.sim.now + dt)


class Store:
    """The job's TCPStore (add, set, get, check, delete_key) on a dict; a write wakes the other role's readers of the
    key."""
    def __init__(self, sim, on_set):
        self.sim, self.d, self.readers, self.on_set = sim, {}, collections.defaultdict(set), on_set

    def _read(self, key):
        self.readers[key].add(self.sim.current)

    def _wrote(self, key):
        if key in self.readers:
            self.sim.poke(self.readers[key])

    def add(self, key, n):
        if key.startswith("alive/"):  # heartbeats (infra.dist.dist_init starts them): every rank lives
            return int(self.sim.now)
        self.d[key] = self.d.get(key, 0) + n
        self._wrote(key) if n else self._read(key)
        return self.d[key]

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else value
        self.on_set(key)
        self._wrote(key)

    def get(self, key):
        self._read(key)
        return self.d[key]

    def check(self, keys):
        for key in keys:
            self._read(key)
        return all(key in self.d for key in keys)

    def delete_key(self, key):
        return self.d.pop(key, None) is not None


class Inbox:
    """Trainer rank 0's queue of received groups (queue.Queue's get and put) in virtual time."""
    def __init__(self, sim):
        self.sim, self.items, self.getter = sim, collections.deque(), None

    def put(self, item):
        self.items.append(item)
        if self.getter is not None:
            self.sim.wake(self.getter, self.sim.now)

    def get(self, timeout):
        deadline = self.sim.now + timeout
        while not self.items:
            if self.sim.now >= deadline:
                raise queue.Empty
            self.getter = self.sim.current
            self.sim.wait(deadline)
            self.getter = None
        return self.items.popleft()


class Done(concurrent.futures.Future):
    """The scoring thread's future, done at once: rewards take no virtual time."""
    def __init__(self, fn, *args):
        super().__init__()
        self.set_result(fn(*args))


class Inline:
    """run_generator's scorer: scores at once."""
    submit = staticmethod(Done)


# -- the virtual engine ------------------------------------------------------------------------------------------------
class Request:
    """A completion in the engine: tokens to its next event (`seg`), after an interruption (`rest`), to prefill."""
    __slots__ = ("run", "sample", "seg", "rest", "prefix", "key", "order", "since", "resubmitted", "made", "salt")

    def __init__(self, run_, seg, rest, prefix):
        self.run, self.sample, self.seg, self.rest, self.prefix = run_, run_.sample, seg, rest, prefix
        self.key, self.order, self.since, self.resubmitted, self.made, self.salt = None, None, 0.0, False, 0, 0


class VirtualEngine(engine.Engine):
    """The engines' shared interface (add, step, room, busy, version, load_weights, stats) in virtual time. Requests
    run at most `cap` at once (what the KV cache holds), the rest wait in a queue; every running request decodes one
    token per tick, the tick the plan's at that many running; a start costs its prefill. An interrupted request (vLLM:
    `resubmit`) is aborted and submitted again with the phrase, its prefix prefilled again after a weight update, its
    place in the queue `resubmit(request)`'s; the PyTorch engine writes the phrase into its slot."""
    def __init__(self, sim, r, *, submit, seed, **rules):
        super().__init__(seed=seed, **rules)
        self.sim, self.r, self.submit = sim, r, submit
        self.lengths = random.Random(f"lengths:{seed}")
        # the vLLM engine's counts; seconds with any request running, and their sum over the running requests; each
        # start's wait in the queue (first submissions, resubmissions)
        self.stats.update(reprefill_tokens=0, resubmits=0, resubmit_wait_us=0, busy_s=0.0, running_s=0.0, waits=[],
                          resubmitted_waits=[])
        self.waiting, self.running, self.live, self.arrivals, self.started = [], [], 0, 0, set()
        self.progress, self.t, self.debt = 0.0, 0.0, 0.0  # tokens each running request made; accounted time; stall

    busy = property(lambda self: self.live > 0)
    room = property(lambda self: self.r.slots - self.live)

    def _queue(self, template, n):
        r, prompt = self.r, len(template.prompt_tokens)
        for _ in range(n):
            run_ = self._start(template)  # the thinking budget, drawn as the real engines draw it
            if self.interrupt_ids is not None and self.lengths.random() < r.interrupted:
                seg, rest = run_.left, self.lengths.randint(1, self.answer_budget)
                run_.sample.interrupted = True
            else:
                seg, rest = self.lengths.randint(*r.natural), None
            # a group's prompt is prefilled once (TorchEngine shares it; vLLM's prefix cache)
            first = template.group not in self.started
            self.started.add(template.group)
            self._enqueue(Request(run_, seg, rest, prompt if first else 0))
            self.live += 1

    def _enqueue(self, q, computed=0):
        """A submission: its place in the queue is (the priority the engine's rule gives it, arrival); vLLM salts a
        request's cached blocks with the version."""
        self.arrivals += 1
        # the vLLM engine resubmits an interrupted request with its first submission's place (VLLMEngine.step)
        priority = self.submit(self, q.run, computed, q.order) if self.submit else None
        q.order = priority if q.order is None else q.order
        q.key, q.since, q.salt = (priority or 0, self.arrivals), self.sim.now, self.version
        heapq.heappush(self.waiting, (q.key, id(q), q))

    def _advance(self):
        """Account the time since the last event: a stall (prefill, weight load) first, then decoding."""
        dt, self.t = self.sim.now - self.t, self.sim.now
        if self.running:
            self.stats["busy_s"] += dt
            self.stats["running_s"] += dt * len(self.running)
        stall = min(self.debt, dt)
        self.debt -= stall
        if self.running and dt > stall:
            self.progress += (dt - stall) / self.r.tick(len(self.running))

    def _fill(self):
        while self.waiting and len(self.running) < self.r.cap:
            _, _, q = heapq.heappop(self.waiting)
            w = self.sim.now - q.since
            if q.resubmitted:
                self.stats["resubmits"] += 1
                self.stats["resubmit_wait_us"] += int(w * 1e6)
            self.stats["resubmitted_waits" if q.resubmitted else "waits"].append(w)
            self.debt += q.prefix * self.r.prefill
            if not q.sample.versions:
                q.sample.versions.append(self.version)  # its first token's version, once it decodes
            heapq.heappush(self.running, (self.progress + q.seg, id(q), q))

    def pause(self, seconds):
        """A weight load: nothing decodes meanwhile (vLLM's engine core is paused for the receive)."""
        self._advance()
        self.debt += seconds

    def load_weights(self, source, version):
        self._advance()
        self.version = version

    def step(self):
        a = self.sim.current
        if a.idle_since is not None:
            self.r.idle(a, self.sim.now - a.idle_since)
            a.idle_since = None
        self._advance()
        self._fill()
        end = self.running[0][0]
        self.sim.wait(self.t + self.debt + (end - self.progress) * self.r.tick(len(self.running)), soon=self.sim.now)
        self._advance()
        done = []
        while self.running and self.running[0][0] <= self.progress + 1e-6:
            _, _, q = heapq.heappop(self.running)
            s = q.sample
            self.stats["tokens"] += q.seg
            q.made += q.seg
            if q.rest is not None and self.submit is not None:
                # vLLM: aborted, submitted again with the phrase; its prefix is computed again after an update
                again = (len(s.prompt_tokens) + q.made) * (self.version != q.salt)
                q.prefix, q.made = again + len(self.interrupt_ids), q.made + len(self.interrupt_ids)
                self.stats["reprefill_tokens"] += again
                q.seg, q.rest, q.resubmitted = q.rest, None, True
                self._enqueue(q, len(s.prompt_tokens) + q.made - len(self.interrupt_ids))
            elif q.rest is not None:  # the PyTorch engine: the phrase into its slot, decoding goes on
                q.made += len(self.interrupt_ids)
                self.debt += len(self.interrupt_ids) * self.r.prefill
                q.seg, q.rest = q.rest, None
                heapq.heappush(self.running, (self.progress + q.seg, id(q), q))
            else:
                # its first and last token stand for all (their versions are what the schedule reads)
                s.versions.append(self.version)
                s.tokens, s.logprobs, s.forced = [0, 0], [0.0, 0.0], [False, False]
                self.live -= 1
                self._finish(s, done)
        self._fill()
        return done


class Submit:
    """The vLLM engine's own `_submit` on a stand-in for it: the priority it gives a request in vLLM's queue (None:
    vLLM's first-come-first-served order), whatever rule it follows."""
    def __init__(self):
        self.stats, self.rng, self.llm, self.params = dict(prefills=0), torch.Generator(), self, dict

    def add_request(self, rid, prompt, params, priority=None, **kw):
        self.priority = priority

    def __call__(self, engine_, run_, computed, order):
        self.version, self.answer_budget, self.priority = engine_.version, engine_.answer_budget, None
        self.live, self.order, self.resubmitted = {}, {}, {}
        VLLMEngine._submit(self, run_, computed, order)
        return self.priority


# -- the generating side: prompts and scores -------------------------------------------------------------------------
class Rollouts:
    """pipeline_rl.Rollouts' interface for run_generator: prompts of plan lengths, every group kept, no rewards."""
    def __init__(self, engine_, max_prompt, seed):
        self.engine, self.max_prompt, self.rng = engine_, max_prompt, random.Random(f"prompts:{seed}")

    def template(self, problem, group):
        return engine.Sample(problem.id, group, [0] * self.rng.randint(1, self.max_prompt), meta=problem)

    def next_template(self, group):
        return self.template(SimpleNamespace(id=group, task="train"), group)

    def score(self, groups):
        pass

    def keep(self, group):
        return True

    def info(self):
        return dict(npr_removed=0, epoch=0, reward_errors=0, bad_prompts=0)

    def state_dict(self):
        return {}


# -- trainer rank 0's side -------------------------------------------------------------------------------------------
class Link(dist.TrainerLink):
    """TrainerLink as trainer rank 0 holds it (its stale drops, evaluation asks and waits are the real ones), the
    groups delivered by `deliver` instead of receiver threads, a weight sync a pause."""
    def __init__(self, job, cfg, r):
        generators, job.generators = job.generators, []  # no receiver threads
        super().__init__(job, k=cfg.max_lag, batch_prompts=cfg.batch_prompts, bucket_bytes=cfg.sync_bucket_mb << 20)
        job.generators, self.r, self.inbox = generators, r, Inbox(r.sim)

    def deliver(self, src, msg):
        """A generator's send_groups (each group packed as on the wire), then TrainerLink._receive's bookkeeping."""
        if msg is not None:
            self.info[src] = msg[1]
            for kept, g in msg[0]:
                self.kept[g[0].group] = kept
                self.inbox.put(dist.pack(g))

    def next_batch(self):
        t = self.r.sim.now
        batch = super().next_batch()
        self.r.waited("trainer rank 0 for a batch", self.r.sim.now - t)
        return batch

    def push_weights(self, policy, publish=True):
        self.version += 1
        if publish:
            dist.counter(self.job, "version", 1)
            self.r.clock.hold(self.r.sync_s)

    def ask_eval(self, version, row):
        self.r.asked[version] = row["step"]
        super().ask_eval(version, row)

    def evals(self, *args, **kw):
        t = self.r.sim.now
        out = super().evals(*args, **kw)
        self.r.waited("trainer rank 0 for evaluation rows", self.r.sim.now - t)
        return out


class Log:
    """rundir.Log's calls in scalerl.main: the rehearsal's timeline instead of the run's files."""
    def __init__(self, r):
        self.r, self.clock, self.lost_eval, self.took = r, dict(device_hours=0.0, cpu_hours=0.0), False, {}

    def timer(self, key):
        return contextlib.nullcontext()

    def open(self, *args):
        pass

    def begin(self, source):
        self.r.begin(source)

    def step(self, step, batch, stats, source, bad_run):
        self.r.stepped(step, source)
        return f"step {step}"

    def write(self, row):
        pass


class Stand:
    """A module of scalerl.main's (run, rundir, sources, trainer) with some functions replaced, the rest its own."""
    def __init__(self, module, **replaced):
        self.module, self.replaced = module, replaced

    def __getattr__(self, name):
        return self.replaced[name] if name in self.replaced else getattr(self.module, name)


# -- the rehearsal -----------------------------------------------------------------------------------------------------
class Rehearsal:
    """The plan's rates and capacities, the ranks as actors, the failure checks and the timeline."""
    def __init__(self, cfg, opts, out):
        self.cfg, self.opts, self.out = cfg, opts, out
        world = cfg.plan_gpus or int(os.environ.get("WORLD_SIZE", 0)) or (1 if cfg.model == "tiny" else 80)  # plan's
        shape = plan.model_shape(cfg)
        if world < 2 or shape is None:
            sys.exit(f"error: the rehearsal needs a torchrun job of a model whose shape is known: got {world} GPU(s)"
                     f" and --model={cfg.model}; give --plan_gpus=N (N >= 2)")
        g, cfg.dist_timeout, self.refused = plan.settle(cfg, world)  # what infra.run.start takes and refuses
        trainers, gens = dist.roles(world, g, cfg.gen_share)
        cfg.gen_ranks, T, G = len(gens), len(trainers), len(gens)
        self.world, self.T, self.G, self.shape = world, T, G, shape
        self.memory = self.verdict(cfg)
        t = plan.timing(cfg, shape, world, T, G)
        # a decode step's time at n running: the plan's, linear in n (its tick at one and two running sequences)
        t1, t2 = (plan.timing(replace(cfg, slots=n), shape, world, T, G)["tick"] for n in (1, 2))
        self.tick = lambda n: t1 + (n - 1) * (t2 - t1)
        P, kv_token = plan.sizes(cfg, shape)[0], plan.sizes(cfg, shape)[5]
        # a prefilled token's seconds (the plan's interruption row: 2 FLOPs a parameter at its MFU); a checkpoint: a
        # trainer rank's shard of fp32 weights and AdamW's m, v (its preemption row) at --ckpt_gbs
        self.prefill, self.ckpt_s = 2 * P / (plan.BF16_FLOPS * plan.MFU), 12 * P / T / (opts.ckpt_gbs * 1e9)
        self.step_s, self.slots = t["step"], cfg.slots
        self.sync_s = opts.sync_s if opts.sync_s >= 0 else t["pause"]
        # completion lengths: a share --interrupted reaches its thinking budget (then the phrase and an answer of
        # uniform length); the others uniform on [lo, hi] with hi the shortest budget and its answer, the mean
        # --mean_len of the longest
        longest, p = cfg.think_max + PHRASE + cfg.answer_budget, opts.interrupted if cfg.interrupt else 0.0
        cut = (cfg.think_min + cfg.think_max) / 2 + PHRASE + (cfg.answer_budget + 1) / 2
        m = max(1.0, (opts.mean_len * longest - p * cut) / (1 - p))
        hi = min(cfg.think_min + cfg.answer_budget, round(2 * m) - 1)
        self.natural, self.interrupted = (max(1, round(2 * m) - hi), max(1, hi)), p
        mean_seq = (cfg.max_prompt + 1) / 2 + p * cut + (1 - p) * sum(self.natural) / 2
        kv = plan.columns(cfg, shape, world, T, plan.seq_len(cfg))["generators"]["KV cache"]
        self.cap = max(1, min(cfg.slots, int(kv / (kv_token * mean_seq)))) if cfg.engine == "vllm" else cfg.slots
        self.sim = Sim(dist.POLL_S)
        self.clock = Clock(self.sim, cfg.dist_timeout)
        # wait -> (longest, its limit); evaluations: version -> the step that asked, generator ranks done, the step
        # all were
        self.waits, self.asked, self.parts, self.done = {}, {}, collections.Counter(), {}
        self.step, self.engines = 0, []

    def verdict(self, cfg):
        """The GPU columns whose memory the plan's verdict does not fit (its table: 15 characters a column)."""
        lines = plan.plan(replace(cfg, plan_gpus=self.world)).splitlines()
        header, line = (next(x for x in lines if x.strip().startswith(w)) for w in ("memory per GPU", "verdict"))
        cells = lambda x: [x[i:i + 15].strip() for i in range(40, len(x), 15)]  # noqa: E731
        return [c for c, v in zip(cells(header), cells(line)) if v != "fits"]

    def waited(self, what, seconds):
        """The longest wait of each kind. None has a limit of its own: a wait ends once the rank it waits on has been
        silent for --dist_timeout (infra.dist.alive), and every rank here lives; a give-up of the real code fails."""
        self.waits[what] = max(self.waits.get(what, 0.0), seconds)

    def idle(self, actor, seconds):
        self.waited("a generator idle", seconds)

    def on_set(self, key):
        """An evaluation is complete once every generator rank has set its part (infra.dist.TrainerLink.evals)."""
        parts = key.split("/")
        if parts[0] == "eval" and len(parts) == 3:
            self.parts[int(parts[1])] += 1
            if self.parts[int(parts[1])] == self.G:
                self.done[int(parts[1])] = self.step

    # scalerl.main's calls
    def save_checkpoint(self, cfg, step, clock, source, job, policy, opt):
        """A checkpoint holds the rows of the evaluations asked --eval_every steps before it (docs/torchrun.md)."""
        late = [v for v, at in self.asked.items() if at <= step - cfg.eval_every and v not in self.done]
        if late and step > 0:
            self.sim.fail(f"the evaluation of step {self.asked[late[0]]} (policy version {late[0]}) is not complete by "
                          f"the step-{step} checkpoint that needs it")
        self.clock.hold(self.ckpt_s)

    def train_step(self, policy, opt, kept, cfg, step, comm):
        self.clock.hold(self.step_s)
        return dict(finite=True)

    def begin(self, source):
        if self.step >= self.opts.steps:
            self.sim.finish()

    def stepped(self, step, source):
        self.step = step
        groups = step * self.cfg.batch_prompts + source.dropped_stale
        if groups >= 20 * self.cfg.batch_prompts and source.dropped_stale > self.opts.stale_limit * groups:
            self.sim.fail(f"{source.dropped_stale} of {groups} groups dropped stale by step {step}, over "
                          f"{self.opts.stale_limit:.0%}")
        if step % self.opts.every == 0:
            self.report()

    def finished(self, *args):  # scalerl.main's end: run.finish
        self.sim.finish()

    def die(self, msg):
        self.sim.fail(f"a wait past its limit: {msg}")

    def receive_weights(self, job, engine_, version, bucket_bytes, take=True, bufs=None):
        """infra.dist.receive_weights in virtual time: the engine paused for the receive and reload."""
        engine_.pause(self.sync_s)
        self.clock.hold(self.sync_s)
        if take:
            engine_.load_weights(None, version)

    def snapshot(self):
        """Where the timeline stands: time, step, the engines' busy and running seconds and the waits they logged."""
        return dict(t=self.sim.now, step=self.step, busy=sum(e.stats["busy_s"] for e in self.engines),
                    running=sum(e.stats["running_s"] for e in self.engines),
                    seen=[(len(e.stats["waits"]), len(e.stats["resubmitted_waits"])) for e in self.engines])

    def report(self, final=False):
        """A timeline row: the steps since the last one (the final row: the whole rehearsal)."""
        since, now = self.start if final else self.last, self.snapshot()
        dt, steps = max(now["t"] - since["t"], 1e-9), max(now["step"] - since["step"], 1)
        waits, resub = ([w for e, seen in zip(self.engines, since["seen"]) for w in e.stats[key][seen[i]:]]
                        for i, key in enumerate(("waits", "resubmitted_waits")))
        lags = [self.done[v] - at for v, at in self.asked.items() if v in self.done]
        pending = [self.step - at for v, at in self.asked.items() if v not in self.done]
        groups = self.step * self.cfg.batch_prompts + self.link.dropped_stale
        what, longest = max(self.waits.items(), key=lambda x: x[1], default=("-", 0.0))
        row = dict(step=self.step, hours=now["t"] / 3600, step_s=(now["t"] - since["t"]) / steps,
                   busy=(now["busy"] - since["busy"]) / (self.G * dt),
                   kv=(now["running"] - since["running"]) / (self.G * self.cap * dt),
                   wait=sum(waits) / max(len(waits), 1), wait_max=max(waits, default=0.0),
                   resubmitted_max=max(resub, default=0.0), lag=max(lags, default=0),
                   stale=self.link.dropped_stale / max(groups, 1))
        late = f" (one pending {max(pending)})" if pending else ""
        print(f"{'total' if final else 'step'} {self.step:5d} {row['hours']:7.1f} h | {row['step_s']:6,.0f} s/step | "
              f"generators busy {row['busy']:4.0%}, KV {row['kv']:4.0%} | queue wait {row['wait']:5,.0f} s, longest "
              f"{row['wait_max']:6,.0f} s, resubmitted {row['resubmitted_max']:6,.0f} s | eval lag {row['lag']} steps"
              f"{late} | stale {row['stale']:.1%} | longest wait {longest:,.0f} s: {what}", file=self.out, flush=True)
        self.last = now
        return row

    def run(self):
        """0: the schedule held for --steps; 1: the first failure, named."""
        cfg, G, out = self.cfg, self.G, self.out
        print(f"rehearsal of --model={cfg.model} on {self.world} GPUs: {self.T} trainer, {G} generator ranks; trainer "
              f"step {self.step_s:,.0f} s, weight sync {self.sync_s:.1f} s, checkpoint {self.ckpt_s:.0f} s; a "
              f"generator runs {self.cap} of its {cfg.slots} slots at {self.tick(self.cap) * 1e3:.0f} ms a token, "
              f"prefill {self.prefill * 1e6:.0f} us a token; completions: {self.interrupted:.0%} interrupted, the "
              f"others {self.natural[0]:,}-{self.natural[1]:,} tokens; --dist_timeout={cfg.dist_timeout:,.0f} s",
              file=out, flush=True)
        if self.refused:
            return self.failed(f"the run refuses to start: {self.refused}")
        if self.memory:
            return self.failed(f"memory: the plan's verdict is 'does not fit' for {', '.join(self.memory)} (see "
                               "--dry_run)")
        store = Store(self.sim, self.on_set)
        gens = list(range(1, G + 1))  # one trainer actor stands for the trainer ranks (the plan's step time is theirs)
        job = dist.Dist(0, G + 1, [0], gens, cfg.dist_timeout, {}, store, self.clock)
        self.link, log = Link(job, cfg, self), Log(self)
        val = [SimpleNamespace(id=i, task="math") for i in range(cfg.eval_prompts)]
        # the generator ranks' loop with the virtual transport and scorer (infra.run.generator_rank calls it)
        loop = functools.partial(dist.run_generator, send=lambda j, msg: self.link.deliver(j.rank, msg),
                                 receive=self.receive_weights, scorer=Inline())
        patches = [(dist, dict(run_generator=loop, die=self.die)),
                   (scalerl, dict(
                       run=Stand(run, start=lambda c: (job, None, None), place=lambda *a: None,
                                 batch_source=lambda *a: self.link, policy=lambda *a: (None, None),
                                 restore=lambda *a: (0, log.clock), finish=self.finished),
                       rundir=Stand(scalerl.rundir, Log=lambda c, j: log, save_checkpoint=self.save_checkpoint,
                                    Preemption=lambda: SimpleNamespace(signal=None)),
                       sources=Stand(scalerl.sources, load_data=lambda c: (None, val, ["math"]),
                                     load_model=lambda c, tasks: (None, None)),
                       trainer=Stand(scalerl.trainer, train_step=self.train_step, warm_start=lambda *a: None)))]
        self.sim.spawn("trainer rank 0", "trainer", scalerl.main, cfg)
        for rank in gens:
            e = VirtualEngine(self.sim, self, submit=Submit() if cfg.engine == "vllm" else None, seed=cfg.seed + rank,
                              max_prompt=cfg.max_prompt,
                              think_budget=(cfg.think_min, cfg.think_max), answer_budget=cfg.answer_budget, eos_id=0,
                              think_close_ids=[1], interrupt_ids=[2] * (PHRASE - 1) + [1] if cfg.interrupt else None)
            self.engines.append(e)
            gjob = dist.Dist(rank, G + 1, [0], gens, cfg.dist_timeout, {}, store, self.clock)
            self.sim.spawn(f"generator rank {rank}", "generator", run.generator_rank, cfg, gjob,
                           Rollouts(e, cfg.max_prompt, cfg.seed + rank), val, None)
        self.start = self.last = self.snapshot()
        with patched(patches), contextlib.redirect_stdout(io.StringIO()):
            self.sim.run()
        self.summary = self.report(final=True)
        return self.failed(self.sim.failure) if self.sim.failure else 0

    def failed(self, msg):
        print(f"FAILED at step {self.step}: {msg}", file=self.out, flush=True)
        return 1


@contextlib.contextmanager
def patched(patches):
    """Module attributes replaced for the rehearsal, put back after."""
    saved = [(m, {k: getattr(m, k) for k in over}) for m, over in patches]
    for m, over in patches:
        for k, v in over.items():
            setattr(m, k, v)
    try:
        yield
    finally:
        for m, old in saved:
            for k, v in old.items():
                setattr(m, k, v)


def main(argv, out=sys.stdout):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                 epilog="every other option is scalerl.py's (python scalerl.py --help)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps to rehearse")
    ap.add_argument("--every", type=int, default=25, help="a timeline row every N steps")
    ap.add_argument("--interrupted", type=float, default=0.05,
                    help="share of completions that reach their thinking budget (default: the paper kept truncation\n"
                         "under 5%% in over 90%% of steps, App. A.10)")
    ap.add_argument("--mean_len", type=float, default=plan.MEAN_LEN,
                    help="a completion's mean length, share of the longest (default: the plan's MEAN_LEN)")
    ap.add_argument("--sync_s", type=float, default=-1.0,
                    help="seconds a weight sync pauses a generator (-1: the plan's pause a version)")
    ap.add_argument("--ckpt_gbs", type=float, default=1.0,
                    help="GB/s a trainer rank writes its checkpoint shard (default: an assumption, shared storage)")
    ap.add_argument("--stale_limit", type=float, default=0.05, help="the share of groups dropped stale that fails")
    opts, rest = ap.parse_known_args(argv)
    if not (opts.steps > 0 and opts.every > 0 and 0 <= opts.interrupted < 1 and 0 < opts.mean_len <= 1):
        ap.error("--steps and --every must be positive, --interrupted in [0, 1), --mean_len in (0, 1]")
    cfg = scalerl.parse_args(rest + ["--dry_run"])  # checked as for a plan: vLLM need not be installed
    cfg.dry_run = False
    with tempfile.TemporaryDirectory(prefix="rehearse-") as tmp:
        cfg.out_dir = tmp  # the generator ranks' curriculum files
        return Rehearsal(cfg, opts, out).run()


if __name__ == "__main__":
    t0 = time.process_time()
    code = main(sys.argv[1:])
    print(f"({time.process_time() - t0:.0f} s of CPU)")
    sys.exit(code)
