"""The vLLM engine (infra/vllm_engine.py) against the PyTorch engine and the trainer, on the tiny model, on CPU.

Needs vLLM (pip install -r requirements-vllm.txt); every test is skipped where it is not installed. The model is the
tiny default (trainer.tiny_model, character tokenizer) after a short warm start, so its next-token distributions are
peaked as in training. Each engine starts in a few seconds after a ~10 s import of vllm.
Run: python -m pytest tests/test_vllm.py -q      (the slow tests run scalerl.py with --engine vllm: minutes)
"""
from dataclasses import replace
import json
import random
import time

import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning")]  # vLLM's own, on import

import data  # noqa: E402
import losses  # noqa: E402
import scalerl  # noqa: E402
import trainer  # noqa: E402
from engine import Sample  # noqa: E402
from infra.dist import buckets, new_bucket  # noqa: E402
from infra.run import make_engine  # noqa: E402
from infra import run as infra_run  # noqa: E402
from infra.vllm_engine import VLLMEngine, vllm_share  # noqa: E402
from conftest import read_jsonl, run_base, run_command, scalerl_command, torchrun_command  # noqa: E402
from test_learns import LEARNS  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The default tiny model after 60 warm-start steps, its tokenizer, and a Config with the engine settings the
    tests share (engines come from infra.run.make_engine, as in a run)."""
    cfg = scalerl.Config(sft_steps=60, sft_batch=32, slots=32, max_prompt=64, think_min=16, think_max=28,
                         answer_budget=6)
    tok = data.char_tokenizer(data.ARITH_CHARS + data.INTERRUPT_PHRASE + "=")
    model = trainer.tiny_model(cfg, len(tok))
    trainer.warm_start(cfg, model, tok, str(tmp_path_factory.mktemp("vllm")))
    return model.eval(), tok, cfg


def vllm_engine(model, tok, cfg, seed=0, **over):
    """A VLLMEngine with the run's settings in `cfg`, some overridden (Config field names)."""
    return make_engine(replace(cfg, engine="vllm", **over), model, tok, seed)


def templates(tok, n):
    return [Sample(p.id, i, data.encode(tok, data.format_prompt(p.question, tok)))
            for i, p in enumerate(data.arith_problems(n, seed=1))]


def copy_of(model, tok):
    m = trainer.tiny_model(scalerl.Config(), len(tok))
    m.load_state_dict(model.state_dict())
    return m.eval()


def trainer_logprobs(model, s, temperature=1.0):
    """The trainer's FP32-head logprobs of a completion's tokens (full forward, no KV cache)."""
    ids = torch.tensor([s.prompt_tokens + s.tokens])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
    lp = losses.head_logprobs(h[:, :-1], model.lm_head.weight, ids[:, 1:], temperature)
    return lp[0, len(s.prompt_tokens) - 1:]


def free_error(model, samples, temperature=1.0):
    """Max |behaviour - trainer| logprob over sampled (not forced) tokens."""
    err = 0.0
    for s in samples:
        free = ~torch.tensor(s.forced)
        err = max(err, (trainer_logprobs(model, s, temperature) - torch.tensor(s.logprobs))[free].abs().max().item())
    return err


def test_greedy_output_equals_torch_engine(tiny):
    model, tok, cfg = tiny
    ts = templates(tok, 12)
    vl = vllm_engine(model, tok, cfg, temperature=0.0).generate(ts, 2)
    # TorchEngine cannot divide by 0: at temperature 1e-6 sampling is argmax for any logit gap above ~1e-5
    to = make_engine(replace(cfg, engine="torch", temperature=1e-6), model, tok, 0).generate(ts, 2)
    key = lambda s: s.tokens  # noqa: E731 -- a group lists its completions in finish order, ties in engine order
    pairs = [(a, b) for ga, gb in zip(vl, to) for a, b in zip(sorted(ga, key=key), sorted(gb, key=key))]
    assert all(a.tokens == b.tokens and a.forced == b.forced for a, b in pairs)
    assert all(a.interrupted == b.interrupted and a.truncated == b.truncated for a, b in pairs)
    assert 0 < sum(a.interrupted for a, _ in pairs) < len(pairs)  # both stop paths were exercised


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_trainer_fp32_head(tiny, temperature):
    model, tok, cfg = tiny
    eng = vllm_engine(model, tok, cfg, seed=3, temperature=temperature)
    samples = [s for g in eng.generate(templates(tok, 12), 4) for s in g]
    assert all(len(s.tokens) == len(s.logprobs) == len(s.versions) == len(s.forced) for s in samples)
    err = free_error(model, samples, temperature)
    # Measured: 4.8e-6 at 1.0, 5.7e-6 at 0.7 (float32 round-off: vLLM's paged attention vs a full forward); the
    # wrong temperature is off by more than 2.
    assert err < 5e-5, err
    assert free_error(model, samples, 1.0 if temperature != 1.0 else 0.7) > 0.1


