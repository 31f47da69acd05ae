"""infra/dist.py: torchrun. Ranks 0..T-1 train (FSDP2 over them; rank 0 also logs, evaluates, checkpoints and
publishes weights), ranks T..W-1 generate; a plain `python scalerl.py` is a world of one and needs none of this.
What it guarantees (bounded waits, rollouts, weight buckets, FSDP2, a generator rank's state): docs/torchrun.md."""
import collections
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
import atexit
import json
import os
import queue
import shutil
import sys
import threading
import time

import torch
import torch.distributed as dist

from infra import die, first_line
from pipeline_rl import BatchSource, admission_limit

POLL_S = 0.1  # seconds between a generator rank's visits to the job's TCPStore
RESUBMITS = ("reprefill_tokens", "resubmits", "resubmit_wait_us")  # the vLLM engine's counts of its resubmissions
HEARTBEAT_S = 2.0  # seconds between a rank's heartbeats in the job's TCPStore, and between a wait's checks of them


@dataclass
class Dist:
    """This process's place in the job (world 1: a plain `python scalerl.py`, no process groups)."""
    rank: int = 0
    world: int = 1
    trainers: list = field(default_factory=lambda: [0])  # global ranks that train; trainers[0] == 0
    generators: list = field(default_factory=list)        # global ranks that generate
    timeout: float = 60.0                                  # seconds a rank may be silent before a wait gives up
    groups: dict = field(default_factory=dict)             # "trainer", "weights", generator rank -> rollout group
    store: object = None                                   # the job's TCPStore
    clock: object = time                                   # time() and sleep(s): runs/rehearse.py passes a virtual one
    heard: dict = field(default_factory=dict)              # rank -> (its heartbeats, when they last moved); "checked"
    gates: int = 0                                         # the gates this trainer rank has passed

    def who(self, rank):
        return f"{'trainer' if rank in self.trainers else 'generator'} rank {rank}"
    name = property(lambda self: self.who(self.rank))


def roles(world, gen_ranks=0, gen_share=0.5):
    """(trainer ranks, generator ranks): `gen_ranks` generators (0: gen_share of the world, at least 1), last."""
    n_gen = gen_ranks or min(world - 1, max(1, round(world * gen_share)))
    if n_gen >= world:
        raise ValueError(f"--gen_ranks={n_gen} leaves no trainer rank in a world of {world}; use at most {world - 1}")
    return list(range(world - n_gen)), list(range(world - n_gen, world))


