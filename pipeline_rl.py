"""pipeline_rl.py: ScaleRL's generating side, prompts to scored batches around an engine. The paper's choices here:
  1. Zero-variance filtering (Sec. 3.2): a group whose rewards are all equal (A = 0) leaves the loss, not refilled.
  2. No-Positive-Resampling: a prompt whose pass rate reaches 0.9 is not drawn in later epochs (Sec. 3.2); choice:
     the latest observed pass rate decides, and a retirement takes effect at the next epoch.
  3. Binary rewards from a verifier (data.reward, Sec. 3.2), scored per group once all G completions are done.
  4. PipelineRL-k (Sec. 3.1): group n may start once the generator holds policy version n // B - k, weights load in
     flight after every step, and a group with a token over k versions old when taken is dropped (k = 0: on-policy).
  5. PPO-off-policy-k (Sec. 3.1): k*B groups generated with frozen weights, then trained on as k minibatches.
  6. Held-out evaluation: mean@n pass rate on prompts never trained on, not on the compute axis (Sec. 2.1).
"""
from dataclasses import dataclass
import random
from statistics import fmean
import threading
import time

import data
from engine import Sample


def warn(what, e, then=""):
    """One line: what failed, the exception's type and first line (at most 300 characters), then what follows."""
    print(f"warning: {what}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}{then}", flush=True)


class Rollouts:
    """One process's generating side around its engine: prompts from `pool` (None: evaluation only), rewards, groups."""
    def __init__(self, engine, pool, tok, max_prompt):
        self.engine, self.pool, self.tok, self.max_prompt = engine, pool, tok, max_prompt
        # ids of problems whose prompt could not be built (skipped from then on); verifier errors (scored -1, threads)
        self.bad_prompts, self.reward_errors, self.lock = set(), 0, threading.Lock()

    def template(self, problem, group):
        """A problem as a group template, or None (warned, counted) if its prompt cannot be built or is too long."""
        try:
            ids = data.encode(self.tok, data.format_prompt(problem.question, self.tok))
            if len(ids) > self.max_prompt:
                raise ValueError(f"{len(ids)} prompt tokens, over --max_prompt={self.max_prompt}")
            return Sample(problem.id, group, ids, meta=problem)
        except Exception as e:  # noqa: BLE001 -- one malformed item must not end a long run
            self.bad_prompts.add(problem.id)
            warn(f"skipped prompt {problem.id} ({str(problem.question)[:40]!r})", e)

    def next_template(self, group):
        for _ in range(1000):
            problem = self.pool.next()
            if problem.id not in self.bad_prompts and (t := self.template(problem, group)) is not None:
                return t
        raise SystemExit(f"error: 1000 prompts in a row could not be built (last: {problem.id}); check --task and "
                         "its prompt field")

    def reward(self, s):
        """The reward of one completion; a verifier that raises costs that completion only: -1, counted, logged."""
        text = self.tok.decode(s.tokens, skip_special_tokens=True)
        try:
            return data.reward(s.meta, text)
        except Exception as e:  # noqa: BLE001 -- one bad item or verifier bug must not end a long run
            with self.lock:
                self.reward_errors += 1
                warn(f"reward failed on prompt {s.prompt_id} (completion {text[:40]!r})", e, "; counted as -1")
            return -1.0

    def score(self, groups):
        """Rewards every completion of the groups at once: code runs in parallel sandboxes."""
        samples = [s for g in groups for s in g]
        for s, r in zip(samples, data.parallel_map(self.reward, samples)):
            s.reward = r

    def keep(self, group):
        return self.pool.record(group[0].prompt_id, [s.reward for s in group])

    def info(self):
        return dict(npr_removed=self.pool.npr_removed, epoch=self.pool.epoch, reward_errors=self.reward_errors,
                    bad_prompts=len(self.bad_prompts))

    def state_dict(self):
        return dict(pool=self.pool.state_dict(), engine=self.engine.state_dict(), reward_errors=self.reward_errors,
                    bad_prompts=sorted(self.bad_prompts))

    def load_state_dict(self, state):
        self.pool.load_state_dict(state["pool"])
        self.engine.load_state_dict(state["engine"])
        self.reward_errors = state["reward_errors"]
        self.bad_prompts.update(state["bad_prompts"])