def head_in_worker(worker):
    """Runs in vLLM's worker: its LM head's weight, and its logits of 5 bf16 hidden states."""
    model = worker.get_model()
    h = torch.randn(5, model.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    return model.lm_head.weight.detach().clone(), h, model.compute_logits(h)


def test_an_untied_head_is_float32_in_vllm_as_in_the_trainer(tiny):
    """With a bf16 body, vLLM's LM head holds the trainer's fp32 weight bit for bit, first load and in-flight updates,
    and its logits are the trainer's h.float() @ W.T exactly (Sec. 3.2). vLLM's own head_dtype override would keep the
    weight in bf16 (ParallelLMHead: the model dtype) and round it on every load."""
    model, tok, cfg = tiny
    eng = vllm_engine(model, tok, cfg, dtype="bfloat16")
    head = model.lm_head.weight.detach()
    for version in (0, 1):
        if version:  # an in-flight update of the head alone
            head = head + 1e-3 * torch.randn(head.shape, generator=torch.Generator().manual_seed(1))
            eng.load_weights({"lm_head.weight": head}, version)
        weight, h, logits = eng.llm.collective_rpc(head_in_worker)[0]
        assert weight.dtype == torch.float32 and torch.equal(weight[:len(head)], head)  # vLLM pads the vocabulary
        assert torch.equal(logits[:, :len(head)], losses.head_logits(h, head))
        assert not torch.equal(head.bfloat16().float(), head)  # what bf16 storage would have lost
    assert eng.model.get_parameter("model.norm.weight").dtype == torch.bfloat16  # the body is bf16


def test_same_seed_same_samples(tiny):
    model, tok, cfg = tiny
    a, b = (vllm_engine(model, tok, cfg, seed=5).generate(templates(tok, 4), 4) for _ in range(2))
    assert [s.tokens for g in a for s in g] == [s.tokens for g in b for s in g]


def test_every_request_carries_its_own_seed_on_a_gpu_too(tiny, monkeypatch):
    """Each request has a seed drawn from the engine's rng, on a GPU as on the CPU (model runner V2 samples seeded
    requests in one kernel): the same engine seed gives the same seeds, so an evaluation repeats exactly."""
    model, tok, cfg = tiny
    seen = []
    for device in ("cpu", "cuda"):
        e = vllm_engine(model, tok, cfg, seed=4)
        add = e.llm.add_request
        monkeypatch.setattr(e.llm, "add_request", lambda rid, prompt, params, add=add, d=device, **kw: seen.append(
            (d, params.seed)) or add(rid, prompt, params, **kw))
        e.device = torch.device(device)  # what a generator rank's engine has; sampling itself still runs on the CPU
        e.generate(templates(tok, 2), 2)
    cpu, cuda = ([seed for d, seed in seen if d == kind] for kind in ("cpu", "cuda"))
    assert len(cpu) >= 4 and None not in cpu and cuda == cpu


def test_the_parent_holds_no_device_copy_beside_vllm(tiny, monkeypatch):
    """vLLM checks at start that its share of the GPU is free: the engine's copy of the weights is made on the CPU
    (cast to the body dtype, an untied head fp32) and streamed to vLLM in buckets; the PyTorch engine's is on the
    rank's device. The meta device stands in for a GPU."""
    model, tok, cfg = tiny
    made = []
    monkeypatch.setattr(infra_run, "device", lambda: torch.device("meta"))
    monkeypatch.setattr("infra.vllm_engine.VLLMEngine", lambda weights, **kw: made.append(weights))
    infra_run.make_engine(replace(cfg, engine="vllm", dtype="bfloat16"), model, tok, 0)
    params = dict(made[0].named_parameters())
    assert {p.device.type for p in params.values()} == {"cpu"}
    assert params["lm_head.weight"].dtype == torch.float32 and params["model.norm.weight"].dtype == torch.bfloat16
    monkeypatch.setattr(infra_run.engine, "TorchEngine", lambda weights, **kw: made.append(weights))
    infra_run.make_engine(replace(cfg, engine="torch"), model, tok, 0)
    assert {p.device.type for p in made[1].parameters()} == {"meta"}


def test_vllm_takes_only_what_the_gpu_has_free():
    """vLLM refuses to start when gpu_memory_utilization x total is more than is free (v1/worker/utils.py): its share
    is what is free, less what goes beside it, at most --gpu_memory_utilization; too little is one line."""
    GiB = 1 << 30
    assert vllm_share(0.9, 79 * GiB, 80 * GiB, 7 * GiB) == 0.9
    assert vllm_share(0.9, 62 * GiB, 80 * GiB, 7 * GiB) == pytest.approx(55 / 80)  # beside a trainer, or an engine
    with pytest.raises(ValueError, match="only 9.0 of 80 GiB of this GPU are free, 7.0 GiB of it needed beside vLLM"):
        vllm_share(0.9, 9 * GiB, 80 * GiB, 7 * GiB)


def test_an_8b_generator_fits_beside_vllms_share():
    """Qwen3-8B (bf16 body, untied fp32 head, 1 GiB buckets) on an 80 GB GPU at gpu_memory_utilization 0.9: what a
    generator rank puts beside vLLM's share at its first in-flight update fits the 8 GB left, margin included. The
    receive buffer is the fp32 head's bucket; the largest layer a reload rebuilds is the bf16 embedding (the head
    goes in directly)."""
    from infra.plan import GPU_GB, KNOWN_SHAPES, vllm_offshare_rows
    cfg = scalerl.Config(**scalerl.PRESETS["8b"])
    V, H = 151936, 4096
    rows = vllm_offshare_rows(cfg, KNOWN_SHAPES["Qwen/Qwen3-8B"])
    assert rows["receive buffer (the largest bucket)"] == 4 * V * H  # 2.49 GB
    assert rows["reload's copy of the largest layer"] == rows["LM head made fp32 (net)"] == 2 * V * H  # 1.24 GB
    assert sum(rows.values()) <= (1 - cfg.gpu_memory_utilization) * GPU_GB * 1e9, rows  # 7.7 of 8.0 GB


def watch_reload(worker):
    """Runs in vLLM's worker: from now on, count vLLM's reload set-ups and record the bytes of each layer a reload
    rebuilds (reload/layerwise.py: materialize_layer makes its meta tensors real; the loaded values are copied in)."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    seen, names = {"setups": 0, "rebuilt": {}}, {m: n for n, m in worker.get_model().named_modules()}
    init, materialize = layerwise.initialize_layerwise_reload, layerwise.materialize_layer

    def counted(model):
        seen["setups"] += 1
        return init(model)

    def rebuilt(layer, info):
        seen["rebuilt"][names[layer]] = sum(t.nbytes for t in get_layer_tensors(layer).values() if t.is_meta)
        return materialize(layer, info)
    layerwise.initialize_layerwise_reload, layerwise.materialize_layer, worker.seen = counted, rebuilt, seen
    worker.unwatch = init, materialize


def unwatch_reload(worker):
    from vllm.model_executor.model_loader.reload import layerwise
    layerwise.initialize_layerwise_reload, layerwise.materialize_layer = worker.unwatch


def seen_in_worker(worker):
    model = worker.get_model()
    return worker.seen, model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()


def test_one_reload_a_version_and_its_largest_copy_is_the_planned_one(tiny, monkeypatch):
    """A version loaded in many buckets is one vLLM reload (one set-up, one finalisation over every module), and the
    largest layer that reload rebuilds beside the live one is outside_share's row: here the bf16 embedding, its
    vocabulary padded to 2,048 rows; the fp32 head, larger still, goes straight into its parameter. The padded
    embedding waits for the end of the reload, after later buckets reused the buffer: it arrives exact."""
    from infra.vllm_engine import outside_share
    _, tok, cfg = tiny
    model = trainer.tiny_model(cfg, 2000)
    init = VLLMEngine.__init__  # 64 KB buckets, whatever the caller asks
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, *args, **kw: init(self, *args, **{
        **kw, "bucket_bytes": 64 << 10}))
    eng = vllm_engine(model, tok, cfg, dtype="bfloat16")
    eng.llm.collective_rpc(watch_reload)
    try:
        new = trainer.tiny_model(replace(cfg, seed=9), 2000)
        eng.load_weights(new, 1)
        seen, embed, head = eng.llm.collective_rpc(seen_in_worker)[0]
        setups, rebuilt = seen["setups"], dict(seen["rebuilt"])  # (in this process: the worker's own dict)
        eng.load_weights({"lm_head.weight": model.lm_head.weight}, 2)  # a second version: its own one reload
        assert eng.llm.collective_rpc(seen_in_worker)[0][0]["setups"] == 2
    finally:
        eng.llm.collective_rpc(unwatch_reload)  # the worker is this process: vLLM's own functions back
    assert len(list(buckets(((n, p, p.dtype) for n, p in eng.model.named_parameters()), 64 << 10))) == cfg.n_layer + 3
    assert setups == 1
    assert rebuilt.get("lm_head", 0) == 0 and rebuilt["model.embed_tokens"] == 2048 * cfg.n_embd * 2
    assert max(rebuilt.values()) == eng.outside["reload's copy of the largest layer"] == outside_share(
        eng.model, 64 << 10)["reload's copy of the largest layer"]
    assert torch.equal(embed[:2000], new.model.embed_tokens.weight.detach().bfloat16())
    assert head.dtype == torch.float32 and torch.equal(head[:2000], new.lm_head.weight.detach())


def perturbed(model, tok):
    new = copy_of(model, tok)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new


def assert_old_kv_then_new_weights(model, new, s):
    """A completion that crossed an in-flight update: tokens 0..a-1 recorded as version 0 and sampled with the old
    weights, a.. as version 1 and sampled with the new ones on the old weights' KV cache."""
    a = s.versions.index(1)
    assert s.versions == [0] * a + [1] * (len(s.tokens) - a) and not any(s.forced)
    # Reference: the old weights' KV cache for the prompt and the first a-1 tokens (the last old token is fed to
    # the model after the update), the new weights from there on: what an in-flight update computes.
    P, ids = len(s.prompt_tokens), torch.tensor([s.prompt_tokens + s.tokens])
    with torch.no_grad():
        cache = model.model(input_ids=ids[:, :P + a - 1], use_cache=True).past_key_values
        h = new.model(input_ids=ids[:, P + a - 1:-1], past_key_values=cache, use_cache=True).last_hidden_state
    ref = losses.head_logprobs(h, new.lm_head.weight, ids[:, P + a:])[0]
    got = torch.tensor(s.logprobs[a:])
    assert (ref - got).abs().max() < 5e-5, (ref - got).abs().max()  # measured: 2.9e-6
    assert (trainer_logprobs(model, s)[a:] - got).abs().max() > 1e-2  # not the old weights' (measured: >= 0.87)
    assert (trainer_logprobs(model, s)[:a] - torch.tensor(s.logprobs[:a])).abs().max() < 5e-5


def test_in_flight_update_keeps_kv_and_uses_new_weights(tiny):
    model, tok, cfg = tiny
    new = perturbed(model, tok)
    eng = vllm_engine(model, tok, cfg, interrupt=False, think_min=40, think_max=40, slots=64)
    ts = templates(tok, 8)
    for t in ts:
        eng.add(t, 4)
    done = []
    for _ in range(4):
        done += eng.step()
    eng.load_weights(new, 1)  # between engine steps, 32 sequences running
    while eng.busy:
        done += eng.step()
    samples = [s for g in done for s in g]
    assert len(samples) == 32 and eng.version == 1
    crossed = [s for s in samples if s.versions[0] == 0 and s.versions[-1] == 1]
    assert len(crossed) >= 16, [s.versions for s in samples]
    for s in crossed:
        assert_old_kv_then_new_weights(model, new, s)


def test_child_process_engine_records_the_version_that_sampled_each_token(tiny, monkeypatch):
    """Under torchrun the engine core is a child process that steps on its own, ahead of our step(): outputs read
    after a weight load may have been sampled before it. Each token carries the version of the weights that sampled
    it (vLLM's weight_version stamp; the core is paused across the load, its requests and KV kept). Every load, the
    first one too, reaches the core in buckets, one RPC message each (msgpack's limit is 4 GiB; an 8B model is 16 GB),
    and gives the trainer's logprobs."""
    model, tok, cfg = tiny
    new = perturbed(model, tok)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)  # the engine sets it; restored after
    sent, rpc = [], vllm.LLMEngine.collective_rpc

    def spy(llm, method, *args, **kwargs):  # the bytes of each bucket sent to the core
        if getattr(method, "__name__", "") == "reload_in_worker" and not isinstance(kwargs["args"][0], str):
            sent.append(sum(memoryview(b).nbytes for b in kwargs["args"]))
        return rpc(llm, method, *args, **kwargs)
    monkeypatch.setattr(vllm.LLMEngine, "collective_rpc", spy)
    init = VLLMEngine.__init__  # child=True: what a torchrun rank gets; 64 KB buckets, whatever the caller asks
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, *args, **kw: init(self, *args, **{
        **kw, "child": True, "bucket_bytes": 64 << 10}))
    eng = vllm_engine(model, tok, cfg, interrupt=False, think_min=40, think_max=40, slots=64)
    assert eng.child
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    # the embedding, each decoder layer (over 64 KB), the final norm with the head; torch.save's headers on top
    assert len(sent) == model.config.num_hidden_layers + 2 and max(sent) < layer + (16 << 10) and sum(sent) > size, \
        sent
    eng.llm.collective_rpc(watch_reload)
    for t in templates(tok, 8):
        eng.add(t, 4)
    done = []
    for _ in range(4):
        done += eng.step()
    ahead, until = eng.llm.engine_core.outputs_queue, time.time() + 30  # the core's outputs we have not read yet
    while ahead.qsize() < 3 and time.time() < until:
        time.sleep(0.001)
    read = {id(r.sample): len(r.sample.tokens) for r in eng.live.values()}  # tokens read before the update
    eng.load_weights(new, 1)
    assert len(sent) == 2 * (model.config.num_hidden_layers + 2)
    assert eng.llm.collective_rpc(seen_in_worker)[0][0]["setups"] == 1  # one reload in the core for all the buckets
    while eng.busy:
        done += eng.step()
    samples = [s for g in done for s in g]
    assert len(samples) == 32 and eng.version == 1
    # tokens the core sampled before the update and our step() read after it: recorded as version 0
    assert sum(s.versions.count(0) > read.get(id(s), len(s.tokens)) for s in samples) >= 16
    crossed = [s for s in samples if s.versions[0] == 0 and s.versions[-1] == 1]
    assert len(crossed) >= 16, [s.versions for s in samples]
    for s in crossed:
        assert_old_kv_then_new_weights(model, new, s)


