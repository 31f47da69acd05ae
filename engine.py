"""engine.py: generation, the sampling side of ScaleRL's generator-trainer loop. The paper's choices made here:
  - Length budgets and stop rules: a thinking budget drawn per completion from [think_min, think_max], an answer
    budget once </think> is written; EOS or a spent budget ends the completion.
  - Forced interruption (App. A.10): at the thinking budget a phrase ending in </think> is inserted as forced tokens
    (no gradient through them), and the answer gets its own budget.
  - FP32 LM head (Sec. 3.2): tokens are sampled, and behaviour logprobs read, from an fp32 head, as the trainer's.
  - In-flight weight updates (Sec. 3.1): weights load between decode steps, running completions keep their KV cache,
    every token records the policy version that sampled it.
  - Continuous batching on a slot KV cache: a finished completion's slot is refilled at once; a group shares its
    prompt's prefill. `TorchEngine` does this in PyTorch; infra/vllm_engine.py puts the `Engine` rules on vLLM.
"""
from dataclasses import dataclass, field
import random

import torch

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
    # TorchEngine: tokens in the slot's KV cache, all but the last one (the next forward writes it)
    held = property(lambda self: len(self.sample.prompt_tokens) + len(self.sample.tokens) - 1)


class Engine:
    """What both engines share: budgets, stop rules, the interruption, groups. Subclasses provide `_queue`, `step`,
    `load_weights`, `busy`, `room` and `rng` (the token sampler's generator)."""
    def __init__(self, *, max_prompt, think_budget, answer_budget, eos_id, think_close_ids, interrupt_ids=None,
                 temperature=1.0, seed=0):
        # interrupt_ids None: interruption off; else the phrase ends with </think>, so the answer budget follows
        self.think_close, self.interrupt_ids = list(think_close_ids), interrupt_ids
        assert interrupt_ids is None or list(interrupt_ids[-len(self.think_close):]) == self.think_close
        self.max_prompt, self.eos_id, self.temperature = max_prompt, eos_id, temperature
        self.think_budget, self.answer_budget = think_budget, answer_budget  # (lo, hi), drawn per completion; int
        self.max_len = max_prompt + think_budget[1] + len(interrupt_ids or []) + answer_budget + 1
        self.groups, self.version = {}, 0  # group id -> (finished samples, group size); the loaded policy version
        self.budget_rng = random.Random(seed)
        self.stats = dict(decode_steps=0, busy_slot_steps=0, tokens=0, prefills=0)

    def add(self, template, n):
        """Queue n completions of `template.prompt_tokens`, to finish together as one group."""
        assert len(template.prompt_tokens) <= self.max_prompt, ("prompt over max_prompt", len(template.prompt_tokens))
        self.groups[template.group] = ([], n)
        self._queue(template, n)

    def generate(self, templates, n, progress=None):
        """Run n completions of each template to the end, on an engine running nothing else; the groups in template
        order. `progress(groups done)` after a step that finishes some."""
        for t in templates:
            self.add(t, n)
        out = {}
        while len(out) < len(templates):
            finished = self.step()
            out.update((g[0].group, g) for g in finished)
            if progress and finished:
                progress(len(out))
        return [out[t.group] for t in templates]

    def state_dict(self):  # the sampler state --resume restores
        return dict(rng=self.rng.get_state(), budget_rng=self.budget_rng.getstate())

    def load_state_dict(self, state):
        self.rng.set_state(state["rng"])
        self.budget_rng.setstate(state["budget_rng"])

    def _start(self, template):
        s = Sample(template.prompt_id, template.group, template.prompt_tokens, meta=template.meta)
        return Running(s, left=self.budget_rng.randint(*self.think_budget))

    def _record(self, s, tokens, logprobs, forced, version=None):
        """Append tokens to sample `s`; `version`: of the weights that sampled them (default: the loaded one)."""
        s.tokens += tokens
        s.logprobs += logprobs
        s.versions += [self.version if version is None else version] * len(tokens)
        s.forced += [forced] * len(tokens)
        self.stats["tokens"] += len(tokens)

    def _take(self, run, token, logp, version=None):
        """Record a sampled token; the stop rules: "done" (EOS, budget out), "interrupt" (phrase inserted), or None."""
        self._record(run.sample, [token], [logp], False, version)
        run.left -= 1
        if token == self.eos_id:
            return "done"
        if run.thinking and run.sample.tokens[-len(self.think_close):] == self.think_close:
            run.thinking, run.left = False, self.answer_budget
        elif run.left <= 0:
            if run.thinking and self.interrupt_ids is not None:
                # the interruption phrase as forced tokens, no loss (App. A.10); the answer budget follows
                self._record(run.sample, list(self.interrupt_ids), [0.0] * len(self.interrupt_ids), True)
                run.sample.interrupted, run.thinking, run.left = True, False, self.answer_budget
                return "interrupt"
            # the answer budget ran out, or thinking did with the interruption off
            run.sample.truncated = True
            return "done"
        return None

    def _finish(self, sample, done):
        """Count `sample` in its group; with the group's last completion the whole group goes to `done`."""
        finished, n = self.groups[sample.group]
        finished.append(sample)
        if len(finished) == n:
            done.append(self.groups.pop(sample.group)[0])


