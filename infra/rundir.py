"""infra/rundir.py: the run directory, out/<run>/, kept by trainer rank 0 (checkpoint shards by every trainer rank).

What it guarantees:
- One live run per directory: an exclusive lock (out_dir/.lock, holding the pid), taken before anything is written,
  released by the OS however the process ends.
- Every file is replaced atomically (written beside, then renamed): a kill at any moment leaves the last good
  ckpt.pt, config.json, hf/ or shards-<step>/ in place. Under torchrun ckpt.pt is written last and names a complete
  set of shards; older shards are removed after it.
- A write that fails for lack of space or permission ends the run with one line naming the path, the bytes needed
  and what is free; what was written before stays intact, so --resume continues once it is fixed.
- metrics.jsonl is append-only, one unbuffered write per row; a resumed run cuts it back to its checkpoint's step
  (a torn last line from a kill is dropped), so the log continues seamlessly. config.json holds the options,
  versions, git hash, ranks and a history entry per start or resume.
- A checkpoint that is unreadable, foreign, or does not fit the run's options ends the run with one line.
- SIGTERM/SIGUSR1 (what schedulers send before a kill) make the run finish its step, checkpoint and exit resumable.
"""
import contextlib
from dataclasses import asdict
import errno
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

from infra import dist, fail, first_line, print0
from infra.sandbox import sandbox_description


