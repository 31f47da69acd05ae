"""infra/rundir.py: the run directory, out/<run>/, kept by trainer rank 0 (checkpoint shards by every trainer rank):
its lock, atomic writes, checkpoints, metrics.jsonl and --tracker, the progress lines, the stop on SIGTERM. What it
guarantees (one live run per directory, a kill leaves the last good files): docs/faults.md."""
import contextlib
import copy
from dataclasses import asdict
import errno
import fcntl
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

import data
from infra import dist, fail, first_line, print0
from infra.sandbox import sandbox_description

# the run directories this process holds: their lock's descriptor stays open (never closed) until it exits
HELD = set()


def lock_run_dir(out_dir, probe=False):
    """Takes out_dir/.lock for as long as this process lives, writing our pid into it; probe=True only tries an
    existing one and lets it go. A live run holding it stops this one with one line naming its pid."""
    path = os.path.join(out_dir, ".lock")
    if os.path.realpath(out_dir) in HELD or probe and not os.path.exists(path):
        return
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(path, os.O_RDONLY if probe else os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        time.sleep(0.5)  # the holder writes its pid just after it takes the lock
        fail(f"run directory {out_dir} is in use by a live run (pid {pathlib.Path(path).read_text().strip()}); wait "
             "for it or stop it, or pick another --out_dir")
    if probe:
        return os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    HELD.add(os.path.realpath(out_dir))


def check_run_dir(cfg):
    """A fresh start refuses a directory that holds a run (a checkpoint, or logged steps); --resume needs ckpt.pt. A
    live run's directory and one that cannot be written are refused too, all before anything is written or said."""
    lock_run_dir(cfg.out_dir, probe=True)
    # the folder, or the first one above it that exists (a fresh run makes it)
    here = os.path.abspath(cfg.out_dir)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.access(here, os.W_OK):
        fail(f"cannot write run directory {cfg.out_dir}: {here} is read-only or not ours; pick a writable --out_dir")
    ckpt = os.path.join(cfg.out_dir, "ckpt.pt")
    trained = any(r["step"] > 0 for r in read_metrics(os.path.join(cfg.out_dir, "metrics.jsonl")))
    # a start that failed after its step-0 checkpoint (a torchrun rank that could not build its engine) holds nothing
    # to continue; the step is read memory-mapped, and an unreadable checkpoint is a run (--resume says what is wrong)
    try:
        step = os.path.exists(ckpt) and torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception:  # noqa: BLE001
        step = 1
    if not cfg.resume and (trained or step):
        fail(f"run directory {cfg.out_dir} already holds a run; pass --resume to continue it, pick another --out_dir, "
             f"or delete {cfg.out_dir} to start afresh")
    if cfg.resume and not os.path.exists(ckpt):
        hint = f" (delete {cfg.out_dir}: its rows cannot be continued)" if trained else ""
        fail(f"--resume: no checkpoint at {ckpt}{hint}; start a fresh run without --resume")


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


def export_hf(cfg, model, tok, weights):
    """The policy in the body dtype with its tokenizer, as a Hugging Face model directory out_dir/hf (vLLM reads it);
    the tokenizer's chat template gives the prompt the policy was trained on (training_template)."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    tok = training_template(tok, getattr(cfg, "instruction", ""))
    weights = {k: v.to(getattr(torch, cfg.dtype)) for k, v in weights.items()}
    path = os.path.join(cfg.out_dir, "hf")

    def write(tmp):
        model.save_pretrained(tmp, state_dict=weights)
        tok.save_pretrained(tmp)
        # save_pretrained names the model's dtype (the fp32 masters'); the weights are in the body dtype
        conf = pathlib.Path(tmp, "config.json")
        conf.write_text(json.dumps({**json.loads(conf.read_text()), "dtype": cfg.dtype}, indent=2))
    write_atomic(path, write, sum(t.nbytes for t in weights.values()))
    return path


def training_template(tok, instruction):
    """A copy of `tok` whose chat template, given the user's question, writes the training prompt (data.format_prompt):
    the task's answer instruction after the question, the tokenizer's own template or the plain Q/A format, <think>."""
    probe = [{"role": "user", "content": "What is 2 + 3?"}]
    want = data.format_prompt(probe[0]["content"] + instruction, tok)
    own = tok.chat_template or "{% for m in messages %}" + data.PLAIN_TEMPLATE.format(question="{{ m['content'] }}") + \
        "{% endfor %}"
    instruct = ("{%- if messages and messages[-1]['role'] == 'user' %}{% set messages = messages[:-1] + [{'role': "
                "'user', 'content': messages[-1]['content'] + " + json.dumps(instruction) + "}] %}{% endif -%}")
    out = copy.copy(tok)  # the run's tokenizer keeps its template: prompts are still built from it
    # <think> added unless the template's own generation prompt ends with it
    for think in ("", "{% if add_generation_prompt %}" + data.THINK_OPEN + "{% endif %}"):
        out.chat_template = instruct + own + think
        if out.apply_chat_template(probe, add_generation_prompt=True, tokenize=False) == want:
            return out
    print0("note: the export keeps the tokenizer's own chat template (the training prompt could not be rebuilt)")
    out.chat_template = tok.chat_template
    return out


class Preemption:
    """The stop signals set `signal`; a second exits at once in one process, is the same stop under torchrun (slurmd
    signals each process, torchrun forwards: elastic/agent/server/api.py:752). Before the run started: an exit."""
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
    started = False  # set by Log.open on the trainer ranks, by run.generator_rank on the others

    def __init__(self):
        self.signal = None
        for s in self.SIGNALS:
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        if self.signal is not None:
            return os._exit(128 + signum) if int(os.environ.get("WORLD_SIZE", 1)) == 1 else None
        self.signal = signal.Signals(signum).name
        if not Preemption.started:
            print0(f"{self.signal} before the run started: stopped, nothing of it written", flush=True)
            raise SystemExit(128 + signum)
        print0(f"{self.signal}: the run stops after this step with a checkpoint (in one process a second one stops it "
               "at once)", flush=True)


def load_checkpoint(path, want=("step", "device_hours", "version", "stale", "torch_rng")):
    """A checkpoint's plain tensors and containers, on the CPU; else one line: unreadable, foreign (a trainer's also
    holds its weights, in the file or as shards), or naming shards that are not there."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated, garbage or unsafe pickles all mean: not usable
        fail(f"checkpoint {path} is unreadable ({type(e).__name__}); restore a good copy or start a fresh --out_dir")
    have = set(ckpt) if isinstance(ckpt, dict) else set()
    missing = sorted(set(want) - have) + (["model"] if "step" in want and not {"model", "shards"} & have else [])
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
    """What --resume needs from the trainer: ckpt.pt in one process; under torchrun each trainer rank's shard in
    shards-<step>/, then rank 0's ckpt.pt naming them. AdamW's state once it has one (a fresh one's: a zero step)."""
    from torch.distributed.checkpoint import state_dict as sd
    ckpt = dict(step=step, version=source.version, stale=source.dropped_stale, torch_rng=torch.get_rng_state(),
                world=job.world, generators=job.generators, **clock)
    if job.world == 1:
        opt_state = opt.state_dict()
        # FSDP2 over one process: plain tensors, for a file any run can read
        if dist.sharded(policy) and opt.state:
            opt_state = sd.get_optimizer_state_dict(policy, opt, options=sd.StateDictOptions(full_state_dict=True))
        ckpt.update(model=dist.full_state_dict(policy.lm), opt=opt_state, generating=source.rollouts.state_dict())
    else:
        import torch.distributed.checkpoint as dcp
        ckpt["shards"], ckpt["shards_opt"] = f"shards-{step:06d}", bool(opt.state)
        where = os.path.join(cfg.out_dir, ckpt["shards"])
        state = dict(model=sd.get_model_state_dict(policy.lm))
        if opt.state:
            state["opt"] = sd.get_optimizer_state_dict(policy.lm, opt)
        try:
            with dist.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
                dcp.save(state, checkpoint_id=where, process_group=job.groups["trainer"])
        except (OSError, dcp.api.CheckpointException) as e:  # a full disk on any rank fails the save on every rank
            write_failed(where, e if isinstance(e, OSError) else OSError(errno.EIO, first_line(e)))
        if job.rank != 0:
            return
    nbytes = sum(t.nbytes for t in tree_leaves(ckpt) if torch.is_tensor(t))
    write_atomic(os.path.join(cfg.out_dir, "ckpt.pt"), lambda tmp: torch.save(ckpt, tmp), nbytes)
    # shards no checkpoint names any more
    for old in os.listdir(cfg.out_dir):
        if old.startswith("shards-") and old != ckpt.get("shards"):
            shutil.rmtree(os.path.join(cfg.out_dir, old), ignore_errors=True)