class PromptPool:
    """Problems epoch by epoch in a seeded order; records each scored group for NPR and the zero-variance filter."""
    def __init__(self, problems, seed=0, npr=True, npr_threshold=0.9, zero_var=True):
        self.problems = {p.id: p for p in problems}
        assert self.problems and len(self.problems) == len(problems), "PromptPool needs problems with unique ids"
        self.seed, self.npr, self.npr_threshold, self.zero_var = seed, npr, npr_threshold, zero_var
        self.removed, self.history, self.groups_seen, self.zero_var_dropped = set(), {}, 0, 0
        self._start_epoch(0)

    def _start_epoch(self, epoch):
        self.epoch, self.position, self.order = epoch, 0, sorted(set(self.problems) - self.removed)
        random.Random(f"pool:{self.seed}:{epoch}").shuffle(self.order)

    npr_removed = property(lambda self: len(self.removed))
    zero_var_frac = property(lambda self: self.zero_var_dropped / self.groups_seen if self.groups_seen else 0.0)

    def next(self):
        if self.position >= len(self.order):
            self._start_epoch(self.epoch + 1)
            if not self.order:
                raise RuntimeError(f"PromptPool: all {len(self.problems)} prompts were removed by No-Positive-"
                                   f"Resampling (pass rate >= {self.npr_threshold}); nothing left to sample")
        self.position += 1
        return self.problems[self.order[self.position - 1]]

    def record(self, prompt_id, rewards):
        """Record a finished group's rewards (+1/-1); returns kept: False when zero-variance filtering drops it."""
        assert prompt_id in self.problems and len(rewards) > 0, (prompt_id, rewards)
        rate = sum(r > 0 for r in rewards) / len(rewards)
        self.groups_seen += 1
        # NPR (Sec. 3.2, choice): the latest pass rate decides; a later, lower one (a group in flight) brings it back
        self.history[prompt_id] = rate
        self.removed.discard(prompt_id)
        if self.npr and rate >= self.npr_threshold:
            self.removed.add(prompt_id)
        dropped = self.zero_var and all(r == rewards[0] for r in rewards)
        self.zero_var_dropped += dropped
        return not dropped

    def state_dict(self):
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "order": list(self.order),
                "removed": sorted(self.removed), "history": [[i, r] for i, r in sorted(self.history.items())],
                "groups_seen": self.groups_seen, "zero_var_dropped": self.zero_var_dropped}

    def load_state_dict(self, state):
        if unknown := set(state["order"]) - set(self.problems):
            raise ValueError(f"PromptPool state names {len(unknown)} prompt ids this pool does not have "
                             f"(e.g. {sorted(unknown)[:3]}); load the same problems before restoring")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.order, self.removed = [int(i) for i in state["order"]], {int(i) for i in state["removed"]}
        self.history = {int(i): float(r) for i, r in state["history"]}
        self.groups_seen, self.zero_var_dropped = state["groups_seen"], state["zero_var_dropped"]


class MixedPool:
    """A PromptPool per task (each its own curriculum) drawn in fixed shares. **choice** (App. A.3 does not say how math
    and code mix): each draw goes to the task furthest below its share, so B prompts in a row hold B x share of each."""
    def __init__(self, problems, shares, seed=0, **pool_kw):
        self.shares = {t: w / sum(shares.values()) for t, w in shares.items() if w > 0}
        self.pools = {t: PromptPool([p for p in problems if p.task == t], seed, **pool_kw) for t in self.shares}
        self.task_of, self.drawn = {p.id: p.task for p in problems}, dict.fromkeys(self.pools, 0)

    npr_removed = property(lambda self: sum(p.npr_removed for p in self.pools.values()))
    epoch = property(lambda self: min(p.epoch for p in self.pools.values()))  # the slowest task's

    def next(self):
        n = sum(self.drawn.values()) + 1
        task = max(self.pools, key=lambda t: n * self.shares[t] - self.drawn[t])
        self.drawn[task] += 1
        return self.pools[task].next()

    def record(self, prompt_id, rewards):
        return self.pools[self.task_of[prompt_id]].record(prompt_id, rewards)

    def state_dict(self):
        return {"drawn": dict(self.drawn), "pools": {t: p.state_dict() for t, p in self.pools.items()}}

    def load_state_dict(self, state):
        if set(state["pools"]) != set(self.pools):
            raise ValueError(f"MixedPool state holds tasks {sorted(state['pools'])}, this pool {sorted(self.pools)}")
        self.drawn = dict(state["drawn"])
        for task, pool in self.pools.items():
            pool.load_state_dict(state["pools"][task])


def make_pool(problems, tasks, code_frac=0.5, **pool_kw):
    """One PromptPool, or for several tasks a MixedPool: code takes `code_frac`, the others share the rest equally."""
    if len(tasks) == 1:
        return PromptPool(problems, **pool_kw)
    rest = (1 - code_frac if "code" in tasks else 1) / max(len(tasks) - tasks.count("code"), 1)
    return MixedPool(problems, {t: code_frac if t == "code" else rest for t in tasks}, **pool_kw)


@dataclass
class Batch:
    groups: list                   # B groups (lists of G scored Samples), admission order (trainer rank 0 only)
    kept: list                     # the groups the zero-variance filter keeps for the loss (every trainer rank)
    lag_mean: float = 0.0          # mean lag, in policy versions, of the sampled tokens
    lag_max: int = 0               # largest lag: at most k (PipelineRL-k)