def lock_run_dir(out_dir):
    """One live run per run directory: an exclusive flock on out_dir/.lock (holding the pid), taken before anything
    is written and held while the process lives; the OS releases it when the process ends, killed or not."""
    if os.path.realpath(out_dir) in HELD:  # this process holds it already (a run started again in-process)
        return
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(os.path.join(out_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        for _ in range(40):  # the holder writes its pid just after it takes the lock
            if holder := os.pread(fd, 32, 0).decode(errors="replace").strip():
                break
            time.sleep(0.05)
        fail(f"run directory {out_dir} is in use by a live run (pid {holder}); wait for it or stop it, or pick another "
             "--out_dir")
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    HELD[os.path.realpath(out_dir)] = fd


HELD = {}  # run directory -> descriptor of this process's lock on it (kept open: closing it releases the lock)


def write_failed(path, error, nbytes=0):
    """A write of the run that failed: for lack of space or permission, one line naming the path, the bytes needed and
    what is free (whatever was written before stays intact: --resume once it is fixed); anything else is raised."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    code = getattr(error, "errno", None)
    if isinstance(error, PermissionError) or code in (errno.EACCES, errno.EROFS):
        fail(f"cannot write {path}: permission denied; make {os.path.dirname(path) or '.'} writable, then --resume")
    if code not in (errno.ENOSPC, errno.EDQUOT) and free >= nbytes + (1 << 20):
        raise error
    fail(f"cannot write {path}: no space left on the device ({nbytes / 1e6:.1f} MB needed, {free / 1e6:.1f} MB free); "
         "free some space, then --resume (the last checkpoint and the logged rows are intact)")


def write_atomic(path, write, nbytes=0):
    """`write(tmp)`, then tmp renamed over `path`: the previous file (or directory) stays valid until the new one is
    complete; a failed write leaves no temporary behind. torch.save reports a full disk as a RuntimeError."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        if os.path.isdir(tmp):
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        write_failed(path, e, nbytes)


def text_writer(text):
    """A `write` for write_atomic that puts `text` in the file (closed inside: a full disk shows at the flush)."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    return write


def tensor_bytes(obj):
    """Bytes of the tensors in a nest of dicts and lists: what saving it needs, roughly."""
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return obj.nbytes if torch.is_tensor(obj) else 0


def export_hf(cfg, model, tok, weights):
    """The policy as a Hugging Face model directory, out_dir/hf: safetensors weights in the body dtype, config and
    tokenizer (chat template included), for `from_pretrained` and vLLM. Written beside the old one, then swapped in."""
    from transformers.utils import logging
    logging.disable_progress_bar()
    weights = {k: v.to(getattr(torch, cfg.dtype)) for k, v in weights.items()}
    path = os.path.join(cfg.out_dir, "hf")
    write_atomic(path, lambda tmp: (model.save_pretrained(tmp, state_dict=weights), tok.save_pretrained(tmp)),
                 tensor_bytes(weights))
    return path


class Preemption:
    """SIGTERM and SIGUSR1 (what SLURM, Kubernetes and preemptible clouds send before a kill; SLURM with --signal):
    `signal` is set, and the run finishes its step, writes a checkpoint and exits resumable. A second one exits at
    once. Generator ranks keep generating until the trainer ends the job."""
    def __init__(self):
        self.signal = None
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        if self.signal is not None:
            os._exit(128 + signum)
        self.signal = signal.Signals(signum).name
        print0(f"{self.signal}: the run stops after this step with a checkpoint (send it again to stop at once)",
               flush=True)


def load_checkpoint(path, want=("step", "device_hours", "version", "stale", "torch_rng")):
    """A checkpoint's contents, to the CPU (plain tensors and containers only); a one-line exit if it is unreadable,
    foreign, or names shards that are not there."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated, garbage or unsafe pickles all mean: not usable
        fail(f"checkpoint {path} is unreadable ({type(e).__name__}); restore a good copy or start a fresh --out_dir")
    missing = sorted(set(want) - set(ckpt)) if isinstance(ckpt, dict) else "everything"
    if not missing and "step" in want and "model" not in ckpt and "shards" not in ckpt:
        missing = ["model"]
    if missing:
        fail(f"{path} is not a scalerl checkpoint (missing {missing}); start a fresh --out_dir")
    shards = os.path.join(os.path.dirname(path), ckpt.get("shards", ""))
    if "shards" in ckpt and not os.path.exists(os.path.join(shards, ".metadata")):
        fail(f"checkpoint {path} names {shards}, which is missing or incomplete; restore it or start a fresh --out_dir")
    return ckpt


@contextlib.contextmanager
def fits(path):
    """Restoring from the checkpoint at `path`: state that does not fit this run ends it with one line."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        fail(f"checkpoint {path} does not fit this run ({' '.join(str(e).split())[:240]}); resume with the options "
             "it was written with (config.json) or start a fresh --out_dir")


def save_checkpoint(cfg, step, clock, source, job, policy, opt):
    """Everything --resume needs from the trainer; every trainer rank calls it. In one process: one file, ckpt.pt,
    with the fp32 weights, the optimizer state and the generating side. Under torchrun: each trainer rank writes its
    shard into shards-<step>/ (`save_shards`), then trainer rank 0 writes ckpt.pt, the marker that names them, and
    removes older shards; a kill at any point leaves ckpt.pt naming a complete set. (Generator ranks keep their own
    state, generator<rank>.pt.)"""
    ckpt = dict(step=step, version=source.version, stale=source.dropped_stale, torch_rng=torch.get_rng_state(),
                world=job.world, generators=job.generators, **clock)
    if job.world == 1:
        opt_state = opt.state_dict()
        # FSDP2 over one process: plain tensors, for a file any run can read
        if dist.sharded(policy) and opt.state:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
            opt_state = get_optimizer_state_dict(policy, opt, options=StateDictOptions(full_state_dict=True))
        ckpt.update(model=dist.full_state_dict(policy.lm), opt=opt_state, generating=source.rollouts.state_dict())
    else:
        ckpt["shards"], ckpt["shards_opt"] = f"shards-{step:06d}", bool(opt.state)
        save_shards(job, policy, opt, os.path.join(cfg.out_dir, ckpt["shards"]))
        if job.rank != 0:
            return
    write_atomic(os.path.join(cfg.out_dir, "ckpt.pt"), lambda tmp: torch.save(ckpt, tmp), tensor_bytes(ckpt))
    # shards no checkpoint names any more
    for old in os.listdir(cfg.out_dir):
        if old.startswith("shards-") and old != ckpt.get("shards"):
            shutil.rmtree(os.path.join(cfg.out_dir, old), ignore_errors=True)


def sharded_state(policy, opt, with_opt):
    """{"model": ..., "opt": ...} of DTensor shards for torch.distributed.checkpoint; "opt" only once AdamW has state
    (reading the state of a fresh optimizer would initialise it with a step of zero gradients, counted by Adam)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if not with_opt:
        return dict(model=get_model_state_dict(policy.lm))
    return dict(zip(("model", "opt"), get_state_dict(policy.lm, opt)))


def save_shards(job, policy, opt, where):
    """Under torchrun, every trainer rank: its shard of the fp32 weights and the optimizer state, written with
    torch.distributed.checkpoint into the directory `where` (nothing is gathered)."""
    import torch.distributed.checkpoint as dcp
    try:
        with dist.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
            dcp.save(sharded_state(policy, opt, bool(opt.state)), checkpoint_id=where,
                     process_group=job.groups["trainer"])
    except (OSError, dcp.api.CheckpointException) as e:  # a full disk on any rank fails the save on every rank
        write_failed(where, e if isinstance(e, OSError) else OSError(errno.EIO, first_line(e)))


def load_shards(job, policy, opt, where, with_opt):
    """The inverse, on every trainer rank: each reads its own shard (the same number of trainer ranks); the optimizer
    state if the checkpoint has one (the step-0 checkpoint has none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    state = sharded_state(policy, opt, with_opt)
    with dist.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
        dcp.load(state, checkpoint_id=where, process_group=job.groups["trainer"])
    if with_opt:
        set_state_dict(policy.lm, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
    else:
        set_model_state_dict(policy.lm, state["model"])


def load_optimizer(policy, opt, state):
    """One process: ckpt.pt's optimizer state into `opt` (under FSDP2 from plain tensors; an empty state stays
    empty, or it would be initialised with a zero step)."""
    if dist.sharded(policy) and state["state"]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(policy, opt, state, options=StateDictOptions(full_state_dict=True))
    elif not dist.sharded(policy):
        opt.load_state_dict(state)


def load_weights(model, ckpt, out_dir):
    """A checkpoint's fp32 weights into an unsharded `model`, in one process: from ckpt.pt, or read in full from the
    shards a torchrun job wrote (torch.distributed.checkpoint reshards on load), to the CPU."""
    path = os.path.join(out_dir, "ckpt.pt")
    with fits(path):
        if "model" in ckpt:
            return model.load_state_dict(ckpt["model"])
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        state = get_model_state_dict(model)
        dcp.load(dict(model=state), checkpoint_id=os.path.join(out_dir, ckpt["shards"]), no_dist=True)
        set_model_state_dict(model, state)


def read_metrics(path, upto_step):
    """Rows of an existing log up to `upto_step` (a torn last line from a kill mid-write is dropped)."""
    rows = []
    if os.path.exists(path):
        for line in open(path):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if row["step"] <= upto_step:
                rows.append(row)
    return rows


def open_log(cfg, job, step, n_params, tok):
    """The run's record: config.json (the options, versions, git hash, ranks, and a history entry per start or
    resume) and metrics.jsonl, cut back to `step` (rows logged after the checkpoint are dropped, so a resumed log
    continues seamlessly); returns a row writer (which also feeds --tracker). Takes the run directory's lock first."""
    lock_run_dir(cfg.out_dir)
    if not cfg.resume and os.path.exists(os.path.join(cfg.out_dir, "ckpt.pt")):  # a run started beside this one
        fail(f"run directory {cfg.out_dir} already holds a run; pass --resume to continue it or pick another --out_dir")
    path, meta_path = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "config.json")
    rows = read_metrics(path, step) if cfg.resume else []  # a fresh start over a failed one starts a fresh log
    text = "".join(json.dumps(r) + "\n" for r in rows)
    write_atomic(path, text_writer(text), len(text))
    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    transformers=__import__("transformers").__version__)
    if cfg.engine == "vllm":
        versions["vllm"] = __import__("vllm").__version__
    git = None
    with contextlib.suppress(Exception):  # no git is fine: the hash is informational
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    history = []
    if cfg.resume:
        with contextlib.suppress(OSError, ValueError, KeyError):
            history = json.load(open(meta_path))["history"]
    history.append(dict(step=step, time=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:], git=git))
    meta = dict(config=asdict(cfg), versions=versions, git=git, n_params=n_params, vocab=len(tok),
                ranks=dict(trainers=job.trainers, generators=job.generators), history=history)
    write_atomic(meta_path, text_writer(json.dumps(meta, indent=1)))
    log, track = os.open(path, os.O_WRONLY | os.O_APPEND), tracker(cfg)

    def write(row):  # one unbuffered append per row: a full disk is caught at that row, not at exit
        line = (json.dumps(row) + "\n").encode()
        try:
            if os.write(log, line) < len(line):
                raise OSError(errno.ENOSPC, "a short write")
        except OSError as e:
            write_failed(path, e, len(line))
        track(row)
    return write