def dist_init(gen_ranks=0, timeout=60.0, gen_share=0.5):
    """Join the torchrun job, if any, and assign roles (see `roles`)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return Dist(timeout=timeout)
    roles(world, gen_ranks, gen_share)  # a split that leaves no trainer is refused before joining
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # one GPU per rank (NCCL needs it set first)
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timedelta(seconds=max(timeout, 1800)))  # start-up only, long warm start included
    # rank 0's generator count and time-out on every rank (infra.run.start may take them from rank 0's plan)
    box = [gen_ranks, timeout]
    dist.broadcast_object_list(box, src=0)
    gen_ranks, timeout = box
    trainers, generators = roles(world, gen_ranks, gen_share)
    # NCCL's watchdog, after ours. Trainer ranks enter their collectives together (ranks 1.. pass a `gate` after any
    # wait of rank 0 on the generators): these time-outs cover transfers and compute skew, never a wait
    late = timedelta(seconds=timeout + 60)
    groups = dict(trainer=dist.new_group(trainers, timeout=late),
                  weights=dist.new_group([0] + generators, timeout=late))
    # pickled rollouts are CPU bytes: gloo even where weights go over NCCL; trainer rank 0's receiver waits as long as
    # it must (its wait on the generators is next_batch's), a sender as long as waiting_for allows
    for rank in generators:
        groups[rank] = dist.new_group([0, rank], timeout=timedelta(days=1), backend="gloo")
    store = dist.distributed_c10d._get_default_store()
    job = Dist(dist.get_rank(), world, trainers, generators, timeout, groups, store)

    def beat():  # this rank's heartbeats, until it ends or hangs (or the store's host, trainer rank 0, is gone)
        with contextlib.suppress(Exception):  # noqa: BLE001 -- a lost store: the waits say why
            while True:
                store.add(f"alive/{job.rank}", 1)
                time.sleep(HEARTBEAT_S)
    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return job


def alive(job, what, lost=""):
    """Called as a wait goes on: it ends this rank once another has been silent for --dist_timeout, never on a live
    one (docs/faults.md). Reads the store at most every HEARTBEAT_S."""
    now = job.clock.time()
    if now - job.heard.get("checked", -HEARTBEAT_S) < HEARTBEAT_S:
        return
    job.heard["checked"] = now
    for rank in (r for r in range(job.world) if r != job.rank):
        beats = counter(job, f"alive/{rank}")
        if job.heard.get(rank, (None,))[0] != beats:
            job.heard[rank] = (beats, now)
        elif now - job.heard[rank][1] > job.timeout:
            gave_up(job, what, f": {job.who(rank)} has been silent for {now - job.heard[rank][1]:.0f} s{lost}")


def local_group():
    """This process alone as a group (FSDP2 mixed precision needs one; gloo, NCCL for CUDA), or vLLM's if it has one."""
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def leave():
    """A finished torchrun rank exits at once, after the exit handlers: in the interpreter's teardown, gloo work objects
    freed after the groups can abort it (SIGABRT), and torchrun would fail the whole job."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush(), sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(0)


@contextlib.contextmanager
def waiting_for(job, what, bound=False):
    """A time-out or a lost peer in the block (a RuntimeError) ends the process: `die`; `bound` (a block that only
    waits): so does lasting past --dist_timeout, as a hung NCCL collective raises nothing (docs/torchrun.md)."""
    timer = threading.Timer(job.timeout, gave_up, (job, what))
    timer.daemon = True
    if bound:
        timer.start()
    try:
        yield
    except RuntimeError as e:
        die(f"{job.name} gave up waiting for {what}: {first_line(e)}")
    finally:
        timer.cancel()


def gave_up(job, what, why=""):
    die(f"{job.name} gave up waiting for {what}" + (why or f" after {job.timeout:.0f} s"))


def gate(job, what):
    """Trainer ranks 1.. wait here for trainer rank 0, in the job's TCPStore as long as it lives, not in a collective
    whose time-out was fixed when its group was made: rank 0 may first wait hours on the generators. Rank 0 passes."""
    job.gates += 1
    if len(job.trainers) == 1:
        return
    if job.rank == 0:
        return counter(job, "gate", 1)
    while counter(job, "gate") < job.gates:
        alive(job, what)
        job.clock.sleep(POLL_S)


def counter(job, key, add=0):
    """A job-wide integer in the TCPStore: add `add` atomically, return the new value (add=0 reads it)."""
    with waiting_for(job, f"the job's TCPStore (counter {key!r})"):
        return job.store.add(key, add)


def share(job, obj, everyone=False):
    """Trainer rank 0's `obj` (the kept groups) on every trainer rank (everyone: on every rank of the job)."""
    box, what = [obj], "rank 0's resume point" if everyone else "the next batch from trainer rank 0"
    if (job.world if everyone else len(job.trainers)) > 1:
        if not everyone:
            gate(job, what)
        with waiting_for(job, what):
            dist.broadcast_object_list(box, src=0, group=None if everyone else job.groups["trainer"])
    return box[0]


def send_groups(job, msg):
    """Generator -> trainer rank 0 on the generator's own group, pickled (ranks trust each other), each group packed."""
    msg = msg and ([(kept, pack(g)) for kept, g in msg[0]], msg[1])
    with waiting_for(job, "trainer rank 0 to take rollouts", bound=True):
        dist.send_object_list([msg], dst=0, group=job.groups[job.rank])


