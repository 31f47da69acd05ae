"""infra/run.py: a run's life around the loop in scalerl.main, for one process and for every rank under torchrun: the
start (rank 0 checks the run directory before anything is written or any rank joins), the engines, the held-out
evaluation, the end. What a run guarantees: docs/faults.md, docs/torchrun.md and docs/gpus.md."""
import copy
import json
import math
import os
import time

import torch

import data
import engine
import pipeline_rl
import sigmoid_fit
import trainer
from infra import dist, fail, print0, rundir, sources


def device():
    return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")


def busy_cores(seconds=0.2):
    """Cores busy with other work now: /proc/stat's share of non-idle time over `seconds` (the load average lags a
    minute behind, so a job that just ended would still count), else the 1-minute load average."""
    def sample():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total, idle = sample()
        return (os.cpu_count() or 1) * (1 - (idle - idle0) / max(total - total0, 1))
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


def set_threads(cfg):
    """Two threads run the tiny model's matmuls 1.7x faster in one process; under torchrun each rank takes one. So does
    a machine whose cores are busy at start: beside two busy processes on 2 cores, the smoke run's first steps took
    68 and 39 s with two threads, 1.6 and 0.9 s with one."""
    one_process = int(os.environ.get("WORLD_SIZE", 1)) == 1
    torch.set_num_threads(cfg.threads or (2 if one_process and (os.cpu_count() or 1) - busy_cores() >= 1.5 else 1))


def start(cfg):
    """(Dist, the checkpoint on rank 0 or None, the resume point or None on every rank)."""
    # before CUDA starts: segments that grow in place, not a new one per size (infra.plan's margin assumes them)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    set_threads(cfg)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    # the run directory and ckpt.pt live on rank 0's node
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        rundir.check_run_dir(cfg)
    ckpt = rundir.load_checkpoint(ckpt_path) if cfg.resume and rank0 else None
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        if rank0 and world > 1 and torch.cuda.is_available():
            # as --dry_run plans it: --gen_share's split, or fewer generators where its trainer ranks would not fit
            # these GPUs; a job whose evaluations would outlast --eval_every steps refused
            from infra.plan import settle
            gb = torch.cuda.get_device_properties(0).total_memory / 1e9
            g, cfg.dist_timeout, problem = settle(cfg, world, gb)
            if problem:
                fail(problem)
            if g and not cfg.gen_ranks and g != len(dist.roles(world, 0, cfg.gen_share)[1]):
                cfg.gen_ranks = g
                print(f"generator ranks: {g} of {world}, not --gen_share's {cfg.gen_share}: the most whose trainer "
                      f"ranks fit {gb:.0f} GB GPUs (see --dry_run)")
        cfg.dist_timeout = cfg.dist_timeout or 1800.0  # 0: 30 min of a rank's silence
        job = dist.dist_init(cfg.gen_ranks, cfg.dist_timeout, cfg.gen_share)
    except ValueError as e:  # a split that leaves no trainer rank
        fail(str(e))
    if ckpt and (ckpt.get("world", 1), ckpt.get("generators", [])) != (job.world, job.generators):
        fail(f"checkpoint {ckpt_path} was written by {ckpt.get('world', 1)} process(es) with generator ranks "
             f"{ckpt.get('generators', [])}, this run has {job.world} with {job.generators}; resume with the same "
             "torchrun --nproc_per_node/--nnodes and --gen_ranks")
    # under torchrun the job's counters continue from the checkpoint; groups in flight then are regenerated
    if ckpt and job.world > 1:
        admitted = ckpt["version"] * cfg.batch_prompts + ckpt["stale"]
        for key, n in (("version", ckpt["version"]), ("admitted", admitted), ("dropped", ckpt["stale"])):
            dist.counter(job, key, n)
    resume = {k: ckpt.get(k) for k in ("step", "version", "stale", "shards", "shards_opt")} if ckpt else None
    resume = dist.share(job, resume, everyone=True)
    if job.world > 1:
        shared_run_dir(cfg, job)
    return job, ckpt, resume