def load_trainer(cfg, job, policy, opt, ckpt, resume):
    """--resume on a trainer rank: AdamW's state from ckpt.pt in one process (under FSDP2 from plain tensors), or under
    torchrun this rank's shard of the weights and of AdamW's state. An empty state stays empty."""
    from torch.distributed.checkpoint import load, state_dict as sd
    if job.world == 1 and not dist.sharded(policy):
        opt.load_state_dict(ckpt["opt"])
    elif job.world == 1 and ckpt["opt"]["state"]:
        sd.set_optimizer_state_dict(policy, opt, ckpt["opt"], options=sd.StateDictOptions(full_state_dict=True))
    elif job.world > 1:
        state = dict(model=sd.get_model_state_dict(policy.lm))
        if resume["shards_opt"]:
            state["opt"] = sd.get_optimizer_state_dict(policy.lm, opt)
        with dist.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
            load(state, checkpoint_id=os.path.join(cfg.out_dir, resume["shards"]), process_group=job.groups["trainer"])
        sd.set_model_state_dict(policy.lm, state["model"])
        if resume["shards_opt"]:
            sd.set_optimizer_state_dict(policy.lm, opt, state["opt"])


def load_weights(model, ckpt, out_dir):
    """A checkpoint's fp32 weights into an unsharded `model` on the CPU: from ckpt.pt, or in full from the shards."""
    from torch.distributed.checkpoint import load, state_dict as sd
    with fits(os.path.join(out_dir, "ckpt.pt")):
        if "model" in ckpt:
            return model.load_state_dict(ckpt["model"])
        state = sd.get_model_state_dict(model)
        load(dict(model=state), checkpoint_id=os.path.join(out_dir, ckpt["shards"]), no_dist=True)
        sd.set_model_state_dict(model, state)