def pack(g):
    """A group on the wire and in trainer rank 0's inbox: Samples without their lists, the prompt once, tokens (int32),
    logprobs (fp32), versions (int32; a forced token's ~version): infra.plan.WIRE bytes a token."""
    versions = [~v if f else v for s in g for v, f in zip(s.versions, s.forced)]
    return ([replace(s, prompt_tokens=None, tokens=len(s.tokens), logprobs=None, versions=None, forced=None)
             for s in g], torch.tensor(g[0].prompt_tokens, dtype=torch.int32),
            torch.tensor([t for s in g for t in s.tokens], dtype=torch.int32),
            torch.tensor([x for s in g for x in s.logprobs], dtype=torch.float32),
            torch.tensor(versions, dtype=torch.int32))


def unpack(packed):
    """pack's group as Samples with lists again (the trainer's batch: trainer.rollout_tensors)."""
    shells, prompt, tokens, logprobs, versions = packed
    out, end = [], 0
    for s in shells:
        i, end = end, end + s.tokens
        v = versions[i:end]
        out.append(replace(s, prompt_tokens=prompt.tolist(), tokens=tokens[i:end].tolist(),
                           logprobs=logprobs[i:end].tolist(), versions=torch.where(v < 0, ~v, v).tolist(),
                           forced=(v < 0).tolist()))
    return out


def buckets(named, limit):
    """Runs of (name, tensor, dtype) of one dtype, about `limit` bytes each in that dtype, alike on trainer rank 0 and
    on every generator rank. A bucket passes `limit` by at most the rest of a decoder layer (vLLM loads whole ones)."""
    run, size = [], 0
    for name, t, dtype in named:
        nbytes = t.numel() * dtype.itemsize
        # a decoder layer: model.layers.3.mlp.up_proj.weight -> model.layers.3 (model.norm.weight: itself)
        if run and (dtype != run[0][2] or size + nbytes > limit and name.split(".")[:3] != run[-1][0].split(".")[:3]):
            yield run
            run, size = [], 0
        run.append((name, t, dtype))
        size += nbytes
    if run:
        yield run


def new_bucket(run, device, bufs, i=0, fill=False):
    """A flat tensor for bucket `run` in reused byte buffer bufs[i] (grown as needed: bench/weight_sync.py), and its
    view of each tensor; `fill`: with a copy of `run`'s tensors (copy_ casts without torch.cat's temporary)."""
    numel, dtype, device = sum(t.numel() for _, t, _ in run), run[0][2], torch.empty(0, device=device).device
    if bufs.get(i) is None or bufs[i].numel() < numel * dtype.itemsize or bufs[i].device != device:
        bufs[i] = None  # the old one goes first
        bufs[i] = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=device)
    flat = bufs[i][:numel * dtype.itemsize].view(dtype)
    parts = flat.split([t.numel() for _, t, _ in run])
    for x, (_, t, _) in zip(parts, run) if fill else ():
        x.copy_(t.detach().reshape(-1))
    return flat, parts


