"""infra/rundir.py: the run directory, out/<run>/, kept by trainer rank 0 (checkpoint shards by every trainer rank).

What it guarantees:
- One live run per directory: an exclusive lock (out_dir/.lock, holding the pid) taken before anything is written,
  released by the OS however the process ends.
- Files are replaced atomically (written beside, then renamed): a kill at any moment leaves the last good ckpt.pt,
  config.json, hf/ or shards-<step>/. Under torchrun ckpt.pt is written last, naming a complete set of shards.
- A write failing for lack of space or permission ends the run with one line (the path, the bytes needed, what is
  free); what was written before stays intact, so --resume continues once it is fixed.
- metrics.jsonl is append-only, one unbuffered write per row; a resume cuts it back to its checkpoint's step (and
  drops a torn last line). config.json holds options, versions, git hash, ranks and a history entry per (re)start.
- A checkpoint that is unreadable, foreign, or does not fit the run's options ends the run with one line.
- SIGTERM/SIGUSR1 (what schedulers send before a kill) make the run finish its step, checkpoint and exit resumable.
"""
import contextlib
from dataclasses import asdict
import errno
import fcntl
import json
import os
import pathlib
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

# run directory -> descriptor of this process's lock on it (kept open: closing it releases the lock)
HELD = {}
# steps in a row without a group to learn from before the run says so
NO_SIGNAL_STEPS = 5


def lock_run_dir(out_dir):
    """Takes out_dir/.lock (an exclusive flock holding the pid) for as long as this process lives."""
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


def write_failed(path, error, nbytes=0):
    """A failed write of the run: lack of space or permission is one line (path, bytes needed, free); else raised."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    code = getattr(error, "errno", None)
    if isinstance(error, PermissionError) or code in (errno.EACCES, errno.EROFS):
        fail(f"cannot write {path}: permission denied; make {os.path.dirname(path) or '.'} writable, then --resume")
    if code not in (errno.ENOSPC, errno.EDQUOT) and free >= nbytes + (1 << 20):
        raise error
    fail(f"cannot write {path}: no space left on the device ({nbytes / 1e6:.1f} MB needed, {free / 1e6:.1f} MB free); "
         "free some space, then --resume (the last checkpoint and the logged rows are intact)")


def write_atomic(path, write, nbytes=0):
    """`write(tmp)`, then tmp (a file or a directory) renamed over `path`; a failed write leaves no temporary behind."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        if os.path.isdir(tmp):
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        write_failed(path, e, nbytes)