def test_a_resumed_engine_records_the_version_it_was_given(tiny):
    """A resume sets the engine's version without loading weights (the model already holds them): vLLM's stamp,
    which sampled tokens are recorded with, follows."""
    model, tok, cfg = tiny
    eng = vllm_engine(model, tok, cfg)
    eng.version = 7
    samples = [s for g in eng.generate(templates(tok, 4), 2) for s in g]
    assert {v for s in samples for v in s.versions} == {7}


def test_prefix_cache_hits_only_blocks_of_the_same_policy_version(tiny):
    """Prefix caching is on, each request salted with the version it was submitted under: a group after another
    with the same prompt reuses its full blocks; after an update the same prompt hits nothing of the old version
    and its behaviour logprobs are the new weights' (then its own version's blocks are reused again)."""
    model, tok, cfg = tiny
    new = perturbed(model, tok)
    eng = vllm_engine(model, tok, cfg, interrupt=False, think_min=8, think_max=8, max_prompt=300)
    bs = eng.llm.vllm_config.cache_config.block_size  # 128 on CPU, 16 on CUDA
    question = data.format_prompt(data.arith_problems(1, seed=1)[0].question, tok)
    prompt = (data.encode(tok, "1+1=2 " * 300) + data.encode(tok, question))[-(2 * bs + 8):]  # 2 full blocks + 8
    assert len(prompt) <= 300
    cached, step = {}, eng.llm.step

    def spy():  # vLLM's public per-request count of prompt tokens served from the prefix cache
        outs = step()
        for o in outs:
            cached.setdefault(o.request_id, o.num_cached_tokens)
        return outs
    eng.llm.step = spy

    def group(g, n=4):
        seen = set(cached)
        samples = eng.generate([Sample(0, g, prompt)], n)[0]
        return samples, [c for r, c in cached.items() if r not in seen]
    full = (len(prompt) - 1) // bs * bs  # vLLM recomputes at least the last prompt token
    first, _ = group(0)
    again, hits = group(1)
    assert hits == [full] * 4 and full >= 2 * bs, hits
    assert free_error(model, first + again) < 5e-5
    eng.load_weights(new, 1)
    after, hits = group(2)
    assert hits[0] == 0 and set(hits) <= {0, full}, hits  # siblings may share the new version's blocks
    assert free_error(new, after) < 5e-5
    assert all(set(s.versions) == {1} for s in after)
    later, hits = group(3)
    assert hits == [full] * 4, hits
    assert free_error(new, later) < 5e-5