class TrainerLink(BatchSource):
    """The trainer ranks' batch source under torchrun. Trainer rank 0 receives scored groups on a thread per generator
    (never waiting for a train step), shares the kept ones with every trainer rank, and publishes weights."""
    def __init__(self, job, *, k, batch_prompts, bucket_bytes):
        super().__init__(k, batch_prompts)
        self.job, self.bucket_bytes = job, bucket_bytes
        self.inbox, self.pending, self.bufs = queue.Queue(), None, {}
        # group id -> kept by the zero-variance filter; generator rank -> its info(); version -> its eval's log row
        self.kept, self.info, self.asked = {}, {}, {}
        # a receiver per generator on its process group (a virtual job, runs/rehearse.py, has none: it fills the inbox)
        self.threads = [threading.Thread(target=self._receive, args=(rank,), daemon=True)
                        for rank in (job.generators if job.rank == 0 and job.groups else [])]
        for t in self.threads:
            t.start()

    def _receive(self, src):
        """send_groups' other end: no time-out of its own (next_batch's); a dead generator makes it raise at once."""
        box = [None]
        try:
            while True:
                dist.recv_object_list(box, src=src, group=self.job.groups[src])
                if box[0] is None:
                    return
                self.info[src] = box[0][1]
                for kept, g in box[0][0]:  # packed (pack) until the batch takes it
                    self.kept[g[0][0].group] = kept
                    self.inbox.put(g)
        except Exception as e:  # noqa: BLE001 -- whatever it is, the main thread must hear of it and stop
            self.inbox.put(f"rollouts from generator rank {src}: {first_line(e)}")

    def next_batch(self):
        groups = self._collect(self.B if self.job.rank == 0 else 0, self._next_received)
        kept = [g for g in groups if self.kept.pop(g[0].group)]
        if len(self.job.trainers) > 1:  # packed to the other trainer ranks; rank 0 keeps its own Samples
            shared = share(self.job, [pack(g) for g in kept])
            kept = kept if self.job.rank == 0 else [unpack(g) for g in shared]
        return self._batch(groups, kept)

    def _next_received(self, missing):
        while True:
            with contextlib.suppress(queue.Empty):
                g = self.inbox.get(timeout=HEARTBEAT_S)
                break
            alive(self.job, f"rollouts from generator ranks {self.job.generators}")
        if isinstance(g, str):
            die(f"{self.job.name} lost {g}")
        return unpack(g)

    def _dropped(self):
        counter(self.job, "dropped", 1)

    def push_weights(self, policy, publish=True):
        """Trainer rank 0 broadcasts `policy.weights()`, gathered by every trainer rank; none once a stop is read."""
        self.version += 1
        if not publish:
            return
        if self.job.rank != 0:
            collections.deque(policy.weights(), maxlen=0)  # its part of the gathers
            return
        counter(self.job, "version", 1)
        for i, run in enumerate(buckets(policy.weights(), self.bucket_bytes)):
            # a copy, never the live parameters (the next step changes them), into the buffer broadcast i - 2 left
            flat, _ = new_bucket(run, run[0][1].device, self.bufs, i % 2, fill=True)
            self._land()
            self.pending = dist.broadcast(flat, src=0, group=self.job.groups["weights"], async_op=True)
        self._land()  # sync_s ends once every generator holds the weights, not when the last broadcast is queued

    def _land(self):
        if self.pending is not None:
            with waiting_for(self.job, f"generator ranks {self.job.generators} to take the weights", bound=True):
                self.pending.wait(timedelta(seconds=self.job.timeout + 30))  # NCCL: the host waits on the device
            self.pending = None

    def ask_eval(self, version, row):
        self.asked[version] = row
        with waiting_for(self.job, "the job's TCPStore (held-out request)"):
            self.job.store.set(f"eval/{version}", "")

    def evals(self, until=0):
        """Trainer rank 0: [(row, results, (first, last) version of their tokens)] of the complete evaluations in order,
        those before `until` waited for while every rank lives (docs/torchrun.md)."""
        out = []
        for v in sorted(self.asked):
            keys = [f"eval/{v}/{rank}" for rank in self.job.generators]
            if not (v < until or self.job.store.check(keys)):
                break
            # what a wait that ends the run loses: the rows asked and not logged (--resume names them again)
            lost = f"; held-out rows lost: steps {sorted(row['step'] for row in self.asked.values())} (the last " \
                "checkpoint keeps the training before it: --resume)"
            while not self.job.store.check(keys):
                alive(self.job, f"the held-out pass rate of policy version {v} from generator ranks "
                      f"{self.job.generators}", lost)
                self.job.clock.sleep(POLL_S)
            parts = [json.loads(self.job.store.get(key)) for key in keys]
            versions = [x for p in parts for x in p["versions"] or ()] or [v]
            out.append((self.asked.pop(v), [r for p in parts for r in p["results"]], (min(versions), max(versions))))
            for key in keys + [f"eval/{v}"]:
                self.job.store.delete_key(key)
        return out

    def totals(self):
        """Generation so far over all generator ranks: the furthest epoch, sums of the rest."""
        infos = list(self.info.values())  # a copy: the receiver threads add to it
        total = {key: sum(x[key] for x in infos) for key in ("npr_removed", "reward_errors", "bad_prompts")}
        total["epoch"] = max((x["epoch"] for x in infos), default=0)
        return dict(tokens=counter(self.job, "gen_tokens"), gen_s=counter(self.job, "gen_us") / 1e6,
                    **{key: counter(self.job, key) for key in RESUBMITS}, **total)

    def close(self):
        """The end of the run (the last broadcast has landed): generators stop, their receivers with them."""
        if self.job.rank == 0:
            counter(self.job, "stop", 2)
            for rank, thread in zip(self.job.generators, self.threads):
                thread.join(self.job.timeout)
                if thread.is_alive():
                    gave_up(self.job, f"generator rank {rank} to stop")