def tensor_bytes(obj):
    """Bytes of the tensors in a nest of dicts and lists: what saving it needs, roughly."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return obj.nbytes if torch.is_tensor(obj) else 0


def export_hf(cfg, model, tok, weights):
    """The policy in the body dtype with its tokenizer, as a Hugging Face model directory out_dir/hf (vLLM reads it)."""
    from transformers.utils import logging
    logging.disable_progress_bar()
    weights = {k: v.to(getattr(torch, cfg.dtype)) for k, v in weights.items()}
    path = os.path.join(cfg.out_dir, "hf")
    write_atomic(path, lambda tmp: (model.save_pretrained(tmp, state_dict=weights), tok.save_pretrained(tmp)),
                 tensor_bytes(weights))
    return path


class Preemption:
    """SIGTERM and SIGUSR1 (sent by SLURM with --signal, Kubernetes, preemptible clouds) set `signal`; a second one
    exits at once. Generator ranks keep generating until the trainer ends the job."""
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
    """A checkpoint's contents on the CPU (plain tensors and containers only), else one line: unreadable, foreign
    (a trainer's checkpoint also holds its weights, in the file or as shards), or naming shards that are not there."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated, garbage or unsafe pickles all mean: not usable
        fail(f"checkpoint {path} is unreadable ({type(e).__name__}); restore a good copy or start a fresh --out_dir")
    missing = sorted(set(want) - set(ckpt)) if isinstance(ckpt, dict) else "everything"
    if not missing and "step" in want and not {"model", "shards"} & set(ckpt):
        missing = ["model"]
    if missing:
        fail(f"{path} is not a scalerl checkpoint (missing {missing}); start a fresh --out_dir")
    shards = os.path.join(os.path.dirname(path), ckpt.get("shards", ""))
    if "shards" in ckpt and not os.path.exists(os.path.join(shards, ".metadata")):
        fail(f"checkpoint {path} names {shards}, which is missing or incomplete; restore it or start a fresh --out_dir")
    return ckpt


@contextlib.contextmanager
def fits(path):
    """Restoring state read from `path`: state that does not fit this run ends it with one line."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        fail(f"checkpoint {path} does not fit this run ({' '.join(str(e).split())[:240]}); resume with the options "
             "it was written with (config.json) or start a fresh --out_dir")


def save_checkpoint(cfg, step, clock, source, job, policy, opt):
    """What --resume needs from the trainer (every trainer rank): in one process ckpt.pt holds it all; under torchrun
    each trainer rank writes its shard into shards-<step>/ (nothing is gathered), then rank 0 a ckpt.pt naming them."""
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
        import torch.distributed.checkpoint as dcp
        ckpt["shards"], ckpt["shards_opt"] = f"shards-{step:06d}", bool(opt.state)
        where = os.path.join(cfg.out_dir, ckpt["shards"])
        try:
            with dist.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
                dcp.save(sharded_state(policy, opt, ckpt["shards_opt"]), checkpoint_id=where,
                         process_group=job.groups["trainer"])
        except (OSError, dcp.api.CheckpointException) as e:  # a full disk on any rank fails the save on every rank
            write_failed(where, e if isinstance(e, OSError) else OSError(errno.EIO, first_line(e)))
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


def load_shards(job, policy, opt, where, with_opt):
    """Under torchrun, every trainer rank reads its own shard, and the optimizer's if there is one (not at step 0)."""
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
    """One process: ckpt.pt's optimizer state into `opt` (under FSDP2 from plain tensors; an empty state stays empty,
    or it would be initialised with a zero step)."""
    if not dist.sharded(policy):
        opt.load_state_dict(state)
    elif state["state"]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(policy, opt, state, options=StateDictOptions(full_state_dict=True))


def load_weights(model, ckpt, out_dir):
    """A checkpoint's fp32 weights into an unsharded `model` in one process, to the CPU: from ckpt.pt, or in full from
    a torchrun job's shards (torch.distributed.checkpoint reshards on load)."""
    with fits(os.path.join(out_dir, "ckpt.pt")):
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
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        for line in open(path):
            rows.append(json.loads(line))
    return [row for row in rows if row["step"] <= upto_step]


def per_task(row, key, tasks):
    """" (arith 0.812, code 0.406)" from the row's <key>_<task> entries; "" with one task."""
    parts = [f"{t} {row[f'{key}_{t}']:.3f}" for t in tasks if f"{key}_{t}" in row]
    return f" ({', '.join(parts)})" if parts else ""


class Log:
    """The loop's record: timers and the compute clock on every trainer rank; on trainer rank 0 also the run's files,
    the progress lines, the no-signal warning and the summary (other ranks make the same calls, writing nothing)."""
    def __init__(self, cfg, job):
        self.cfg, self.job, self.t_start, self.timers, self.tasks = cfg, job, time.time(), {}, ()
        # seconds, for the summary at the end
        self.took = dict(warm_start=0.0, training=0.0, evaluation=0.0)

    @contextlib.contextmanager
    def timer(self, key):
        t = time.time()
        yield
        self.timers[key] = time.time() - t
        if key in self.took:
            self.took[key] += self.timers[key]

    def open(self, step, clock, model, tok, train, val, tasks):
        """The loop's clocks start; on trainer rank 0 the run directory's files and the start-up summary."""
        cfg, job, B, G = self.cfg, self.job, self.cfg.batch_prompts, self.cfg.group_size
        self.clock, self.tasks, self.idle = clock, tasks, 0
        # with several tasks, each task's reward is logged too
        self.task_of = {p.id: p.task for p in train} if len(tasks) > 1 else {}
        if job.rank == 0:
            n_params = sum(p.numel() for p in model.parameters())
            self.open_files(step, n_params, tok)
            pipeline = "PipelineRL" if cfg.off_policy == "pipeline" else "PPO-off-policy"
            print(f"scalerl | {cfg.model} {n_params / 1e6:.2f}M params, body {cfg.dtype}, head "
                  f"{'fp32' if cfg.fp32_head else cfg.dtype} | {cfg.task}: {len(train)} train / {len(val)} held-out "
                  f"prompts\n  {B} prompts x {G} completions = {B * G} per step | {cfg.max_steps} steps | think "
                  f"{cfg.think_min}-{cfg.think_max} + answer {cfg.answer_budget} tokens | interruption "
                  f"{'on' if cfg.interrupt else 'off'}\n  {cfg.loss} loss, {cfg.agg} aggregation, {cfg.adv_norm} adv "
                  f"norm, zero-var filter {cfg.zero_var_filter}, NPR {cfg.npr} | {pipeline}-{cfg.max_lag}, "
                  f"{cfg.decode_per_step} decode steps per train step | engine {cfg.engine}, {cfg.slots} slots")
            # which protections the code sandbox has on this machine (Landlock, namespaces, uids)
            if "code" in tasks:
                print(f"  code sandbox: {sandbox_description()}")
            if job.world > 1:
                fsdp = " (FSDP2)" if len(job.trainers) > 1 else ""
                print(f"  torchrun: {job.world} ranks | trainer ranks {job.trainers}{fsdp} | "
                      f"generator ranks {job.generators} | device-hours = wall time x {job.world}")
        self.t_loop, self.first, self.eval_0 = time.time(), step, self.took["evaluation"]

    def open_files(self, step, n_params, tok):
        """The lock first; metrics.jsonl cut back to `step`; config.json with a history entry appended; --tracker
        (TensorBoard in out_dir/tensorboard, or W&B project "scalerl" with the run named after out_dir)."""
        cfg, job = self.cfg, self.job
        lock_run_dir(cfg.out_dir)
        if not cfg.resume and os.path.exists(os.path.join(cfg.out_dir, "ckpt.pt")):  # a run started beside this one
            fail(f"run directory {cfg.out_dir} already holds a run; pass --resume to continue it or pick another "
                 "--out_dir")
        self.path, meta_path = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "config.json")
        rows = read_metrics(self.path, step) if cfg.resume else []  # a fresh start over a failed one starts a fresh log
        text = "".join(json.dumps(r) + "\n" for r in rows)
        write_atomic(self.path, lambda tmp: pathlib.Path(tmp).write_text(text), len(text))
        modules = ["torch", "transformers"] + (["vllm"] if cfg.engine == "vllm" else [])
        versions = dict(python=platform.python_version(), **{m: __import__(m).__version__ for m in modules})
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
        write_atomic(meta_path, lambda tmp: pathlib.Path(tmp).write_text(json.dumps(meta, indent=1)))
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        if cfg.tracker == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tracker = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"), flush_secs=10)
        elif cfg.tracker == "wandb":
            import wandb
            self.tracker = wandb.init(project="scalerl", name=os.path.basename(os.path.normpath(cfg.out_dir)),
                                      config=asdict(cfg), dir=cfg.out_dir, resume="allow",
                                      id=re.sub(r"\W", "-", os.path.abspath(cfg.out_dir))[-64:])

    def write(self, row):
        """A row of metrics.jsonl in one unbuffered append (a full disk is caught at that row), and to --tracker."""
        line = (json.dumps(row) + "\n").encode()
        try:
            if os.write(self.fd, line) < len(line):
                raise OSError(errno.ENOSPC, "a short write")
        except OSError as e:
            write_failed(self.path, e, len(line))
        # --tracker: the row's numbers
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.cfg.tracker == "tensorboard":
            for key, value in numbers.items():
                self.tracker.add_scalar(key, value, row["step"])
            self.tracker.flush()
        elif self.cfg.tracker == "wandb":
            self.tracker.log(numbers, step=row["step"])

    def begin(self, source):
        """A step starts: its clocks, and the generation counters before it."""
        self.t0, self.c0, self.gen0 = time.time(), time.process_time(), source.totals()

    def step(self, step, batch, stats, source, bad_run):
        """The clock advanced; on rank 0 the step's row logged (keys in the README's glossary) and its progress line."""
        cfg, dt, t_train = self.cfg, time.time() - self.t0, self.timers["training"]
        # the compute axis counts every device; CPU time of this process is immune to a busy machine
        self.clock["device_hours"] += dt * self.job.world / 3600
        self.clock["cpu_hours"] += (time.process_time() - self.c0) / 3600
        if self.job.rank != 0:
            return ""
        gen, samples = source.totals(), [s for g in batch.groups for s in g]
        # seconds spent generating during the step (all generator ranks)
        gen_s = gen["gen_s"] - self.gen0["gen_s"]
        row = dict(step=step, **self.clock, policy_version=source.version,
                   reward=float(np.mean([s.reward for s in samples])),
                   **{k: stats[k] for k in ("loss", "clip_frac", "ratio_mean", "ratio_max", "mismatch_kl")},
                   lag_mean=batch.lag_mean, lag_max=batch.lag_max,
                   mixed_version_frac=float(np.mean([len(set(s.versions)) > 1 for s in samples])),
                   dropped_stale=source.dropped_stale,
                   trunc_rate=float(np.mean([s.interrupted or s.truncated for s in samples])),
                   zero_var_frac=1 - len(batch.kept) / len(batch.groups), npr_removed=gen["npr_removed"],
                   epoch=gen["epoch"], gen_tok_s=(gen["tokens"] - self.gen0["tokens"]) / max(gen_s, 1e-9),
                   gen_busy=gen_s / (dt * max(len(self.job.generators), 1)),
                   train_tok_s=stats["n_tokens"] / max(t_train, 1e-9), train_busy=t_train / dt,
                   train_tokens=stats["n_tokens"], lr=stats["lr"], dt=dt, sync_s=self.timers["sync_s"],
                   skipped_nonfinite=int(not stats["finite"]), reward_errors=gen["reward_errors"],
                   bad_prompts=gen["bad_prompts"])
        # with several tasks: the mean reward of each task's completions
        for t in dict.fromkeys(self.task_of.values()):
            mine = [s.reward for s in samples if self.task_of[s.prompt_id] == t]
            if mine:
                row[f"reward_{t}"] = float(np.mean(mine))
        self.write(row)
        # no group with a learning signal for NO_SIGNAL_STEPS steps in a row
        self.idle = self.idle + 1 if row["zero_var_frac"] == 1 else 0
        if self.idle == NO_SIGNAL_STEPS:
            if row["trunc_rate"] > 0.5:
                why = (f"{row['trunc_rate']:.0%} of completions hit the length budget (--think_max={cfg.think_max}, "
                       f"--answer_budget={cfg.answer_budget}): raise them, or check that the model closes its thinking")
            elif row["reward"] < 0:
                why = ("every completion failed: check that the model writes its answer after </think> in the form the "
                       "task's checker reads (data.reward), and the dataset's answers (--answer_key)")
            else:
                why = "every completion passed: the prompts are too easy for this model; pick a harder --task"
            print(f"warning: no learning signal for {NO_SIGNAL_STEPS} steps (every group zero-variance): {why}",
                  flush=True)
        spent = time.time() - self.t_loop - self.took["evaluation"] + self.eval_0
        eta = spent / (step - self.first) * (cfg.max_steps - step)
        line = (f"step {step:4d}/{cfg.max_steps} | reward {row['reward']:+.3f}{per_task(row, 'reward', self.tasks)} "
                f"| loss {row['loss']:+.4f} | clip {row['clip_frac']:.3f} | kl {row['mismatch_kl']:+.1e} | lag "
                f"{row['lag_mean']:.1f}/{row['lag_max']} | trunc {row['trunc_rate']:.2f} | zv "
                f"{row['zero_var_frac']:.2f} | gen {row['gen_tok_s']:.0f} tok/s | train {row['train_tok_s']:.0f} "
                f"tok/s | {dt:.2f}s | eta {eta / 60:.1f}m")
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