def test_an_interruption_counts_the_prefix_it_prefills_again(tiny):
    """A forced interruption is an abort and a resubmission with the phrase (vLLM cannot append to a running request):
    what of its prefix is not in the prefix cache is computed again, all of it after an update (another salt), and
    stats["reprefill_tokens"] counts it as vLLM reports it. Here prompt and thinking fill no 128-token block (vLLM's
    on CPU), so every interrupted completion, before or after the update, computes its whole prefix again."""
    model, tok, cfg = tiny
    eng = vllm_engine(model, tok, cfg, think_min=6, think_max=10, answer_budget=5, seed=7)
    assert eng.llm.vllm_config.cache_config.block_size > cfg.max_prompt + 10
    for t in templates(tok, 24):
        eng.add(t, 1)
    done = eng.step() + eng.step()
    eng.load_weights(perturbed(model, tok), 1)
    while eng.busy:
        done += eng.step()
    prefixes = [len(s.prompt_tokens) + s.forced.index(True) for g in done for s in g if s.interrupted]
    assert len(prefixes) >= 8 and eng.stats["reprefill_tokens"] == sum(prefixes)


def test_an_interrupted_request_keeps_its_place_in_vllms_queue(tiny, monkeypatch):
    """A KV cache of 2 full-length sequences beside 16 slots: vLLM queues the requests it cannot hold. An interrupted
    request's resubmission (a new request: vLLM cannot append the phrase to a running one) keeps its first arrival as
    its priority, so it starts again before every later request still waiting (FCFS would put it behind them all),
    and its wait is counted (stats resubmits, resubmit_wait_us)."""
    model, tok, cfg = tiny
    init = VLLMEngine.__init__
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, *args, **kw: init(self, *args, **{**kw, "kv_seqs": 2}))
    eng = vllm_engine(model, tok, cfg, think_min=6, think_max=10, answer_budget=5, slots=16, seed=7)
    first, steps, step = {}, [0], eng.llm.step  # request id -> the engine step of its first token

    def spy():
        outs = step()
        first.update((o.request_id, steps[0]) for o in outs if o.outputs[0].token_ids and o.request_id not in first)
        steps[0] += 1
        return outs
    eng.llm.step = spy
    for t in templates(tok, 16):
        eng.add(t, 1)
    later = {}  # a resubmission's id -> the requests that arrived after it and were waiting when it was resubmitted
    while eng.busy:
        eng.step()
        for rid in set(eng.resubmitted) - set(later):
            later[rid] = [r for r in eng.live if r not in first and eng.order[r] > eng.order[rid]]
    assert max(len(rs) for rs in later.values()) >= 8, later  # a queue formed: more requests than the cache holds
    ahead = {rid: [r for r in rs if first[r] < first[rid]] for rid, rs in later.items()}
    assert not any(ahead.values()), ahead
    assert eng.stats["resubmits"] == len(later) and eng.stats["resubmit_wait_us"] > 0