def receive_weights(job, engine, version, bucket_bytes, take=True, bufs=None):
    """A generator rank's end of TrainerLink.push_weights (`take` False: received, not loaded): each bucket into the
    engine's `landing` (`staged`, vLLM's: loaded as each lands, one reload a version), a skipped PyTorch one: `bufs`."""
    staged, bufs = getattr(engine, "staged", False), {} if bufs is None else bufs

    def landed():
        for run in buckets(((n, p, p.dtype) for n, p in engine.model.named_parameters()), bucket_bytes):
            flat = engine.landing(run) if take or staged else new_bucket(run, engine.device, bufs)[0]
            with waiting_for(job, f"policy version {version} from trainer rank 0", bound=True):
                # a time-out of its own, so the host waits for the device; past --dist_timeout the bound speaks first
                dist.broadcast(flat, src=0, group=job.groups["weights"], async_op=True).wait(
                    timedelta(seconds=job.timeout + 30))
            yield run
    if take and staged:
        engine.load_weights(landed(), version)
    else:
        collections.deque(landed(), maxlen=0)
        engine.version = version if take else engine.version


class HeldOut:
    """A generator rank's held-out evaluations, interleaved with its rollouts within `cap` completions at once
    (--eval_share of the slots; all once training is over): docs/torchrun.md."""
    def __init__(self, rollouts, templates, n, cap):
        self.rollouts, self.templates, self.n, self.cap = rollouts, templates, n, max(n, cap)
        # (v, template) to start; group -> v; v -> its finished groups; the versions asked
        self.todo, self.running, self.done, self.asked = [], {}, {}, set()

    def ask(self, v):
        """Queue version v's held-out groups, with group ids of their own (evaluations may overlap)."""
        first = -1 - len(self.asked) * len(self.templates)
        self.todo += [(v, replace(t, group=first - i)) for i, t in enumerate(self.templates)]
        self.done[v] = []
        self.asked.add(v)

    @property
    def reserve(self):
        """Room training admission leaves free: a held-out group's, while one waits to start within its share."""
        return self.n if self.todo and (len(self.running) + 1) * self.n <= self.cap else 0

    def start(self, engine, everything=False):
        while self.todo and engine.room >= self.n and (everything or self.reserve):
            v, t = self.todo.pop(0)
            self.running[t.group] = v
            engine.add(t, self.n)

    def take(self, finished):
        """[(None, the training groups among `finished`)] if any, then [(v, its groups)] of evaluations now complete."""
        train = []
        for g in finished:
            v = self.running.pop(g[0].group, None)
            train.append(g) if v is None else self.done[v].append(g)
        complete = [v for v, gs in self.done.items() if len(gs) == len(self.templates)]
        return ([(None, train)] if train else []) + [(v, self.done.pop(v)) for v in complete]

    def score(self, groups):
        """Runs on the scoring thread: the evaluation's results (pipeline_rl.evaluate's) and its tokens' versions."""
        self.rollouts.score(groups)
        versions = [x for g in groups for s in g for x in s.versions]
        return dict(results=[(s.meta.task, s.reward > 0, len(s.tokens)) for g in groups for s in g],
                    versions=(min(versions), max(versions)) if versions else None)


