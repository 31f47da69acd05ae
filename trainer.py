"""trainer.py: the training side of ScaleRL, one optimizer step at a time.

  1. Batch tensors: completions right-padded, the loss mask (forced interruption tokens stay in the context but out
     of the loss, App. A.10) and the behaviour logprobs aligned with the target positions.
  2. `Policy`: the trainer's forward as one module call, token logprobs with the body in its dtype and the LM head
     in FP32 (Sec. 3.2), after the sampling temperature.
  3. `policy_gradient`: the RL loss (losses.py; CISPO by default, Sec. 3.2) backpropagated over token-budget
     micro-batches; advantages and aggregation weights come from the whole batch, so gradients accumulate exactly.
  4. `train_step`: one AdamW step with warm-up and gradient clipping; a non-finite step is skipped (App. A.3).
  5. `warm_start`: the tiny model's supervised warm start on its task's traces (the paper starts RL from an SFT
     model), cached.
  6. Under torchrun: FSDP2 over the trainer ranks (`shard`), full weights and optimizer state gathered for weight
     updates and checkpoints, metrics reduced over the ranks.
  7. The run's record, kept by trainer rank 0: ckpt.pt and what --resume restores from it, config.json (with a
     history of starts and resumes), metrics.jsonl and its rows, optional --tracker, the policy exported as hf/.

The generating side is pipeline_rl.py; scalerl.py wires the two together.
"""
from dataclasses import asdict
import contextlib
import errno
import fcntl
import hashlib
import inspect
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

import data
import losses
import pipeline_rl

# ---------------------------------------------------------------------------------------------------------------------
# One optimizer step


def sequence_batch(seqs, starts, pad_id):
    """Right-padded (N, L) ids, (N, L) attention mask, and the (N, L-1) mask of trainable target positions."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], att[i, :len(s)] = torch.tensor(s), 1
    pos = torch.arange(1, L)[None]
    tmask = (pos >= torch.tensor(starts)[:, None]) & att[:, 1:].bool()
    return ids, att, tmask.float()


def rollout_tensors(samples, pad_id):
    """Trainer tensors for completions: ids/att (N, L); the loss mask and behaviour logprobs (N, L-1), aligned with
    the target positions. Forced interruption tokens stay in the context but are masked out of the loss (App. A.10)."""
    ids, att, tmask = sequence_batch([s.prompt_tokens + s.tokens for s in samples],
                                     [len(s.prompt_tokens) for s in samples], pad_id)
    gen_logp = torch.zeros(tmask.shape)
    for i, s in enumerate(samples):
        P, n = len(s.prompt_tokens), len(s.tokens)
        gen_logp[i, P - 1:P - 1 + n] = torch.tensor(s.logprobs)
        tmask[i, P - 1:P - 1 + n] *= 1 - torch.tensor(s.forced, dtype=torch.float)
    return ids, att, tmask, gen_logp


def loss_options(cfg):
    return {"eps_max": cfg.eps_max} if cfg.loss == "cispo" else {
        k: v for k, v in (("eps_low", cfg.eps_low), ("eps_high", cfg.eps_high)) if v >= 0}


class Head(torch.nn.Module):
    """The LM head as a module of its own: token logprobs (N, T) of `targets` after the temperature, in `dtype` (the
    FP32 head, Sec. 3.2). Under FSDP2 an untied head is a unit of its own, kept in that dtype while the body computes
    in the body dtype; the body's matmuls never see it."""
    def __init__(self, linear, temperature, dtype):
        super().__init__()
        self.linear, self.temperature, self.dtype = linear, temperature, dtype

    def forward(self, hidden, targets):
        out = losses.head_logprobs(hidden, self.linear.weight, targets, self.temperature, self.dtype)
        return out.clone()  # not a view: FSDP2 hooks its backward onto the output