def admission_limit(mode, version, k, B, dropped):
    """How many groups may have started once `version` is loaded; a group dropped as stale gives its place back."""
    return (version + k + 1) * B + dropped if mode == "pipeline" else (version // k + 1) * k * B


class BatchSource:
    """What Scheduler and TrainerLink (infra/dist.py) share: a group over the lag bound k is dropped, counted."""
    def __init__(self, k, batch_prompts):
        self.k, self.B = k, batch_prompts
        # the trainer's policy version (steps taken); groups dropped for a lag over k
        self.version, self.dropped_stale = 0, 0

    def _collect(self, n, next_group):
        """n groups from `next_group(missing)`, stale ones dropped, in admission order."""
        groups = []
        while len(groups) < n:
            g = next_group(n - len(groups))
            if self.version - min(min(s.versions) for s in g) <= self.k:
                groups.append(g)
            else:
                self.dropped_stale += 1
                self._dropped()
        return sorted(groups, key=lambda g: g[0].group)

    def _dropped(self):
        """TrainerLink gives the dropped group's place under the lag bound back to the generators."""

    def _batch(self, groups, kept):
        """A Batch, with the lag of its sampled (not forced) tokens at the trainer's version."""
        lags = [self.version - v for g in groups for s in g for v, f in zip(s.versions, s.forced) if not f]
        return Batch(groups, kept, sum(lags) / max(len(lags), 1), max(lags, default=0))

    def close(self):
        """The end of the run (TrainerLink stops the generator ranks)."""


class Scheduler(BatchSource):
    """Batches of B scored groups from one process's engine; mode "pipeline": PipelineRL-k, "ppo": PPO-off-policy-k."""
    def __init__(self, rollouts, *, mode, k, batch_prompts, group_size, decode_per_step=0):
        assert mode in ("pipeline", "ppo") and k >= (mode == "ppo"), (mode, k)
        super().__init__(k, batch_prompts)
        self.rollouts, self.engine, self.mode = rollouts, rollouts.engine, mode
        self.G, self.decode_per_step = group_size, decode_per_step
        # groups started; finished ones (in finishing order); seconds spent generating
        self.admitted, self.ready, self.gen_s = 0, [], 0.0

    def next_batch(self):
        """The next B groups to train on, scored, the zero-variance filter applied."""
        t = time.time()
        if self.mode == "ppo" and not self.ready:
            templates = [self.rollouts.next_template(self.admitted + j) for j in range(self.k * self.B)]
            self.admitted += len(templates)
            self.ready = self.engine.generate(templates, self.G)
        groups = self._collect(self.B, self._next_ready)
        # generation that overlaps this optimizer step, on the old weights
        for _ in range(self.decode_per_step if self.mode == "pipeline" else 0):
            if not self._step():
                break
        self.gen_s += time.time() - t
        self.rollouts.score(groups)
        return self._batch(groups, [g for g in groups if self.rollouts.keep(g)])

    def _next_ready(self, missing):
        while self.mode == "pipeline" and len(self.ready) < missing:
            if not self._step():
                raise RuntimeError("generator idle with no batch ready: the lag bound admits no new group")
        return self.ready.pop(0)

    def _step(self):
        """Admit the groups the lag bound allows, then one engine step; False, with no step, if the engine is idle."""
        while self.admitted < admission_limit(self.mode, self.version, self.k, self.B, self.dropped_stale):
            self.engine.add(self.rollouts.next_template(self.admitted), self.G)
            self.admitted += 1
        if not self.engine.busy:
            return False
        self.ready += self.engine.step()
        return True

    def push_weights(self, policy, publish=True):
        """New weights: PipelineRL loads them in flight (Sec. 3.1), PPO-off-policy once its k batches are used up."""
        self.version += 1
        if publish and (self.mode == "pipeline" or not self.ready):
            self.engine.load_weights(policy.state(), self.version)

    def totals(self):
        return dict(tokens=self.engine.stats["tokens"], gen_s=self.gen_s, **self.rollouts.info())


def evaluate(engine, rollouts, templates, n, seed, progress=None):
    """Held-out mean@n (Sec. 2.1): (task, passed, length) of n completions of each template with the engine's weights;
    sampling and thinking budgets re-seeded from `seed`, put back after (training completions on a rank share them)."""
    saved = engine.state_dict()
    engine.rng.manual_seed(seed)
    engine.budget_rng.seed(seed)
    groups = engine.generate(templates, n, progress)
    rollouts.score(groups)
    engine.load_state_dict(saved)
    return [(s.meta.task, s.reward > 0, len(s.tokens)) for g in groups for s in g]


def pass_rates(results, tasks=()):
    """The held-out row from `evaluate`'s results: pass_rate, eval_len, with several tasks pass_rate_<task> (Sec. 7)."""
    out = dict(pass_rate=fmean(r[1] for r in results), eval_len=fmean(r[2] for r in results))
    for t in tasks if len(tasks) > 1 else []:
        if mine := [r[1] for r in results if r[0] == t]:
            out[f"pass_rate_{t}"] = fmean(mine)
    return out