def tracker(cfg):
    """--tracker: every metrics row also goes to TensorBoard (out_dir/tensorboard) or Weights & Biases (project
    "scalerl", the run named after out_dir). Optional and off by default: metrics.jsonl stays the record."""
    numbers = lambda row: {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}  # noqa: E731
    if cfg.tracker == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"), flush_secs=10)

        def write(row):
            for key, value in numbers(row).items():
                writer.add_scalar(key, value, row["step"])
            writer.flush()
        return write
    if cfg.tracker == "wandb":
        import wandb
        run = wandb.init(project="scalerl", name=os.path.basename(os.path.normpath(cfg.out_dir)), config=asdict(cfg),
                         dir=cfg.out_dir, resume="allow", id=re.sub(r"\W", "-", os.path.abspath(cfg.out_dir))[-64:])
        return lambda row: run.log(numbers(row), step=row["step"])
    return lambda row: None


def metrics_row(step, clock, batch, stats, gen, gen0, dt, t_train, n_gen, source, task_of):
    """The step's line of metrics.jsonl (every key is in the README's glossary)."""
    samples = [s for g in batch.groups for s in g]
    gen_s = gen["gen_s"] - gen0["gen_s"]  # seconds spent generating during the step (all generator ranks)
    row = dict(step=step, **clock, policy_version=source.version, reward=float(np.mean([s.reward for s in samples])),
               loss=stats["loss"], clip_frac=stats["clip_frac"], ratio_mean=stats["ratio_mean"],
               ratio_max=stats["ratio_max"], mismatch_kl=stats["mismatch_kl"], lag_mean=batch.lag_mean,
               lag_max=batch.lag_max, mixed_version_frac=float(np.mean([len(set(s.versions)) > 1 for s in samples])),
               dropped_stale=source.dropped_stale,
               trunc_rate=float(np.mean([s.interrupted or s.truncated for s in samples])),
               zero_var_frac=1 - len(batch.kept) / len(batch.groups), npr_removed=gen["npr_removed"],
               epoch=gen["epoch"], gen_tok_s=(gen["tokens"] - gen0["tokens"]) / max(gen_s, 1e-9),
               gen_busy=gen_s / (dt * n_gen), train_tok_s=stats["n_tokens"] / max(t_train, 1e-9),
               train_busy=t_train / dt, train_tokens=stats["n_tokens"], lr=stats["lr"], dt=dt, sync_s=stats["sync_s"],
               skipped_nonfinite=int(not stats["finite"]), reward_errors=gen["reward_errors"],
               bad_prompts=gen["bad_prompts"])
    for t in dict.fromkeys(task_of.values()):  # with several tasks: the mean reward of each task's completions
        mine = [s.reward for s in samples if task_of[s.prompt_id] == t]
        if mine:
            row[f"reward_{t}"] = float(np.mean(mine))
    return row