class Policy(torch.nn.Module):
    """The trainer's forward as one module call, token logprobs (N, L-1) of ids (N, L). With a body dtype below fp32
    the parameters are fp32 masters and FSDP2's mixed precision (`shard`, one process included) runs the body on a
    bf16 copy, so trainer and generator compute it alike, and the head in its own dtype (Sec. 3.2, Fig. 5b). One call
    is what FSDP2 needs: its hooks gather every weight the call uses."""
    def __init__(self, lm, temperature, head_dtype=torch.float32, pad_id=0):
        super().__init__()
        self.lm, self.head, self.pad_id = lm, Head(lm.lm_head, temperature, head_dtype), pad_id
        self.tied = lm.lm_head.weight is lm.get_input_embeddings().weight  # a tied head is the embedding, in the body

    def forward(self, ids, att):
        hidden = self.lm.model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state  # (N, L, H)
        return self.head(hidden[:, :-1], ids[:, 1:])


def micro_batches(order, lengths, budget):
    """Runs of `order` (sorted by length) that fit `budget` tokens once padded to their longest (the last)."""
    out = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[i] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def policy_gradient(policy, groups, cfg, pad_id, rank=0, world=1):
    """Backward of the RL loss (Sec. 3.2) on `groups`, accumulated into .grad over token-budget micro-batches.
    With `world` trainer ranks, this rank takes every world-th completion by length; advantages and aggregation
    weights come from the whole batch, so the ranks' gradients sum to the one-process gradient (float round-off
    apart). Returns this rank's loss, token-weighted diagnostic sums (with n_tokens) and largest ratio."""
    samples = [s for g in groups for s in g]
    rewards = torch.tensor([s.reward for s in samples])
    gid = torch.tensor([s.group for s in samples])
    adv = losses.group_advantages(rewards, gid, norm=cfg.adv_norm)  # (N,)
    dev = next(policy.parameters()).device
    ids, att, tmask, gen_logp = (t.to(dev) for t in rollout_tensors(samples, pad_id))
    adv, gid = adv.to(dev), gid.to(dev)
    weights = losses.aggregation_weights(tmask, gid, how=cfg.agg)  # on the whole batch, sliced per micro-batch
    lengths = att.sum(1).tolist()
    order = sorted(range(len(samples)), key=lengths.__getitem__)  # similar lengths together: little padding
    plans = [micro_batches(order[r::world], lengths, cfg.micro_batch_tokens) for r in range(world)]
    policy.train()
    total, sums, ratio_max = 0.0, dict(clip_frac=0.0, ratio_mean=0.0, mismatch_kl=0.0, n_tokens=0), 0.0
    for i in range(max(map(len, plans))):
        if i >= len(plans[rank]):  # FSDP2 ranks run the same number of passes: this one adds a zero gradient
            (policy(ids[:1], att[:1]).sum() * 0).backward()
            continue
        mb = plans[rank][i]
        L = lengths[mb[-1]]
        loss, diag = losses.policy_loss(policy(ids[mb, :L], att[mb, :L]), gen_logp[mb, :L - 1], adv[mb],
                                        tmask[mb, :L - 1], weights[mb, :L - 1], loss=cfg.loss, **loss_options(cfg))
        loss.backward()
        total += loss.item()
        for k in ("clip_frac", "ratio_mean", "mismatch_kl"):
            sums[k] += diag[k] * diag["n_tokens"]
        sums["n_tokens"] += diag["n_tokens"]
        ratio_max = max(ratio_max, diag["ratio_max"])
    return total, sums, ratio_max