class SlotCache:
    """Per-layer KV buffers (slots, kv_heads, max_len, head_dim): `place` sets where the next forward writes, `update`
    (the model's only call) writes its keys and values in place and returns their history."""
    def __init__(self, cfg, slots, max_len, dtype, device):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (slots, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    def place(self, idx, qpos, upto, rows):
        """Slots idx (R,) at positions qpos (R, n), history up to `upto` of `rows` (idx, or a slice: views)."""
        # the (R * H * n,) rows written, in the buffers seen as (slots * H * M, head_dim)
        H, M = self.k[0].shape[1], self.k[0].shape[2]
        heads = torch.arange(H, device=qpos.device)[None, :, None]
        self.at = ((idx[:, None, None] * H + heads) * M + qpos[:, None, :]).reshape(-1)
        self.rows, self.upto = rows, upto

    def update(self, k, v, layer_idx, *args, **kwargs):
        K, V = self.k[layer_idx], self.v[layer_idx]
        K.view(-1, K.shape[-1]).index_copy_(0, self.at, k.reshape(-1, K.shape[-1]))
        V.view(-1, V.shape[-1]).index_copy_(0, self.at, v.reshape(-1, V.shape[-1]))
        return K[self.rows, :, :self.upto], V[self.rows, :, :self.upto]

    def copy_slot(self, src, dst, n):
        """The first n positions of slot(s) src into slot(s) dst."""
        for K, V in zip(self.k, self.v):
            K[dst, :, :n], V[dst, :, :n] = K[src, :, :n], V[src, :, :n]


def slot_attention(module, query, key, value, attention_mask, horizon=None, **kwargs):
    """The engine's attention: SDPA, but in a decode step with `horizon` = (T, rows) all rows read keys up to T and
    `rows`, the few longer ones, all theirs: a slot past its interruption phrase must not make all read as far."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa
    ours = attention_mask is not None and attention_mask.is_floating_point()  # the engine's (else a trainer's forward)
    if ours and kwargs.get("sliding_window"):  # a sliding layer: keys a window or more behind the query masked too
        q = (attention_mask == 0).sum(-1, keepdim=True) - 1  # the query's position: our mask allows keys 0..q
        old = torch.arange(attention_mask.shape[-1], device=q.device) <= q - kwargs["sliding_window"]
        attention_mask = attention_mask.masked_fill(old, torch.finfo(attention_mask.dtype).min)
    if query.shape[2] > 1 or not ours or kwargs.get("softcap"):
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    T, rows = horizon or (key.shape[2], [])
    out = decode_attention(query, key[:, :, :T], value[:, :, :T], attention_mask[..., :T], scaling)
    if len(rows):
        out[rows] = decode_attention(query[rows], key[rows], value[rows], attention_mask[rows], scaling)
    return out, None


def decode_attention(q, k, v, mask, scaling):
    """q (R, H, 1, D) over the cache's k, v (R, KV, T, D) -> (R, 1, H, D), each KV head read once (masked, transformers'
    SDPA copies K, V per query head: 12-20x slower on an H200, bench/decode_attention.py); fp32 on CPU: two matmuls."""
    if q.dtype == torch.float32 and q.device.type == "cpu":
        (R, H, _, D), KV = q.shape, k.shape[1]
        w = torch.softmax(torch.matmul(q.view(R, KV, H // KV, D), k.transpose(-1, -2)) * scaling + mask, -1)
        return torch.matmul(w, v).view(R, 1, H, D)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                            enable_gqa=True).transpose(1, 2)


def flat_parameters(model):
    """Each dtype's parameters made views of one flat tensor, moved one at a time: a weight bucket lands in one copy."""
    flat = {}
    for dt in {p.dtype for p in model.parameters()}:
        ps = [p for p in model.parameters() if p.dtype == dt]
        flat[dt] = torch.empty(sum(p.numel() for p in ps), dtype=dt, device=ps[0].device)
        for p, x in zip(ps, flat[dt].split([p.numel() for p in ps])):
            p.data = x.view_as(p).copy_(p.detach())
    return flat