def read_metrics(path):
    """The rows of an existing log, less a torn last line (a kill mid-write leaves it without its newline)."""
    return [json.loads(line) for line in open(path) if line.endswith("\n")] if os.path.exists(path) else []


def per_task(row, key, tasks):
    """" (arith 0.812, code 0.406)" from the row's <key>_<task> entries; "" with one task."""
    parts = [f"{t} {row[f'{key}_{t}']:.3f}" for t in tasks if f"{key}_{t}" in row]
    return f" ({', '.join(parts)})" if parts else ""


def generated(source):
    """source.totals(); in one process with the vLLM engine also its resubmission counts (TrainerLink's hold them)."""
    stats = getattr(getattr(source, "engine", None), "stats", {})
    return {**{key: stats[key] for key in dist.RESUBMITS if key in stats}, **source.totals()}


class Log:
    """The loop's record: timers and the compute clock on every trainer rank; on trainer rank 0 also the run's files,
    the progress lines, the no-signal warning and the summary (other ranks make the same calls, writing nothing)."""
    def __init__(self, cfg, job):
        self.cfg, self.job, self.t_start, self.timers, self.lost_eval = cfg, job, time.time(), {}, False
        self.took = dict(warm_start=0.0, training=0.0, evaluation=0.0)

    @contextlib.contextmanager
    def timer(self, key):
        t = time.time()
        yield
        self.timers[key] = time.time() - t
        if key in self.took:
            self.took[key] += self.timers[key]

    def open(self, step, clock, model, tok, train, val, tasks):
        """The loop's clocks start; on trainer rank 0 the lock, the directory checked again (a run started beside this
        one may have got there first), its files, --tracker (in out_dir, or W&B project "scalerl"), the header."""
        cfg, job, B, G = self.cfg, self.job, self.cfg.batch_prompts, self.cfg.group_size
        self.clock, self.tasks, self.idle = clock, tasks, 0
        self.task_of = {p.id: p.task for p in train} if len(tasks) > 1 else {}
        self.t_loop, self.first, self.eval_0 = time.time(), step, self.took["evaluation"]
        Preemption.started = True
        if job.rank != 0:
            return
        # the built-in task's ceiling: the share of held-out traces the thinking budget holds (printed with the fit)
        self.bound = data.feasible_share(val, (cfg.think_min, cfg.think_max), lambda t: len(data.encode(tok, t))) \
            if set(tasks) == {"arith"} else None
        lock_run_dir(cfg.out_dir)
        check_run_dir(cfg)
        self.path, meta_path = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "config.json")
        # a fresh start over a failed one starts a fresh log; a resume whose step's evaluation row was lost evaluates
        # that step again, and names those of earlier steps, whose weights are gone (docs/torchrun.md)
        rows = [r for r in read_metrics(self.path) if r["step"] <= step] if cfg.resume else []
        logged = {r["step"] for r in rows if "eval" in r}
        missing = [s for s in range(0, step + 1, cfg.eval_every) if s not in logged] if cfg.resume else []
        self.lost_eval = step in missing
        if lost := [s for s in missing if s != step]:
            print(f"held-out rows lost: steps {lost} (asked, never logged: the job ended before they came back; the "
                  f"checkpoint holds step {step}'s weights, not theirs, so they stay missing)", flush=True)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        write_atomic(self.path, lambda tmp: pathlib.Path(tmp).write_text(text), len(text))
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        modules = ["torch", "transformers"] + ["vllm"] * (cfg.engine == "vllm")
        git = subprocess.run("git rev-parse --short HEAD", shell=True, capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
        old = json.load(open(meta_path)) if cfg.resume and os.path.exists(meta_path) else {}
        n_params = sum(p.numel() for p in model.parameters())
        meta = dict(config=asdict(cfg), versions=dict(python=sys.version.split()[0], **{
            m: __import__(m).__version__ for m in modules}), git=git, n_params=n_params, vocab=len(tok),
                    ranks=dict(trainers=job.trainers, generators=job.generators), history=old.get("history", []) + [
                        dict(step=step, time=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:])])
        write_atomic(meta_path, lambda tmp: pathlib.Path(tmp).write_text(json.dumps(meta, indent=1)))
        if cfg.tracker == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.tracker = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"), flush_secs=10)
        elif cfg.tracker == "wandb":
            import wandb
            self.tracker = wandb.init(project="scalerl", name=os.path.basename(os.path.normpath(cfg.out_dir)),
                                      config=asdict(cfg), dir=cfg.out_dir, resume="allow",
                                      id=re.sub(r"\W", "-", os.path.abspath(cfg.out_dir))[-64:])
        print(f"scalerl | preset {getattr(cfg, 'preset', '-')} | {cfg.model} {n_params / 1e6:.2f}M params, body "
              f"{cfg.dtype}, head {'fp32' if cfg.fp32_head else cfg.dtype} | {cfg.task}: {len(train)} train / "
              f"{len(val)} held-out prompts\n  {B} prompts x {G} completions = {B * G} per step | {cfg.max_steps} "
              f"steps | think {cfg.think_min}-{cfg.think_max} + answer {cfg.answer_budget} tokens | interruption "
              f"{'on' if cfg.interrupt else 'off'}\n  {cfg.loss} loss, {cfg.agg} aggregation, {cfg.adv_norm} adv "
              f"norm, zero-var filter {cfg.zero_var_filter}, NPR {cfg.npr} | "
              f"{'PipelineRL' if cfg.off_policy == 'pipeline' else 'PPO-off-policy'}-{cfg.max_lag}, "
              f"{cfg.decode_per_step} decode steps per train step | engine {cfg.engine}, {cfg.slots} slots | "
              f"{torch.get_num_threads()} CPU thread(s)")
        if "code" in tasks:
            print(f"  code sandbox: {sandbox_description()}")
        if job.world > 1:
            print(f"  torchrun: {job.world} ranks | trainer ranks {job.trainers}"
                  f"{' (FSDP2)' if len(job.trainers) > 1 else ''} | generator ranks {job.generators} | device-hours "
                  f"= wall time x {job.world}")

    def write(self, row):
        """A row of metrics.jsonl in one unbuffered append (a full disk is caught at that row), and to --tracker."""
        line = (json.dumps(row) + "\n").encode()
        try:
            if os.write(self.fd, line) < len(line):
                raise OSError(errno.ENOSPC, "a short write")
        except OSError as e:
            write_failed(self.path, e, len(line))
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.cfg.tracker == "tensorboard":
            for key, value in numbers.items():
                self.tracker.add_scalar(key, value, row["step"])
            self.tracker.flush()
        elif self.cfg.tracker == "wandb":
            self.tracker.log(numbers, step=row["step"])

    def begin(self, source):
        """A step starts: its clocks, and the generation counters before it."""
        self.t0, self.c0, self.gen0 = time.time(), time.process_time(), generated(source)

    def step(self, step, batch, stats, source, bad_run):
        """The clock advanced; on rank 0 the step's row logged (keys in the README's glossary) and its progress line."""
        cfg, dt, t_train = self.cfg, time.time() - self.t0, self.timers["training"]
        # the compute axis counts every device; CPU time of this process is immune to a busy machine
        self.clock["device_hours"] += dt * self.job.world / 3600
        self.clock["cpu_hours"] += (time.process_time() - self.c0) / 3600
        if self.job.rank != 0:
            return ""
        gen, samples = generated(source), [s for g in batch.groups for s in g]
        # seconds spent generating during the step (all generator ranks)
        gen_s = gen["gen_s"] - self.gen0["gen_s"]
        row = dict(step=step, **self.clock, policy_version=source.version, reward=np.mean([s.reward for s in samples]),
                   **{k: v for k, v in stats.items() if k not in ("n_tokens", "finite", "lr")},
                   lag_mean=batch.lag_mean, lag_max=batch.lag_max, dropped_stale=source.dropped_stale,
                   mixed_version_frac=np.mean([len(set(s.versions)) > 1 for s in samples]),
                   trunc_rate=np.mean([s.interrupted or s.truncated for s in samples]),
                   zero_var_frac=1 - len(batch.kept) / len(batch.groups), npr_removed=gen["npr_removed"],
                   epoch=gen["epoch"], gen_tok_s=(gen["tokens"] - self.gen0["tokens"]) / max(gen_s, 1e-9),
                   gen_busy=gen_s / (dt * max(len(self.job.generators), 1)),
                   train_tok_s=stats["n_tokens"] / max(t_train, 1e-9), train_busy=t_train / dt,
                   train_tokens=stats["n_tokens"], lr=stats["lr"], dt=dt, sync_s=self.timers["sync_s"],
                   skipped_nonfinite=int(not stats["finite"]), reward_errors=gen["reward_errors"],
                   bad_prompts=gen["bad_prompts"])
        for t in dict.fromkeys(self.task_of.values()):
            if mine := [s.reward for s in samples if self.task_of[s.prompt_id] == t]:
                row[f"reward_{t}"] = np.mean(mine)
        if "resubmits" in gen:  # vLLM: the prefix its resubmitted requests computed again, their mean wait to resume
            n, grown = gen["resubmits"] - self.gen0["resubmits"], {k: gen[k] - self.gen0[k] for k in dist.RESUBMITS}
            row.update(reprefill_tokens=grown["reprefill_tokens"],
                       resubmit_wait_s=grown["resubmit_wait_us"] / 1e6 / n if n else None)
        self.write(row)
        # no group with a learning signal for 5 steps in a row: the likeliest reason
        self.idle = self.idle + 1 if row["zero_var_frac"] == 1 else 0
        if self.idle == 5:
            why = (f"{row['trunc_rate']:.0%} of completions hit the length budget: raise --think_max/--answer_budget"
                   if row["trunc_rate"] > 0.5 else "every completion failed: check the answer format the task's "
                   "checker reads and --answer_key" if row["reward"] < 0 else "every completion passed: the prompts "
                   "are too easy for this model; pick a harder --task")
            print(f"warning: no learning signal for 5 steps (every group zero-variance): {why}", flush=True)
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
        total = time.time() - self.t_start
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in self.took.items())
        print(f"done in {total / 60:.1f} min ({parts}, start-up, scoring, logging and checkpoints "
              f"{total - sum(self.took.values()):.0f}s); run directory {self.cfg.out_dir}")