def shared_run_dir(cfg, job):
    """--out_dir must be one folder for the whole job (on several nodes, a shared filesystem): every rank writes its
    part of a checkpoint there and --resume reads them all. Rank 0 leaves a mark there; every rank looks for it."""
    mark = os.path.join(cfg.out_dir, f".shared-{os.getpid()}-{time.time_ns()}")
    if job.rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        open(mark, "w").close()
    mark = dist.share(job, mark, everyone=True)
    seen = [None] * job.world
    with dist.waiting_for(job, "every rank's view of the run directory"):
        torch.distributed.all_gather_object(seen, os.path.exists(mark))
    blind = [r for r, ok in enumerate(seen) if not ok]
    if job.rank == 0:
        os.remove(mark)
    if blind and job.rank == 0:
        fail(f"ranks {blind} do not see rank 0's run directory {cfg.out_dir} (a file rank 0 wrote there is missing on "
             "theirs); each trainer rank writes its checkpoint shard there, each generator rank its curriculum, and "
             "--resume reads them all: put --out_dir on a filesystem every node shares")
    if blind:
        raise SystemExit(2)  # rank 0 says why


def place(cfg, job, model, ckpt, resume):
    """The checkpoint's weights, read by each rank (not broadcast: 33 GB to each at 8B): a generator rank's in full
    (torch/distributed/checkpoint/state_dict_loader.py:125, no_dist), on the CPU; a trainer rank's shard: `restore`."""
    if resume and (job.world == 1 or job.rank in job.generators):
        rundir.load_weights(model, ckpt or resume, cfg.out_dir)
    elif cfg.model == "tiny" and not resume and job.world > 1:
        # every rank takes rank 0's weights (its warm start), in place
        with dist.waiting_for(job, "rank 0's initial weights"):
            for t in model.state_dict().values():
                torch.distributed.broadcast(t, src=0)
    model.to("cpu" if job.rank in job.generators else device())


def make_engine(cfg, model, tok, seed):
    """A generation engine (--engine) with its own copy of `model`, the run's budgets and sampling."""
    # vLLM loads its own copy from ours in buckets: ours stays on the CPU, vLLM needs the GPU's free memory at start
    dtype, dev = getattr(torch, cfg.dtype), device() if cfg.engine == "torch" else torch.device("cpu")
    head = {id(p) for p in model.get_output_embeddings().parameters()}  # weight, and a bias if it has one
    # an untied FP32 head stays fp32 (Sec. 3.2); the rest takes the body dtype, buffers (RoPE) stay as they are
    fp32 = head if cfg.fp32_head and id(model.get_input_embeddings().weight) not in head else set()
    cast = {id(p): torch.nn.Parameter(p.detach().to(dev, torch.float32 if id(p) in fp32 else dtype), False)
            for p in model.parameters()}
    # deepcopy takes each parameter from its memo, already cast: never a second fp32 copy on the device
    weights = copy.deepcopy(model, memo=cast).to(dev)
    # the interruption phrase, then </think> encoded on its own, so the stop rules see the thinking close (App. A.10)
    close = data.encode(tok, data.THINK_CLOSE)
    phrase = data.encode(tok, data.INTERRUPT_PHRASE.removesuffix(data.THINK_CLOSE))
    rules = dict(slots=cfg.slots, max_prompt=cfg.max_prompt, think_budget=(cfg.think_min, cfg.think_max),
                 answer_budget=cfg.answer_budget, eos_id=tok.eos_token_id, temperature=cfg.temperature,
                 think_close_ids=close, interrupt_ids=phrase + close if cfg.interrupt else None,
                 head_dtype=torch.float32 if cfg.fp32_head else dtype, seed=seed)
    if cfg.engine == "torch":
        return engine.TorchEngine(weights, **rules)
    # vLLM's presence is checked with the options (cli.validate)
    from infra.vllm_engine import VLLMEngine
    try:
        return VLLMEngine(weights, gpu_share=cfg.gpu_memory_utilization, bucket_bytes=cfg.sync_bucket_mb << 20,
                          **rules)
    except ValueError as e:
        fail(str(e))