def per_task(row, key, tasks):
    """" (arith 0.812, code 0.406)" from the row's <key>_<task> entries; "" with one task."""
    parts = [f"{t} {row[f'{key}_{t}']:.3f}" for t in tasks if f"{key}_{t}" in row]
    return f" ({', '.join(parts)})" if parts else ""


def progress_line(row, max_steps, eta, tasks):
    """One line per step: reward, loss, clipping, mismatch, lag, truncation, zero-variance share, speeds, time."""
    return (f"step {row['step']:4d}/{max_steps} | reward {row['reward']:+.3f}{per_task(row, 'reward', tasks)} | loss "
            f"{row['loss']:+.4f} | clip {row['clip_frac']:.3f} | kl {row['mismatch_kl']:+.1e} | lag "
            f"{row['lag_mean']:.1f}/{row['lag_max']} | trunc {row['trunc_rate']:.2f} | zv {row['zero_var_frac']:.2f} | "
            f"gen {row['gen_tok_s']:.0f} tok/s | train {row['train_tok_s']:.0f} tok/s | {row['dt']:.2f}s | eta "
            f"{eta / 60:.1f}m")


NO_SIGNAL_STEPS = 5  # steps in a row without a group to learn from before the run says so


def no_signal(row, cfg):
    """The warning for a run that learns nothing: every group of the last NO_SIGNAL_STEPS steps had equal rewards."""
    if row["trunc_rate"] > 0.5:
        why = (f"{row['trunc_rate']:.0%} of completions hit the length budget (--think_max={cfg.think_max}, "
               f"--answer_budget={cfg.answer_budget}): raise them, or check that the model closes its thinking")
    elif row["reward"] < 0:
        why = ("every completion failed: check that the model writes its answer after </think> in the form the task's "
               "checker reads (data.reward), and the dataset's answers (--answer_key)")
    else:
        why = "every completion passed: the prompts are too easy for this model; pick a harder --task"
    return f"warning: no learning signal for {NO_SIGNAL_STEPS} steps (every group zero-variance): {why}"