def train_step(policy, opt, groups, cfg, step, job=pipeline_rl.Dist()):
    """One optimizer step on the kept groups: AdamW with linear warm-up, gradient clipping, no KL (App. A.3). Under
    FSDP2 each trainer rank takes its share of the completions and the gradients are summed. A non-finite loss or
    gradient skips the update (one bad batch must not poison the weights and Adam's moments); a batch with no kept
    group makes none. Returns the step's loss and token-averaged diagnostics, the same on every trainer rank."""
    lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    for group in opt.param_groups:
        group["lr"] = lr
    if not any(len({s.reward for s in g}) > 1 for g in groups):  # every group zero-variance (filtered out, or kept
        # with the filter off): no signal, no update (AdamW's weight decay would still move the weights)
        return dict(loss=0.0, clip_frac=0.0, ratio_mean=1.0, ratio_max=1.0, mismatch_kl=0.0, n_tokens=0, finite=True,
                    lr=lr)
    rank, n_trainers = job.trainers.index(job.rank), len(job.trainers)
    with pipeline_rl.waiting_for(job, f"gradients of trainer ranks {job.trainers}") if n_trainers > 1 else \
            contextlib.nullcontext():
        loss, sums, ratio_max = policy_gradient(policy, groups, cfg, policy.pad_id, rank, n_trainers)
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor
    sums, maxes = reduce_metrics(job, dict(sums, loss=loss), dict(ratio_max=ratio_max))
    finite = math.isfinite(gnorm) and math.isfinite(sums["loss"])  # the same on every trainer rank
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    n = sums["n_tokens"] or 1
    return dict(loss=sums["loss"], **{k: sums[k] / n for k in ("clip_frac", "ratio_mean", "mismatch_kl")},
                ratio_max=maxes["ratio_max"], n_tokens=int(sums["n_tokens"]), finite=finite, lr=lr)