def test_forced_interruption_is_masked_and_answer_budget_holds(tiny):
    model, tok, cfg = tiny
    cfg = replace(cfg, think_min=6, think_max=10, answer_budget=5)
    eng = vllm_engine(model, tok, cfg, seed=7)
    samples = [g[0] for g in eng.generate(templates(tok, 24), 1)]  # one per group: admission order is known
    rng = random.Random(7)  # the engine's budget_rng, replayed: one thinking budget per completion, in order
    budgets = [rng.randint(cfg.think_min, cfg.think_max) for _ in samples]
    phrase, close = data.encode(tok, data.INTERRUPT_PHRASE), data.encode(tok, data.THINK_CLOSE)[0]
    assert sum(s.interrupted for s in samples) >= len(samples) // 2
    for s, b in zip(samples, budgets):
        if not s.interrupted:
            assert close in s.tokens[:b] or s.tokens[-1] == tok.eos_token_id
            continue
        assert s.tokens[b:b + len(phrase)] == phrase and close not in s.tokens[:b]  # at the budget, not before
        assert s.forced == [False] * b + [True] * len(phrase) + [False] * (len(s.tokens) - b - len(phrase))
        assert all(lp == 0.0 for lp, f in zip(s.logprobs, s.forced) if f)
        answer = s.tokens[b + len(phrase):]
        assert len(answer) <= cfg.answer_budget
        assert s.truncated == (len(answer) == cfg.answer_budget and answer[-1] != tok.eos_token_id)
    assert free_error(model, samples) < 5e-5  # the answer after the phrase too (its request was resubmitted)