def rollouts(cfg, job, model, tok, train, tasks, seed):
    """The generating side of this process (a generator rank: its share of the training prompts)."""
    if job.rank in job.generators:
        train = train[job.generators.index(job.rank)::len(job.generators)]
    pool = pipeline_rl.make_pool(train, tasks, cfg.code_frac, seed=seed, npr=cfg.npr, npr_threshold=cfg.npr_threshold,
                                 zero_var=cfg.zero_var_filter)
    return pipeline_rl.Rollouts(make_engine(cfg, model, tok, seed + job.rank), pool, tok, cfg.max_prompt)


def batch_source(cfg, job, model, tok, train, tasks, seed):
    """One process's Scheduler, or under torchrun the TrainerLink to the generator ranks."""
    if job.world > 1:
        return dist.TrainerLink(job, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                                bucket_bytes=cfg.sync_bucket_mb << 20)
    return pipeline_rl.Scheduler(rollouts(cfg, job, model, tok, train, tasks, seed), mode=cfg.off_policy,
                                 k=cfg.max_lag, batch_prompts=cfg.batch_prompts, group_size=cfg.group_size,
                                 decode_per_step=cfg.decode_per_step)


def policy(cfg, job, model, tok):
    """(policy, AdamW): fp32 master weights, body and head computed in their own dtypes (Sec. 3.2) through FSDP2
    (sharded over the trainer ranks, mixed precision, or both); activation checkpointing per layer if asked."""
    body = getattr(torch, cfg.dtype)
    if cfg.act_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    pol = trainer.Policy(model, cfg.temperature, torch.float32 if cfg.fp32_head else body, tok.pad_token_id, body)
    if len(job.trainers) > 1 or body != torch.float32:
        from infra.plan import defers  # FSDP2 reduce-scatters once a step where the plan finds room (policy_gradient)
        dist.shard(pol, trainer.decoder_layers(model), job.groups.get("trainer") or dist.local_group(), body)
        pol.defer_sync = defers(cfg, job.world, len(job.trainers))
    return pol, trainer.optimizer(cfg, pol)


def restore(cfg, ckpt, resume, job, policy, opt, source):
    """(step, clock): on --resume the trainer's state, the source's counters, in one process the generating side."""
    clock = {k: ckpt.get(k, 0.0) if ckpt else 0.0 for k in ("device_hours", "cpu_hours")}
    if not resume:
        return 0, clock
    source.version, source.dropped_stale = resume["version"], resume["stale"]
    with rundir.fits(os.path.join(cfg.out_dir, "ckpt.pt")):
        rundir.load_trainer(cfg, job, policy, opt, ckpt, resume)
        if job.world == 1:
            source.rollouts.load_state_dict(ckpt["generating"])
            # the groups in flight at the checkpoint are regenerated; the engine was built from the checkpoint's weights
            source.admitted = resume["version"] * cfg.batch_prompts + resume["stale"]
            source.engine.version = resume["version"]
    if ckpt:
        torch.set_rng_state(ckpt["torch_rng"])
    print0(f"resumed {cfg.out_dir} at step {resume['step']} (in-flight completions are regenerated)")
    return resume["step"], clock


def held_out(rollouts, val):
    """The held-out prompts as group templates, built once through the same guard as training prompts."""
    templates = [t for i, p in enumerate(val) if (t := rollouts.template(p, -1 - i))]
    if not templates:
        fail(f"none of the {len(val)} held-out prompts could be built (see the warnings); check --task and "
             "--max_prompt")
    return templates


def progress(n):
    """A long evaluation (1,000 prompts x 16 at 14k tokens) says how far it is, every 30 s, with an ETA."""
    t0 = shown = time.time()

    def show(done):
        nonlocal shown
        if time.time() - shown > 30:
            shown = time.time()
            eta = (shown - t0) / done * (n - done)
            print0(f"  evaluating: {done}/{n} prompts done, eta {eta / 60:.1f}m", flush=True)
    return show