def admit(job, rollouts, held_out, next_group, *, mode, k, batch_prompts, group_size, dropped, stop):
    """A generator's starts for one turn: held-out groups within their share (every slot once `stop` is 1), then
    training groups under the lag bound while more room than the next held-out group's is free (else a slot-bound
    engine never frees it). Returns the group id taken from the job's counter but not started, or None."""
    engine = rollouts.engine
    held_out.start(engine, everything=stop > 0)
    while engine.room > held_out.reserve and not stop:
        if next_group is None:
            next_group = counter(job, "admitted", 1) - 1
        if next_group >= admission_limit(mode, engine.version, k, batch_prompts, dropped):
            break  # past the lag bound: it starts once newer weights arrive
        engine.add(rollouts.next_template(next_group), group_size)
        next_group = None
    return next_group


def run_generator(job, rollouts, *, mode, k, batch_prompts, group_size, state_path, save_every, bucket_bytes,
                  held_out, send=send_groups, receive=receive_weights, scorer=None):
    """A generator rank until trainer rank 0 says stop. Each turn: take the published weights, note the versions asked
    for evaluation (`held_out`), send the scored groups and held-out results, start groups (`admit`), one engine step.
    Stop 1: training is over, evaluations take every slot; 2: stop.
    What it takes of the world, real by default, is what runs/rehearse.py replaces to run this same loop in virtual
    time: `job.clock` (time(), sleep(s)); `job.store` (the TCPStore's add, check, set, get, delete_key; every rank's
    heartbeat count add(f"alive/{rank}", 0) moves while it lives); `send(job, msg)` and `receive(job, engine,
    version, bucket_bytes, take, bufs)`; `scorer` (submit(fn, arg) -> a future: done(), result()); `rollouts`
    (engine, next_template(i), score, keep, info, state_dict) and its engine (add(template, n), step() -> finished
    groups, room, busy, version, stats["tokens"], and what `receive` loads: load_weights)."""
    engine, bufs = rollouts.engine, {}  # bufs: the reused receive buffer (vLLM)
    # [(future, groups, None) or (future, groups, evaluated version)] in finishing order
    scorer, scoring = scorer or ThreadPoolExecutor(1, thread_name_prefix="score"), []
    # a resumed run starts at the checkpoint's version; next_group: taken from the counter, not started yet
    received, saved, next_group, clock = engine.version, None, None, job.clock
    # the TCPStore is read, and this rank's counts added to it, every POLL_S, not every engine step (docs/torchrun.md)
    polled, stop, dropped, counts, sent = float("-inf"), 0, 0, dict(gen_us=0, gen_tokens=0), {}
    while True:
        if clock.time() - polled >= POLL_S:
            polled = clock.time()
            # and what the vLLM engine's resubmission counts grew by since the last poll, where they did
            grown = {k: engine.stats[k] - sent.get(k, 0) for k in RESUBMITS if engine.stats.get(k, 0) > sent.get(k, 0)}
            for key, n in {**counts, **grown}.items():
                counter(job, key, n)
            counts, sent = dict.fromkeys(counts, 0), dict(engine.stats)
            stop = counter(job, "stop")  # before the version: every broadcast published before the stop is received
            dropped = counter(job, "dropped")
            # the last version received, then the new ones, each noted for evaluation if trainer rank 0 asked
            for v in range(received, counter(job, "version") + 1):
                if v > received:
                    receive(job, engine, v, bucket_bytes, take=mode == "pipeline" or v % k == 0, bufs=bufs)
                if v not in held_out.asked and job.store.check([f"eval/{v}"]):
                    held_out.ask(v)
            received = v
        if received != saved and received % save_every == 0:
            tmp = state_path + ".tmp"
            try:  # into --out_dir, which every rank was seen to share at start
                torch.save(dict(rollouts.state_dict(), version=received), tmp)
                os.replace(tmp, state_path)
            except (OSError, RuntimeError) as e:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                free = shutil.disk_usage(os.path.dirname(os.path.abspath(state_path))).free
                die(f"{job.name} cannot write {state_path} ({first_line(e)}; {free / 1e6:.1f} MB free); free space "
                    "or fix its permissions, then --resume")
            saved = received
        while scoring and (stop > 1 or scoring[0][0].done()):
            future, groups, v = scoring.pop(0)
            if v is not None:
                with waiting_for(job, "the job's TCPStore (held-out results)"):
                    job.store.set(f"eval/{v}/{job.rank}", json.dumps(future.result()))
                continue
            future.result()
            for s in (s for g in groups for s in g):
                s.meta = None  # the trainer needs tokens, logprobs, versions and rewards, not the problem
            send(job, ([(rollouts.keep(g), g) for g in groups], rollouts.info()))
        if stop > 1:
            break
        next_group = admit(job, rollouts, held_out, next_group, mode=mode, k=k, batch_prompts=batch_prompts,
                           group_size=group_size, dropped=dropped, stop=stop)
        finished, t, n = [], clock.time(), engine.stats["tokens"]
        if engine.busy:
            finished = engine.step()
            counts["gen_us"] += int((clock.time() - t) * 1e6)
            counts["gen_tokens"] += engine.stats["tokens"] - n
        else:  # at the lag bound, or training is over
            alive(job, "trainer rank 0's stop" if stop else f"policy version {received + 1} from trainer rank 0")
            clock.sleep(0.002)
        scoring += [(scorer.submit(rollouts.score if v is None else held_out.score, groups), groups, v)
                    for v, groups in held_out.take(finished)]
    send(job, None)  # trainer rank 0's receiver for this rank stops