def warm_start(cfg, model, tok, out_root):
    """Supervised warm start on the task's traces (some wrong on purpose), cached so later runs reuse it."""
    if cfg.sft_steps == 0 or cfg.model != "tiny":
        return
    key = {k: getattr(cfg, k) for k in ("seed", "n_layer", "n_embd", "n_head", "task", "levels", "sft_steps",
                                        "sft_batch", "sft_lr", "sft_error_rate")}
    key["vocab"], key["code"] = tok.get_vocab(), inspect.getsource(warm_start)  # any change to the recipe re-trains
    path = os.path.join(out_root, "warmstart", hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
                        + ".pt")
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True))
        print(f"warm start: loaded {path}")
        return
    levels, sources = tuple(int(x) for x in cfg.levels.split(",")), cfg.task.split("+")
    # 4,000 traces per task from the training side of the split (held-out questions never appear), ids apart from RL's
    traces = data.arith_problems(4000, seed=cfg.seed, levels=levels, error_rate=cfg.sft_error_rate, split="train",
                                 start_id=10 ** 6) if "arith" in sources else []
    if "code" in sources:
        traces += data.code_problems(4000, seed=cfg.seed, error_rate=cfg.sft_error_rate, split="train",
                                     start_id=10 ** 6)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    t0 = time.time()
    model.train()
    for it in range(cfg.sft_steps):
        lr = cfg.sft_lr * min(1.0, (it + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / cfg.sft_steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        ps = rng.sample(traces, cfg.sft_batch)
        prompts = [data.encode(tok, data.format_prompt(p.question, tok)) for p in ps]
        seqs = [pr + data.encode(tok, data.format_target(p)) + [tok.eos_token_id] for pr, p in zip(prompts, ps)]
        n_targets = sum(len(s) - len(p) for s, p in zip(seqs, prompts))
        order, loss = sorted(range(len(seqs)), key=lambda i: len(seqs[i])), 0.0
        for k in range(0, len(order), 16):  # 16 similar lengths at a time: a quarter less padding than one batch
            part = order[k:k + 16]
            ids, att, tmask = sequence_batch([seqs[i] for i in part], [len(prompts[i]) for i in part],
                                             tok.pad_token_id)
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            part_loss = (nll * tmask).sum() / n_targets  # the batch's mean over target tokens, accumulated
            part_loss.backward()
            loss += part_loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it % 100 == 0 or it == cfg.sft_steps - 1:
            eta = (time.time() - t0) / (it + 1) * (cfg.sft_steps - it - 1)
            print(f"warm start {it:4d}/{cfg.sft_steps} | loss {loss:.3f} | {time.time() - t0:.0f}s | eta "
                  f"{eta / 60:.1f}m", flush=True)
    model.zero_grad(set_to_none=True)  # else the last SFT gradient would leak into the first RL step's
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # the cache is shared: runs started side by side each write their own
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)

# ---------------------------------------------------------------------------------------------------------------------
# Under torchrun: FSDP2 over the trainer ranks


def shard(policy, layers, group, body_dtype=torch.float32):
    """FSDP2 over the trainer ranks of `group` (one process: a group of one, for the mixed precision): each of `layers`
    a unit, the untied head a unit in its own dtype, the rest (embeddings, final norm) the root. Parameters, gradient
    reduction and AdamW stay fp32; a unit's parameters are cast to the body dtype while it computes (Sec. 3.2).
    Gradients are summed, not averaged: each rank's loss is its part of the whole batch's loss."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(group, next(policy.parameters()).device.type)
    body = MixedPrecisionPolicy(param_dtype=body_dtype, reduce_dtype=torch.float32)
    for m in layers:
        fully_shard(m, mesh=mesh, mp_policy=body)
    if not policy.tied:
        fully_shard(policy.head, mesh=mesh, mp_policy=MixedPrecisionPolicy(policy.head.dtype, torch.float32))
    head = set() if policy.tied else set(policy.head.parameters())  # the root reaches it through lm.lm_head too
    fully_shard(policy, mesh=mesh, mp_policy=body, ignored_params=head)
    for m in policy.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no average or pre-scaled sum
    return policy


def full_state_dict(module):
    """Full (unsharded) fp32 weights; under FSDP2 every trainer rank must call it (one all-gather per tensor)."""
    from torch.distributed.tensor import DTensor
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def weight_parts(policy, body_dtype):
    """The weights the generators and the export take, as (name, tensor, dtype): the body in its dtype, an untied head
    in the head's (the FP32 head, Sec. 3.2). A plain parameter comes as it is, for the consumer to cast while it copies
    (a weight bucket: no new tensor per parameter); an FSDP2 one is gathered, one at a time, already in `dtype` (half
    the bytes on the wire, never a full fp32 copy). Every trainer rank must consume it (an all-gather per parameter);
    the consumer keeps what it needs."""
    from torch.distributed.tensor import DTensor
    for name, p in policy.lm.named_parameters():
        dtype = policy.head.dtype if name == "lm_head.weight" else body_dtype
        yield name, p.detach().to(dtype).full_tensor() if isinstance(p, DTensor) else p.detach(), dtype


def gathered(policy, body_dtype):
    """`weight_parts` as (name, tensor) in the dtype each takes."""
    for name, t, dtype in weight_parts(policy, body_dtype):
        yield name, t.to(dtype)


def sharded(policy):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(policy, FSDPModule)


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
        with pipeline_rl.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
            dcp.save(sharded_state(policy, opt, bool(opt.state)), checkpoint_id=where,
                     process_group=job.groups["trainer"])
    except (OSError, dcp.api.CheckpointException) as e:  # a full disk on any rank fails the save on every rank
        write_failed(where, e if isinstance(e, OSError) else OSError(errno.EIO, pipeline_rl.first_line(e)))


def load_shards(job, policy, opt, where, with_opt):
    """The inverse, on every trainer rank: each reads its own shard (the same number of trainer ranks); the optimizer
    state if the checkpoint has one (the step-0 checkpoint has none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    state = sharded_state(policy, opt, with_opt)
    with pipeline_rl.waiting_for(job, f"checkpoint shards of trainer ranks {job.trainers}"):
        dcp.load(state, checkpoint_id=where, process_group=job.groups["trainer"])
    if with_opt:
        set_state_dict(policy.lm, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
    else:
        set_model_state_dict(policy.lm, state["model"])


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


def reduce_metrics(job, sums, maxes):
    """Sums and maxima (dicts of numbers) over the trainer ranks, before logging."""
    if len(job.trainers) == 1:
        return sums, maxes
    import torch.distributed as dist
    s, m = (torch.tensor(list(x.values()), dtype=torch.float64) for x in (sums, maxes))
    with pipeline_rl.waiting_for(job, f"metrics from trainer ranks {job.trainers}"):
        dist.all_reduce(s, group=job.groups["trainer"])
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=job.groups["trainer"])
    return dict(zip(sums, s.tolist())), dict(zip(maxes, m.tolist()))

# ---------------------------------------------------------------------------------------------------------------------
# The run's record, kept by trainer rank 0: ckpt.pt (atomic), config.json, metrics.jsonl (append-only, flushed per
# line), the policy exported as hf/


def fail(msg):
    """A one-line error a user can act on, and a non-zero exit."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def print0(*args, **kw):
    """Print on global rank 0 only (every rank of a torchrun job runs this script)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kw)


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


def save_checkpoint(cfg, step, clock, source, job, policy, opt, rollouts=None):
    """Everything --resume needs from the trainer; every trainer rank calls it. In one process: one file, ckpt.pt,
    with the fp32 weights, the optimizer state and the generating side. Under torchrun: each trainer rank writes its
    shard into shards-<step>/ (`save_shards`), then trainer rank 0 writes ckpt.pt, the marker that names them, and
    removes older shards; a kill at any point leaves ckpt.pt naming a complete set. (Generator ranks keep their own
    state, generator<rank>.pt.)"""
    ckpt = dict(step=step, version=source.version, stale=source.dropped_stale, torch_rng=torch.get_rng_state(),
                world=job.world, generators=job.generators, **clock)
    if job.world == 1:
        opt_state = opt.state_dict()
        if sharded(policy) and opt.state:  # FSDP2 over one process: plain tensors, for a file any run can read
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
            opt_state = get_optimizer_state_dict(policy, opt, options=StateDictOptions(full_state_dict=True))
        ckpt.update(model=full_state_dict(policy.lm), opt=opt_state, generating=rollouts.state_dict())
    else:
        ckpt["shards"], ckpt["shards_opt"] = f"shards-{step:06d}", bool(opt.state)
        save_shards(job, policy, opt, os.path.join(cfg.out_dir, ckpt["shards"]))
        if job.rank != 0:
            return
    write_atomic(os.path.join(cfg.out_dir, "ckpt.pt"), lambda tmp: torch.save(ckpt, tmp), tensor_bytes(ckpt))
    for old in os.listdir(cfg.out_dir):  # shards no checkpoint names any more
        if old.startswith("shards-") and old != ckpt.get("shards"):
            shutil.rmtree(os.path.join(cfg.out_dir, old), ignore_errors=True)


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
    if "code" in tasks:  # which protections the code sandbox has on this machine (Landlock, namespaces, uids)
        print(f"  code sandbox: {data.sandbox_description()}")
    if job.world > 1:
        fsdp = " (FSDP2)" if len(job.trainers) > 1 else ""
        print(f"  torchrun: {job.world} ranks | trainer ranks {job.trainers}{fsdp} | "
              f"generator ranks {job.generators} | device-hours = wall time x {job.world}")


def restore_trainer(cfg, ckpt, resume_point, job, policy, opt, source, rollouts):
    """--resume on a trainer rank: the weights and optimizer state (under torchrun: this rank's shards), the batch
    source's counters, and in one process the generating side. Returns (step, clock); a fresh run starts at step 0
    with a zero clock."""
    if not resume_point:
        return 0, dict(device_hours=0.0, cpu_hours=0.0)
    with fits(os.path.join(cfg.out_dir, "ckpt.pt")):
        if job.world > 1:
            load_shards(job, policy, opt, os.path.join(cfg.out_dir, resume_point["shards"]),
                        resume_point["shards_opt"])
        elif sharded(policy) and ckpt["opt"]["state"]:  # (an empty state would be initialised with a zero step)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(policy, opt, ckpt["opt"], options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(ckpt["opt"])
        if job.world == 1:
            rollouts.load_state_dict(ckpt["generating"])
    source.version, source.dropped_stale = resume_point["version"], resume_point["stale"]
    if job.world == 1:
        # the groups in flight at the checkpoint are regenerated
        source.admitted = resume_point["version"] * cfg.batch_prompts + resume_point["stale"]
        rollouts.engine.version = resume_point["version"]  # it was built from the checkpoint's weights
    clock = {k: ckpt.get(k, 0.0) if ckpt else 0.0 for k in ("device_hours", "cpu_hours")}  # rank 0 logs it
    if ckpt:
        torch.set_rng_state(ckpt["torch_rng"])
    print0(f"resumed {cfg.out_dir} at step {resume_point['step']} (in-flight completions are regenerated)")
    return resume_point["step"], clock