def held_out_line(row, tasks):
    return f"held-out pass rate {row['pass_rate']:.3f}{rundir.per_task(row, 'pass_rate', tasks)}"


class Evaluator:
    """The loop's held-out evaluation (mean@eval_samples, Sec. 2.1), logged by trainer rank 0 with the step's clock;
    under torchrun asked of the generator ranks, their rows logged by `collect`."""
    def __init__(self, cfg, job, model, tok, val, tasks, seed, source, log):
        self.cfg, self.job, self.tasks, self.seed, self.source, self.log = cfg, job, tasks, seed, source, log
        if job.world == 1:
            self.engine, self.templates = make_engine(cfg, model, tok, seed + 1), held_out(source.rollouts, val)

    def __call__(self, step, policy):
        if self.job.rank != 0:
            return ""
        if self.job.world > 1:
            self.source.ask_eval(self.source.version, dict(step=step, **self.log.clock))
            return "held-out evaluation asked of the generator ranks"
        seed = self.seed + 7919 * step
        with self.log.timer("evaluation"):
            self.engine.load_weights(policy.state(), self.source.version)
            results = pipeline_rl.evaluate(self.engine, self.source.rollouts, self.templates, self.cfg.eval_samples,
                                           seed, progress(len(self.templates)) if step == 0 else None)
            row = pipeline_rl.pass_rates(results, self.tasks)
            self.log.write(dict(step=step, **self.log.clock, **row, eval=True))
        return held_out_line(row, self.tasks)

    def collect(self, until=0):
        """Under torchrun, trainer rank 0 logs the rows the generator ranks have sent (TrainerLink.evals); the other
        trainer ranks wait at a gate meanwhile, not in the collective after it."""
        if self.job.world == 1:
            return
        for row, results, versions in self.source.evals(until) if self.job.rank == 0 else ():
            pr = pipeline_rl.pass_rates(results, self.tasks)
            self.log.write(dict(row, **pr, eval_versions=versions, eval=True))
            print(f"step {row['step']:4d} | {held_out_line(pr, self.tasks)} (generator ranks)", flush=True)
        dist.gate(self.job, "trainer rank 0's evaluation rows")


def generator_rank(cfg, job, rollouts, val, resume):
    """A generator rank's job (dist.run_generator): its curriculum restored on --resume, its held-out share."""
    state_path = os.path.join(cfg.out_dir, f"generator{job.rank}.pt")
    if resume:
        rollouts.engine.version = resume["version"]
        if os.path.exists(state_path):
            with rundir.fits(state_path):
                rollouts.load_state_dict(rundir.load_checkpoint(state_path, want=("version",)))
        else:
            print(f"warning: {state_path} is missing: this generator rank restarts its curriculum", flush=True)
    mine = held_out(rollouts, val)[job.generators.index(job.rank)::len(job.generators)]
    evaluate = dist.HeldOut(rollouts, mine, cfg.eval_samples, round(cfg.eval_share * cfg.slots))
    rundir.Preemption.started = True
    dist.run_generator(job, rollouts, mode=cfg.off_policy, k=cfg.max_lag, batch_prompts=cfg.batch_prompts,
                       group_size=cfg.group_size, save_every=cfg.ckpt_every, state_path=state_path,
                       bucket_bytes=cfg.sync_bucket_mb << 20, held_out=evaluate)
    torch.distributed.destroy_process_group()