def test_temperature_below_vllm_floor_is_refused(tiny, capsys):
    model, tok, cfg = tiny
    with pytest.raises(ValueError, match="floor"):
        VLLMEngine(model, slots=4, max_prompt=8, think_budget=(4, 4), answer_budget=4,
                               eos_id=tok.eos_token_id, think_close_ids=data.encode(tok, data.THINK_CLOSE),
                               temperature=1e-3)
    with pytest.raises(SystemExit) as e:  # what a run with --temperature=1e-3 --engine=vllm sees: one line, exit 2
        vllm_engine(model, tok, cfg, temperature=1e-3)
    assert e.value.code == 2 and "floor" in capsys.readouterr().err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs' base directory: its warm-start cache is the session's, shared with the torch engine's runs."""
    return run_base(tmp_path_factory, "vllm_runs")


def run(out, *args):
    p = run_command(scalerl_command("--engine=vllm", f"--out_dir={out}", *args), timeout=1500)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return read_jsonl(out / "metrics.jsonl"), p.stdout


@pytest.fixture(scope="module")
def learning_run(runs):
    """One `python scalerl.py --engine=vllm` run that two tests read: the setting of tests/test_learns.py (the torch
    engine's learning test) with a checkpoint midway, on the 4-layer tiny model, its thinking budget drawn from 6-16
    tokens (12-16 there): a budget of 6 interrupts a 6-character trace before its </think>, so a few requests a step
    are resubmitted (at 12-16 only a rambling trace is, and a run may have none)."""
    rows, out = run(runs / "learns", *LEARNS, "--ckpt_every=20", "--n_layer=4", "--think_min=6")
    return runs / "learns", rows, out