def describe(cfg, job, n_params, n_train, n_val, tasks=()):
    """The numbers that matter, printed at start-up."""
    B, G, k = cfg.batch_prompts, cfg.group_size, cfg.max_lag
    print(f"scalerl | {cfg.model} {n_params / 1e6:.2f}M params, body {cfg.dtype}, head "
          f"{'fp32' if cfg.fp32_head else cfg.dtype} | {cfg.task}: {n_train} train / {n_val} held-out prompts\n"
          f"  {B} prompts x {G} completions = {B * G} per step | {cfg.max_steps} steps | think {cfg.think_min}-"
          f"{cfg.think_max} + answer {cfg.answer_budget} tokens | interruption {'on' if cfg.interrupt else 'off'}\n"
          f"  {cfg.loss} loss, {cfg.agg} aggregation, {cfg.adv_norm} adv norm, zero-var filter {cfg.zero_var_filter}, "
          f"NPR {cfg.npr} | {'PipelineRL' if cfg.off_policy == 'pipeline' else 'PPO-off-policy'}-{k}, "
          f"{cfg.decode_per_step} decode steps per train step | engine {cfg.engine}, {cfg.slots} slots")
    # which protections the code sandbox has on this machine (Landlock, namespaces, uids)
    if "code" in tasks:
        print(f"  code sandbox: {sandbox_description()}")
    if job.world > 1:
        fsdp = " (FSDP2)" if len(job.trainers) > 1 else ""
        print(f"  torchrun: {job.world} ranks | trainer ranks {job.trainers}{fsdp} | "
              f"generator ranks {job.generators} | device-hours = wall time x {job.world}")


class Log:
    """The loop's record: timers and the compute clock on every trainer rank; on trainer rank 0 also config.json,
    metrics.jsonl (and --tracker), one progress line per step, the no-signal warning and the end-of-run summary.
    Other ranks make the same calls and write nothing."""
    def __init__(self, cfg, job):
        self.cfg, self.job, self.t_start, self.timers = cfg, job, time.time(), {}
        # seconds, for the summary at the end
        self.took = dict(warm_start=0.0, training=0.0, evaluation=0.0)
        self.write, self.tasks = (lambda row: None), ()

    @contextlib.contextmanager
    def timer(self, key):
        t = time.time()
        yield
        self.timers[key] = time.time() - t
        if key in self.took:
            self.took[key] += self.timers[key]

    def open(self, step, clock, model, tok, train, val, tasks):
        """The run's files and the start-up summary (trainer rank 0); the loop's clocks start."""
        self.clock, self.tasks, self.idle = clock, tasks, 0
        # with several tasks, each task's reward is logged too
        self.task_of = {p.id: p.task for p in train} if len(tasks) > 1 else {}
        n_params = sum(p.numel() for p in model.parameters())
        if self.job.rank == 0:
            self.write = open_log(self.cfg, self.job, step, n_params, tok)
            describe(self.cfg, self.job, n_params, len(train), len(val), tasks)
        self.t_loop, self.first, self.eval_0 = time.time(), step, self.took["evaluation"]

    def begin(self, source):
        """A step starts: its clocks, and the generation counters before it."""
        self.t0, self.c0, self.gen0 = time.time(), time.process_time(), source.totals()

    def step(self, step, batch, stats, source, bad_run):
        """The step's metrics row logged (rank 0), the clock advanced; returns its progress line ("" elsewhere)."""
        dt = time.time() - self.t0
        # the compute axis counts every device; CPU time of this process is immune to a busy machine
        self.clock["device_hours"] += dt * self.job.world / 3600
        self.clock["cpu_hours"] += (time.process_time() - self.c0) / 3600
        self.took["training"] += self.timers["train_s"]
        if self.job.rank != 0:
            return ""
        stats = dict(stats, sync_s=self.timers["sync_s"])
        row = metrics_row(step, self.clock, batch, stats, source.totals(), self.gen0, dt, self.timers["train_s"],
                          max(len(self.job.generators), 1), source, self.task_of)
        self.write(row)
        # no group with a learning signal
        self.idle = self.idle + 1 if row["zero_var_frac"] == 1 else 0
        if self.idle == NO_SIGNAL_STEPS:
            print(no_signal(row, self.cfg), flush=True)
        spent = time.time() - self.t_loop - self.took["evaluation"] + self.eval_0
        line = progress_line(row, self.cfg.max_steps, spent / (step - self.first) * (self.cfg.max_steps - step),
                             self.tasks)
        if not stats["finite"]:
            line += f" | non-finite loss or gradients: step skipped ({bad_run} in a row)"
        return line

    def summary(self):
        """Where the run's time went."""
        took, total = self.took, time.time() - self.t_start
        rest = total - sum(took.values())
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in took.items())
        print(f"done in {total / 60:.1f} min ({parts}, start-up, scoring, logging and checkpoints {rest:.0f}s); "
              f"run directory {self.cfg.out_dir}")