@dataclass
class Waiting:  # a group's completions that have no slot yet
    template: Sample
    left: int                      # completions not started
    hidden: object = None          # the prompt's last hidden state once prefilled: the group's rest reuses it


class TorchEngine(Engine):
    """Continuous-batching KV-cache sampler for a `transformers` causal LM: a step decodes a token per running slot."""
    def __init__(self, model, *, slots, head_dtype=torch.float32, seed=0, **rules):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        super().__init__(seed=seed, **rules)
        self.model, self.head_dtype, cfg = model.eval(), head_dtype, model.config
        # the body and the model's own head, with its bias, logit scale and soft cap (losses.head_finish)
        self.body, self.head, self.finish = model.get_decoder(), model.get_output_embeddings(), losses.head_finish(cfg)
        self.device, self.kv_dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self.cache = SlotCache(cfg, slots, self.max_len, self.kv_dtype, self.device)
        self.flat = flat_parameters(model)
        # SDPA becomes slot_attention (SDPA plus horizons); with others (eager, flash...) all rows read as far
        if cfg._attn_implementation == "sdpa":
            AttentionInterface.register("scalerl_slots", slot_attention)
            AttentionMaskInterface.register("scalerl_slots", sdpa_mask)  # a 2D mask (a trainer's forward): SDPA's
            model.set_attn_implementation("scalerl_slots")
        self.horizons = cfg._attn_implementation == "scalerl_slots"
        self.slots = [None] * slots  # per slot: its Running completion, or None
        self.waiting = []            # Waiting groups, in admission order
        self.rng = torch.Generator(self.device).manual_seed(seed)

    busy = property(lambda self: bool(self.waiting) or any(s is not None for s in self.slots))
    room = property(lambda self: self.slots.count(None) - sum(w.left for w in self.waiting))  # free, not promised

    def _queue(self, template, n):
        self.waiting.append(Waiting(template, n))

    @torch.no_grad()
    def load_weights(self, source, version):
        """In-flight update (Sec. 3.1) from a module, or {name: tensor} of some parameters (a bucket at a time)."""
        weights = source.named_parameters() if hasattr(source, "named_parameters") else source.items()
        for name, t in weights:
            self.model.get_parameter(name).copy_(t)
        self.version = version

    def landing(self, bucket):
        """Where weight bucket `bucket` ((name, tensor, dtype) of consecutive parameters) lands: a flat view."""
        first = self.model.get_parameter(bucket[0][0])
        flat = self.flat[first.dtype]
        at = (first.data_ptr() - flat.data_ptr()) // flat.element_size()
        return flat[at:at + sum(t.numel() for _, t, _ in bucket)]

    @torch.no_grad()
    def step(self):
        """Fill free slots, advance every running completion one token; return the groups that finished."""
        done = []
        self._refill(done)
        runs = self._compact()
        if runs:
            rows = range(len(runs))
            hidden = self._forward(rows, [run.sample.tokens[-1:] for run in runs], [run.held for run in runs])
            self.stats["decode_steps"] += 1
            self.stats["busy_slot_steps"] += len(runs)
            self._advance(rows, hidden[:, -1], done)
        return done

    def _compact(self):
        """Move the running completions into the lowest slots (one KV copy per layer): a step decodes only those."""
        runs = [run for run in self.slots if run is not None]
        holes = [i for i in range(len(runs)) if self.slots[i] is None]
        above = [i for i in range(len(runs), len(self.slots)) if self.slots[i] is not None]
        if holes:
            self.cache.copy_slot(above, holes, max(self.slots[i].held for i in above))
            for hole, i in zip(holes, above):
                self.slots[hole], self.slots[i] = self.slots[i], None
        return self.slots[:len(runs)]

    def _forward(self, rows, tokens, pos):
        """Tokens (R, n) into slots `rows` at positions pos (R,) + arange(n) -> hidden states (R, n, H)."""
        n, dev = len(tokens[0]), self.device
        idx = torch.tensor(rows, device=dev)
        qpos = torch.tensor(pos, device=dev)[:, None] + torch.arange(n, device=dev)
        self.cache.place(idx, qpos, max(pos) + n, slice(rows.start, rows.stop) if isinstance(rows, range) else idx)
        allowed = torch.arange(self.cache.upto, device=dev) <= qpos[:, :, None]
        mask = torch.where(allowed, 0.0, torch.finfo(self.kv_dtype).min).to(self.kv_dtype)[:, None]
        extra = dict(horizon=self._horizon([p + 1 for p in pos])) if n == 1 and self.horizons else {}
        return self.body(input_ids=torch.tensor(tokens, device=dev), attention_mask=mask, position_ids=qpos,
                         past_key_values=self.cache, use_cache=True, **extra).last_hidden_state

    def _horizon(self, lengths):
        """Keys each row needs -> slot_attention's (T, longer rows), or None: one horizon for all. T is chosen for the
        least reading: every row reads T keys, the k longer rows all theirs again at about 3x (their keys copied)."""
        top = sorted(lengths, reverse=True)
        k = min(range(len(top)), key=lambda k: len(top) * top[k] + 3 * k * top[0])
        longer = [r for r, n in enumerate(lengths) if n > top[k]] if k else None  # one horizon for all: no list
        return (top[k], torch.tensor(longer, device=self.device)) if k else None

    def _sample(self, hidden):
        """Hidden states (R, H) -> tokens (R,) and their behaviour logprobs after temperature, FP32 head (Sec. 3.2)."""
        logits = losses.head_logits(hidden, self.head.weight, self.head_dtype, self.head.bias, *self.finish)
        logp = torch.log_softmax(logits / self.temperature, -1)
        tokens = torch.multinomial(logp.exp(), 1, generator=self.rng)[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def _refill(self, done):
        """Continuous batching: waiting completions start in free slots and sample their first token."""
        free, starts = [i for i, run in enumerate(self.slots) if run is None], []
        while free and self.waiting:
            w = self.waiting[0]
            take, free = free[:w.left], free[w.left:]
            # the slot holding the prompt's KV: a running sibling's, else the first one taken (prefilled below)
            source = next((i for i, r in enumerate(self.slots) if r and r.sample.group == w.template.group), take[0])
            starts.append((w, take, source))
            for i in take:
                self.slots[i] = self._start(w.template)
            w.left -= len(take)
            if w.left == 0:
                self.waiting.pop(0)
        # the new prompts in one forward, right-padded: a pad's keys lie past its prompt, masked until the slot's own
        # tokens overwrite them. The prompt's last hidden state samples the first token of all the group's slots
        new = [(w, source) for w, take, source in starts if source == take[0]]
        if new:
            prompts = [w.template.prompt_tokens for w, _ in new]
            P = max(map(len, prompts))
            out = self._forward([i for _, i in new], [p + [0] * (P - len(p)) for p in prompts], [0] * len(new))
            for (w, _), h, p in zip(new, out, prompts):
                w.hidden = h[len(p) - 1]
            self.stats["prefills"] += len(new)
        # the prompt's KV into the group's other new slots, one copy per layer
        for w, take, source in starts:
            self.cache.copy_slot(source, [i for i in take if i != source], len(w.template.prompt_tokens))
        if starts:
            self._advance([i for _, take, _ in starts for i in take],
                          torch.stack([w.hidden for w, take, _ in starts for _ in take]), done)

    def _advance(self, idx, hidden, done):
        """Sample each slot's next token (one device sync), apply the stop rules and the interruption (App. A.10)."""
        tokens, logps = (x.tolist() for x in self._sample(hidden))
        forced = []
        for i, token, logp in zip(idx, tokens, logps):
            run = self.slots[i]
            what = self._take(run, token, logp)
            if what == "interrupt":
                forced.append(i)
            elif what == "done":
                self.slots[i] = None
                self._finish(run.sample, done)
        if forced:
            # into these slots' KV caches in one forward: the last sampled token and the phrase but its last token
            n, runs = len(self.interrupt_ids), [self.slots[i] for i in forced]
            self._forward(forced, [run.sample.tokens[-n - 1:-1] for run in runs], [run.held - n for run in runs])