@pytest.mark.slow
def test_smoke_run_with_vllm_engine(learning_run):
    path, rows, out = learning_run
    assert "engine vllm" in out
    assert [r["step"] for r in rows if "reward" in r] == list(range(1, 41)) and "--max_steps=40" in LEARNS
    assert json.load(open(path / "config.json"))["config"]["engine"] == "vllm"
    assert torch.load(path / "ckpt.pt", weights_only=True)["step"] == 40
    train = [r for r in rows if "reward" in r]  # the engine's resubmissions, each step's
    assert sum(r["reprefill_tokens"] for r in train) > 0 and any(r["resubmit_wait_s"] for r in train)


@pytest.mark.slow
def test_reward_rises_with_vllm_engine(learning_run):
    # The setting and the bar of tests/test_learns.py (the torch engine's learning test).
    _, rows, _ = learning_run
    reward = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last - first > 0.15, (first, last, reward)
    assert all(r["lag_max"] <= 1 for r in rows if "lag_max" in r)


@pytest.mark.slow
def test_torchrun_generator_rank_on_vllm_through_a_preemption(runs):
    """Under torchrun the vLLM engine core runs in a child process of its rank (a second torch.distributed world
    cannot live in the rank's own process); weights reach it in flight after every optimizer step. torchrun's SIGTERM
    reaches each worker's process group: the engine core has left it, so the generator serves the trainer until it
    has checkpointed (without that, the core died at once and trainer rank 0 lost its generator mid-step); --resume
    then logs every step once."""
    import os
    import signal
    import subprocess
    from conftest import ENV, ROOT
    out = runs / "preempted"
    cmd = torchrun_command("--standalone", "--nproc_per_node=2", "scalerl.py", "--config=smoke", "--threads=1",
                           "--engine=vllm", f"--out_dir={out}", "--max_steps=8", "--eval_every=3", "--ckpt_every=100",
                           "--zero_var_filter=false")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    t_end = time.time() + 900
    while proc.poll() is None and time.time() < t_end and not (
            (out / "metrics.jsonl").exists() and sum("reward" in r for r in read_jsonl(out / "metrics.jsonl",
                                                                                       torn_ok=True)) >= 2):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: torchrun then signals each worker's process group
    stdout, stderr = proc.communicate(timeout=600)
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 2 <= step < 8 and f"stopped by SIGTERM at step {step}" in stdout, stdout[-2000:] + stderr[-3000:]
    assert "generator ranks [1]" in stdout and "engine vllm" in stdout
    p = run_command(cmd + ["--resume"], timeout=1500, env=dict(OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in train] == list(range(1, 9)) and sum(r["gen_tok_s"] for r in train) > 0
    assert all(r["policy_version"] == r["step"] and r["lag_max"] <= 2 for r in train)
    assert any(r["lag_max"] >= 1 for r in train)  # the generator went on while the trainer stepped
    # the generator's resubmissions reach trainer rank 0's log through the job's counters
    waits = [r["resubmit_wait_s"] for r in train if r["resubmit_wait_s"] is not None]
    assert sum(r["reprefill_tokens"] for r in train) > 0 and waits and min(waits) > 0


@pytest.mark.slow
def test_a_generator_rank_that_cannot_start_names_itself(runs):
    """Only the generator rank builds a vLLM engine under torchrun, so only it refuses a temperature below vLLM's
    floor, and its line names it."""
    out = runs / "cannot_start"
    cmd = torchrun_command("--standalone", "--nproc_per_node=2", "scalerl.py", "--config=smoke", "--threads=1",
                           "--engine=vllm", "--temperature=0.005", f"--out_dir={out}", "--dist_timeout=120")
    p = run_command(cmd, timeout=900, env=dict(OMP_NUM_THREADS="1"))
    assert p.returncode != 0
    assert "error: rank 1: temperature 0.005 is below vLLM's floor 0.01" in p.stderr, p.stderr[-3000:]


def test_weights_loaded_bucket_by_bucket_give_the_trainers_logprobs(tiny):
    """An engine built from other weights, then updated in memory one small bucket at a time, as a generator rank
    takes an update (infra.dist.buckets: whole decoder layers; vLLM reloads in place, the other layers untouched):
    its behaviour logprobs are then the trainer's, to the same tolerance as an engine built from the model."""
    model, tok, cfg = tiny
    eng = vllm_engine(trainer.tiny_model(replace(cfg, seed=5), len(tok)), tok, cfg)
    parts = list(buckets(((n, p, p.dtype) for n, p in model.named_parameters()), 64 << 10))
    assert len(parts) >= cfg.n_layer + 1  # a bucket per decoder layer at least
    for part in parts:
        eng.load_weights({n: t for n, t, _ in part}, 1)
    samples = [s for g in eng.generate(templates(tok, 8), 4) for s in g]
    assert all(set(s.versions) == {1} for s in samples)
    assert free_error(model, samples) < 5e-5


def test_a_bucket_crosses_vllms_rpc_as_bytes_and_arrives_exact():
    """Under torchrun on the CPU vLLM's engine core is a child process: VLLMEngine.load_weights sends each bucket (whole
    decoder layers) as bytes through vLLM's own msgpack serialisation, between one "begin" and one "end" of the reload,
    and the worker gets the same tensors (bf16 body, fp32 head). No engine: load_weights runs on a stand-in for vLLM's
    RPC, which decodes what crossed."""
    import io
    from types import SimpleNamespace
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    model = trainer.tiny_model(scalerl.Config(), 40).bfloat16()
    model.lm_head.float()
    got, steps = [], []

    class LLM:  # SyncMPClient.collective_rpc: the arguments go to the core as msgpack
        def collective_rpc(self, method, args=()):
            wire = MsgpackEncoder().encode(args)
            (bucket,) = MsgpackDecoder().decode(wire)
            if isinstance(bucket, str):
                steps.append(bucket)
                return
            sent.append(sum(memoryview(b).nbytes for b in wire))
            got.append(torch.load(io.BytesIO(bucket), weights_only=True))
    eng, sent = SimpleNamespace(child=True, paused=True, model=model, bucket_bytes=64 << 10, llm=LLM(), ipc=False,
                                device=torch.device("cpu"), bufs={}), []
    VLLMEngine.load_weights(eng, model, 1)
    runs = list(buckets(((n, p, p.dtype) for n, p in model.named_parameters()), 64 << 10))
    assert [[n for n, _ in b] for b in got] == [[n for n, _, _ in r] for r in runs]
    assert len(got) >= model.config.num_hidden_layers + 1  # a bucket per decoder layer at least
    assert steps == ["begin", "end"]
    want = dict(model.named_parameters())
    for n, t in (x for b in got for x in b):
        assert t.dtype == want[n].dtype and torch.equal(t, want[n])
    # each message carries its bucket only, not the receive buffer it was read from
    for run, size in zip(runs, sent):
        assert size < sum(p.numel() * p.element_size() for _, p, _ in run) + (16 << 10), sent