def shard(policy, layers, group, body_dtype=torch.float32):
    """FSDP2 over `group`: each of `layers` a unit, the untied head a unit, the rest (embeddings, norm) the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(group, next(policy.parameters()).device.type)
    head = [] if policy.tied else [policy.head]
    for m in [*layers, *head, policy]:
        mp = MixedPrecisionPolicy(policy.head.dtype if m in head else body_dtype, torch.float32)
        # the root reaches an untied head through lm.lm_head too: its parameters (sharded by now) are the head's unit's
        ignored = {p for h in head for p in h.parameters()} if m is policy else None
        fully_shard(m, mesh=mesh, mp_policy=mp, ignored_params=ignored)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no average or pre-scaled sum
    return policy


def full_state_dict(module):
    """Full (unsharded) fp32 weights; under FSDP2 every trainer rank must call it (one all-gather per tensor)."""
    from torch.distributed.tensor import DTensor
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def sharded(policy):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(policy, FSDPModule)


class TrainerComm:
    """What train_step and the loop need of the other trainer ranks: this rank's share of the batch, metrics reduced
    over the ranks, rank 0's stop signal, a time-out on the gradients' collectives. One trainer rank: no-ops."""
    def __init__(self, job):
        self.job, self.rank, self.size = job, job.trainers.index(job.rank), len(job.trainers)

    def guard(self, what):
        one = contextlib.nullcontext()
        return one if self.size == 1 else waiting_for(self.job, f"{what} of trainer ranks {self.job.trainers}")

    def reduce(self, sums, maxes):
        if self.size == 1:
            return sums, maxes
        s, m = (torch.tensor(list(x.values()), dtype=torch.float64) for x in (sums, maxes))
        with self.guard("metrics"):
            dist.all_reduce(s, group=self.job.groups["trainer"])
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.job.groups["trainer"])
        return dict(zip(sums, s.tolist())), dict(zip(maxes, m.tolist()))

    def share(self, obj):
        return share(self.job, obj)