def finish(cfg, job, step, bad_run, stop, saved, source, evaluate, policy, opt, model, tok, log):
    """A stop's checkpoint (unless `saved`), then the evaluations of published versions logged, the generators stopped,
    the policy exported, the summary, and the sigmoid fit of the run's own curve (Sec. 2.1), one per task (Sec. 7)."""
    if stop and not saved:
        rundir.save_checkpoint(cfg, step, log.clock, source, job, policy, opt)
    # every trainer rank takes part in the gathers (rank 0 keeps the tensors), before rank 0 alone waits for the last
    # evaluations: they take every generator slot now, as long as they need
    final = {name: t.to(dtype).cpu() for name, t, dtype in policy.weights() if job.rank == 0} if not stop else None
    if job.world > 1 and job.rank == 0 and not stop:
        dist.counter(job, "stop", 1)
    evaluate.collect(until=step - cfg.eval_every + 1 if stop else math.inf)
    source.close()
    # under torchrun: summed over the generator ranks
    log.took["generation"] = source.totals()["gen_s"]
    if not stop and job.rank == 0:
        print(f"policy at step {step} written to {rundir.export_hf(cfg, model, tok, final)} (from_pretrained, vLLM)")
    if job.world > 1:
        torch.distributed.destroy_process_group()
    if stop:
        print0(f"stopped by {stop} at step {step}; checkpoint in {cfg.out_dir}: continue with --resume", flush=True)
        raise SystemExit(143)
    if job.rank != 0:
        return
    if bad_run >= cfg.max_nonfinite:
        fail(f"{bad_run} steps in a row had non-finite loss or gradients; the last good weights are checkpointed at "
             f"step {step} in {cfg.out_dir}; lower --lr or check the data, then --resume")
    log.summary()
    path, plot = os.path.join(cfg.out_dir, "metrics.jsonl"), os.path.join(cfg.out_dir, "curve.png")
    try:
        print(sigmoid_fit.analyze([path] + [(path, f"pass_rate_{t}") for t in log.tasks if len(log.tasks) > 1],
                                  plot=plot))
    except ValueError as e:
        print(f"sigmoid fit skipped: {e}")
    except OSError as e:
        rundir.write_failed(plot, e)
    if log.bound is not None:
        print(f"the thinking budget ({cfg.think_min}-{cfg.think_max} tokens) holds the error-free thinking of "
              f"{log.bound:.3f} of the held-out problems: A's ceiling on this task, whatever the method")


def tool(cfg):
    """No training: --dry_run (nothing loaded), or in one process --export or --eval_only of out_dir's checkpoint
    (else --model's own weights); an evaluation is seeded as the run's at that step, its row appended to evals.jsonl."""
    if cfg.dry_run:
        from infra.plan import plan
        return print(plan(cfg))
    set_threads(cfg)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = rundir.load_checkpoint(ckpt_path) if os.path.exists(ckpt_path) else None
    if cfg.export and not ckpt:
        fail(f"--export: no checkpoint at {ckpt_path}; pass the --out_dir of a run")
    train, val, tasks = sources.load_data(cfg)
    model, tok = sources.load_model(cfg, tasks)
    if ckpt:
        rundir.load_weights(model, ckpt, cfg.out_dir)
    if cfg.export:
        rundir.lock_run_dir(cfg.out_dir)
        path = rundir.export_hf(cfg, model, tok, model.state_dict())
        return print(f"policy at step {ckpt['step']} written to {path}")
    model.to(device())
    seed, step = cfg.seed if cfg.rl_seed < 0 else cfg.rl_seed, ckpt["step"] if ckpt else 0
    scorer = pipeline_rl.Rollouts(make_engine(cfg, model, tok, seed + 1), None, tok, cfg.max_prompt)
    templates, t0 = held_out(scorer, val), time.time()
    results = pipeline_rl.evaluate(scorer.engine, scorer, templates, cfg.eval_samples, seed + 7919 * step,
                                   progress(len(templates)))
    pr = pipeline_rl.pass_rates(results, tasks)
    row = dict(step=step, model=cfg.model if not ckpt else ckpt_path, **pr, eval_samples=cfg.eval_samples,
               time=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = os.path.join(cfg.out_dir, "evals.jsonl")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        rundir.write_failed(path, e)
    where = f"mean@{cfg.eval_samples}, {len(val)} prompts, step {step}"
    print(f"{held_out_line(pr, tasks)} ({where}) in {time.time() - t0:.0f}s; appended to {cfg.out_dir}/evals.jsonl")
