"""Where problems and models come from (`load_data`, `load_model`: a user's mistake ends the run in one line), and the
checkers that need a process: importing it fills data.CHECKERS with math, rg: and code. Its guarantees (the split, the
answer cells, checkers that never raise) are listed in docs/own-model-and-data.md, "Prompt sources and rewards"."""
import atexit
import dataclasses
import difflib
import importlib.util
import json
import os
import pathlib
import random
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import torch

import data
import trainer
from infra import fail, first_line, print0, sandbox

_RG_ENTRIES = {}  # Problem -> (reasoning-gym dataset, entry): the entry its scorer needs (Problem is frozen)


def _check_rg(problem, text, timeout):
    dataset, entry = _RG_ENTRIES.get(problem, (None, None))
    if dataset is None:  # not generated in this process: fall back to an exact match
        return text == problem.answer
    # scorers are plain Python: a daemon thread with a deadline bounds them (a stuck one lingers)
    scores = []
    thread = threading.Thread(target=lambda: scores.append(dataset.score_answer(answer=text, entry=entry)), daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(scores) and scores[0] >= 1.0


# The Math-Verify worker, run by `python -c` (it needs nothing of the project, and no torch): a JSON line [gold, pred]
# in, "1" or "0" out; bare gold answers ("3/4") parse as LaTeX math, and any failure is a failed check.
_MATH_WORKER_LOOP = r"""
import json, logging, sys
from math_verify import parse, verify
logging.disable(logging.WARNING)
gold_cache = {}
print("ready", flush=True)
for line in sys.stdin:
    try:
        gold, pred = json.loads(line)
        if gold not in gold_cache:
            gold_cache[gold] = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=None)
        ok = verify(gold_cache[gold], parse(pred, parsing_timeout=None), timeout_seconds=None)
    except Exception:
        ok = False
    print("1" if ok else "0", flush=True)
"""


class _MathWorker:
    """Math-Verify in a child process, ~1-5 ms a check. Its time-outs need the main thread and SymPy can hold the GIL
    in one C call (9^{9^{9^9}}), so a check past its deadline kills the child; the next check starts one (~1 s)."""
    proc, lock = None, threading.Lock()

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def check(self, problem, text, timeout):
        def read(wait):
            return self.proc.stdout.readline().strip() if select.select([self.proc.stdout], [], [], wait)[0] else None
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self.proc = subprocess.Popen([sys.executable, "-c", _MATH_WORKER_LOOP], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, encoding="utf-8")
                    read(120.0)  # "ready" once math-verify is imported; a worker that cannot start answers ""
                # answers are short; the tail keeps a final \boxed{} of a long one
                print(json.dumps([problem.answer, text[-2000:]]), file=self.proc.stdin, flush=True)
                out = read(timeout)
            except (OSError, ValueError):
                out = None
            if out is None:  # too slow or dead: start over on the next check
                self.stop()
            return out == "1"


_MATH_WORKER = _MathWorker()
atexit.register(_MATH_WORKER.stop)  # a child stuck in SymPy would not notice its parent leaving
data.CHECKERS.update({"math": _MATH_WORKER.check, "rg:": _check_rg, "code": sandbox.check_answer})


def _gsm8k_answer(text):  # (trace, answer) of an answer cell: "steps #### 1,234" -> ("steps ", "1234"); else ("", text)
    solution, hashes, tail = text.rpartition("####")
    number = data._NUMBER.search(tail.replace(",", ""))
    return (solution, number[0] if number else None) if hashes else ("", text)


def last_boxed(text):
    """Content of the last \\boxed{...} in text (nested braces allowed), or None."""
    _, found, tail = text.rpartition("\\boxed{")
    depth = 1
    for j, char in enumerate(tail if found else ""):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return tail[:j]
    return None


def _stdin_tests(cell):
    """A DeepCoder/TACO `tests` cell ([{input, output}], [[input, output]] or {inputs, outputs}, maybe as JSON) as a
    code answer, JSON [[stdin, stdout], ...], function tests left out; None if none."""
    try:
        raw = json.loads(cell) if isinstance(cell, str) else cell
        if isinstance(raw, dict):  # "fn_name": a function's tests
            raw = [] if raw.get("fn_name") else list(zip(raw["inputs"], raw["outputs"]))
        cases = [dict(input=c[0], output=c[1]) if isinstance(c, (list, tuple)) else c for c in raw]
        tests = [(c["input"], c["output"]) for c in cases if isinstance(c["input"], str)
                 and isinstance(c["output"], str) and c.get("testtype", "stdin") == "stdin"
                 and c.get("type", "stdin_stdout") == "stdin_stdout"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # unreadable tests: the row cannot be checked
    return json.dumps(tests) if tests else None


PRESETS = {  # name -> (hub dataset, config, question column, answer column, answer cell -> (trace, answer))
    "polaris": ("POLARIS-Project/Polaris-Dataset-53K", None, "problem", "answer", _gsm8k_answer),
    "gsm8k": ("openai/gsm8k", "main", "question", "answer", _gsm8k_answer),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", "problem", "solution", lambda s: (s, last_boxed(s))),
    "deepcoder": ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "problem", "tests", None),  # code
}
FILE_TYPES = (".json", ".jsonl", ".parquet")


def reach_hub(what, offline, instead):
    """Unless offline, fail in one line when the hub's host cannot be reached in 5 s: the libraries would retry for
    a minute or more before failing, or before falling back to their cache (docs/own-model-and-data.md)."""
    from huggingface_hub import constants
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        offline or socket.create_connection((url.hostname, url.port or {"https": 443}.get(url.scheme, 80)), 5).close()
    except OSError as e:
        fail(f"{what}the hub ({constants.ENDPOINT}) cannot be reached ({e.strerror or type(e).__name__}); set "
             f"HF_HUB_OFFLINE=1 to use what is cached, or {instead}")


def _read_file(path):
    """A local file's rows; a file that is not a list of records names itself and, where it can, the line."""
    if not path.endswith(FILE_TYPES) or not os.path.isfile(path):
        why = "does not exist" if path.endswith(FILE_TYPES) else "is not a .json, .jsonl or .parquet file"
        raise ValueError(f"dataset file {path!r} {why}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    raw, jsonl = pathlib.Path(path).read_bytes(), path.endswith(".jsonl")
    try:
        text = raw.decode("utf-8")
        rows = [json.loads(line) for line in text.split("\n") if line.strip()] if jsonl else json.loads(text)
    except UnicodeDecodeError as e:
        n = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path!r} line {n}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None
    except json.JSONDecodeError as e:  # a .jsonl line is parsed alone: its number is that of the first with its text
        n = text.split("\n").index(e.doc) + 1 if jsonl else e.lineno
        what = "one {column: value} object per line" if jsonl else "a list of {column: value} objects"
        raise ValueError(f"{path!r} line {n}: not valid JSON ({e.msg}); expected {what}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path!r}: expected a list of records, one {{column: value}} object per row")
    return rows


def _dataset_problems(source, data_path=None, prompt_key=None, answer_key=None, trace_key=None, config=None,
                      split="train"):
    """A preset's, hub dataset's or file's problems (trace_key: a column of worked solutions, in place of the answer's
    own); a row without a question or a checkable answer is skipped."""
    is_file = source.endswith(FILE_TYPES)
    if source not in PRESETS and not is_file and ("/" not in source or os.path.exists(source)):
        raise ValueError(f"unknown source {source!r}: expected arith, code, rg:<task> (a reasoning-gym task), a preset "
                         f"({', '.join(PRESETS)}; --data_path=FILE reads a local copy), a hub dataset owner/name or a "
                         f"file path ending .json/.jsonl/.parquet")
    hub, hub_config, prompt_col, answer_col, parse = PRESETS.get(source, (source, None, "problem", "answer",
                                                                          _gsm8k_answer))
    if data_path or is_file:
        rows = _read_file(data_path or source)
    else:
        import datasets
        reach_hub(f"--task={source}: ", datasets.config.HF_HUB_OFFLINE, "pass --data_path=FILE (a local copy)")
        try:  # offline: from the local cache
            rows = list(datasets.load_dataset(hub, config or hub_config, split=split))
        except Exception as e:  # offline, unreachable or unknown: one actionable line
            raise ValueError(f"cannot load dataset {source!r} (hub: {hub}): {first_line(e)}. Provide it locally: "
                             f"save it as .json/.jsonl/.parquet and pass --data_path=FILE (or the file as the "
                             f"source)") from None
    if not rows:
        raise ValueError(f"{data_path or source!r} is empty: no rows")
    code = parse is None or "tests" in rows[0] and answer_key in (None, "tests")  # DeepCoder-style
    if not code and importlib.util.find_spec("math_verify") is None:  # else every math reward would quietly fail
        raise ValueError(f"source {source!r} is checked with math-verify: pip install math-verify")
    prompt_key, answer_key = prompt_key or prompt_col, answer_key or ("tests" if code else answer_col)
    for key in (prompt_key, answer_key):  # in any row: a row without it is skipped and counted below
        if not any(key in r for r in rows):
            raise ValueError(f"dataset {source!r} has no column {key!r}; columns: {sorted(rows[0])}; pass "
                             f"--prompt_key/--answer_key")
    task, instruction = ("code", data.CODE_INSTRUCTION) if code else ("math", data.MATH_INSTRUCTION)
    problems = []
    for i, row in enumerate(rows):
        question, cell = str(row.get(prompt_key) or "").strip(), row.get(answer_key)
        trace, answer = ("", _stdin_tests(cell)) if code else ("", None) if cell is None else parse(str(cell))
        trace = str(row.get(trace_key) or "") if trace_key else trace
        if question and (answer or "").strip():  # answer: a str or None
            problems.append(data.Problem(i, question + instruction, answer.strip(), task, trace=trace.strip()))
    if not problems and code:
        raise ValueError(f"dataset {source!r}: no row has stdin/stdout tests in its {answer_key!r} column")
    if len(problems) < len(rows):
        print0(f"note: {len(rows) - len(problems):,} of {len(rows):,} rows of {source!r} skipped: no question in "
               f"{prompt_key!r} or no checkable answer in {answer_key!r}")
    return problems


def _reasoning_gym(source, size, seed, options):
    """Problems of the reasoning-gym task "rg:<name>" with `options` (its config's fields)."""
    from reasoning_gym.factory import DATASETS, create_dataset
    name, tasks = source[3:], sorted(DATASETS)
    if name not in tasks:
        raise ValueError(f"unknown reasoning-gym task {name!r}; {len(tasks)} tasks, e.g. "
                         f"{', '.join(difflib.get_close_matches(name, tasks, 6) or tasks[:8])}")
    known = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("size", "seed")]
    if set(options) - set(known):
        raise ValueError(f"reasoning-gym task {name!r} has no option {sorted(set(options) - set(known))}; its "
                         f"options: {', '.join(known)}")
    try:
        dataset = create_dataset(name, size=size, seed=seed, **options)
    except Exception as e:  # a bad value: the task's own message
        raise ValueError(f"reasoning-gym task {name!r} with options {options}: {first_line(e)}") from None
    entries = [dataset[i] for i in range(len(dataset))]
    problems = [data.Problem(i, e["question"] + data.RG_INSTRUCTION, str(e["answer"]), source)
                for i, e in enumerate(entries)]
    _RG_ENTRIES.update({p: (dataset, e) for p, e in zip(problems, entries)})
    return problems


def load_problems(source, n_val=1000, seed=0, n_train=None, **kw):
    """(train, val) lists of Problem. source: "arith" or "code" (kw: levels, error_rate), "rg:<task>" (its options
    as rg_options={...} or kw), both with n_train 5000 by default; a preset (data_path=FILE: a local copy), a hub
    "owner/name" or a .json/.jsonl/.parquet file (kw: prompt_key, answer_key, trace_key, config, split, data_path)."""
    rg, file_keys = source.startswith("rg:"), ("prompt_key", "answer_key", "data_path", "config", "split", "trace_key")
    allowed = ("levels", "error_rate") if source in ("arith", "code") else ("rg_options",) if rg else file_keys
    wrong = sorted(k for k in kw if (k in file_keys if rg else k not in allowed))
    if wrong:
        raise ValueError(f"unknown options for source {source!r}: {wrong}; expected {', '.join(allowed)}")
    n_train = 5000 if n_train is None and (rg or source in ("arith", "code")) else n_train  # generated sources
    if source in ("arith", "code"):
        make = data.arith_problems if source == "arith" else data.code_problems
        val = make(n_val, seed, split="val", start_id=0, **kw)
        return make(n_train, seed, split="train", start_id=n_val, **kw), val
    if rg:
        problems = _reasoning_gym(source, n_val + n_train, seed, {**(kw.pop("rg_options", None) or {}), **kw})
    else:
        problems = _dataset_problems(source, **kw)
    if len(problems) <= n_val:
        raise ValueError(f"source {source!r} has {len(problems)} usable prompts; holding out {n_val} for evaluation "
                         f"leaves none for training; pass a smaller --eval_prompts")
    random.Random(seed).shuffle(problems)
    val = problems[:n_val]
    seen = {p.question for p in val}  # the same question under another id must not leak into training
    return [p for p in problems[n_val:] if p.question not in seen][:n_train], val


def combine(parts):
    """One (train, val) from several sources' (train, val) pairs, ids shifted to stay unique across them."""
    train, val = [], []
    for part_train, part_val in parts:
        shift = max((p.id + 1 for p in train + val), default=0)
        moved = {p: dataclasses.replace(p, id=p.id + shift) for p in part_train + part_val}
        _RG_ENTRIES.update({moved[p]: _RG_ENTRIES[p] for p in moved if p in _RG_ENTRIES})
        train += [moved[p] for p in part_train]
        val += [moved[p] for p in part_val]
    return train, val


def load_data(cfg):
    """(train problems, held-out problems, task names). A mixture ("arith+code") gives each source an equal share of
    the held-out and training prompts, and each task its own curve (Sec. 7)."""
    sources = cfg.task.split("+")
    options = {k: getattr(cfg, k) for k in ("data_path", "prompt_key", "answer_key") if getattr(cfg, k)}
    options.update(json.loads(cfg.task_options or "{}"))
    own = {"arith": dict(levels=tuple(int(x) for x in cfg.levels.split(","))), "code": {}}  # built-ins' options
    try:
        train, val = combine([load_problems(src, n_val=max(1, cfg.eval_prompts // len(sources)), seed=cfg.seed,
                                            n_train=max(1, cfg.n_train // len(sources)), **own.get(src, options))
                              for src in sources])
    except ValueError as e:
        fail(str(e))
    # a prompt of more characters than --max_prompt tokens of 256 characters cannot fit: dropped untokenized (the
    # length check after tokenizing would hold a 5 MB prompt's tokens in memory first)
    n, most = len(train) + len(val), 256 * cfg.max_prompt
    train, val = [p for p in train if len(p.question) <= most], [p for p in val if len(p.question) <= most]
    if len(train) + len(val) < n:
        print0(f"note: {n - len(train) - len(val):,} prompts of over {most:,} characters skipped: none fits "
               f"--max_prompt={cfg.max_prompt} tokens")
    # a small prompt set used up by the held-out split: said before the first step, with the flags that change it
    if len(train) < max(4 * cfg.batch_prompts, len(val)):
        print0(f"warning: {len(train)} training prompts are left beside {len(val)} held out, fewer than " + (
            f"4 steps of --batch_prompts={cfg.batch_prompts}" if len(train) < 4 * cfg.batch_prompts else "held out") +
            "; more rows, a smaller --eval_prompts or a smaller --batch_prompts change it")
    # the answer instruction all prompts end with, if one: the export's chat template adds it (rundir.training_template)
    cfg.instruction = next((i for i in (data.MATH_INSTRUCTION, data.CODE_INSTRUCTION, data.RG_INSTRUCTION)
                            if all(p.question.endswith(i) for p in train + val)), "")
    if cfg.model == "tiny" and not set(sources) <= {"arith", "code"}:
        fail(f"the tiny character-level model only covers --task=arith, code or arith+code; pass --model=<hub name or "
             f"path> for {cfg.task}")
    tasks = list(dict.fromkeys(p.task for p in val))  # checker names (arith, code, math, rg:...)
    if "code" in tasks and sandbox.sandbox_mode() is None:
        fail(f"--task={cfg.task} runs programs: {sandbox.sandbox_description()}")
    if "code" in tasks and cfg.model == "tiny" and cfg.answer_budget < data.CODE_ANSWER_TOKENS:
        print0(f"note: --answer_budget raised from {cfg.answer_budget} to {data.CODE_ANSWER_TOKENS} tokens for the "
               "built-in programs")
        cfg.answer_budget = data.CODE_ANSWER_TOKENS
    return train, val, tasks


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_model(cfg, tasks):
    """(model, tokenizer): the tiny Llama and its character tokenizer, or a causal LM by hub name or path (fp32)."""
    if cfg.model == "tiny":
        tok = data.char_tokenizer(data.ARITH_CHARS + ("code" in tasks) * data.CODE_CHARS)
        return trainer.tiny_model(cfg, len(tok)), tok
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    path, name = os.path.expanduser(cfg.model), f"--model={cfg.model}"
    # a path, not a hub name (org/name): a missing folder says so, not the hub's repo-id rules
    if (path.startswith((".", "/")) or path.count("/") > 1) and not os.path.isdir(path):
        fail(f"{name}: no such directory (a local model is a folder written by save_pretrained)")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        fail(f"{name} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save the model's tokenizer into it with "
             "tokenizer.save_pretrained")
    # a name shaped like a hub name that is no folder here: the hub's answer says why, and no folder is named too
    nowhere = "" if os.path.isdir(path) else f"no folder {cfg.model!r} exists here, and "
    if nowhere:
        from huggingface_hub import constants
        reach_hub(f"{name}: {nowhere}", constants.HF_HUB_OFFLINE, "pass a local path")
    t0 = time.time()
    print0(f"loading {cfg.model} ...", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.model)
        with torch.device("meta"):  # checked before any weight loads: an 8B model is refused in seconds
            check_model(cfg, AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model)), tok)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    except (OSError, ValueError) as e:  # a hub name offline or unknown, or a path without a model
        fail(f"cannot load {name}: {nowhere and nowhere + 'the hub answered: '}{first_line(e)}; pass a local path, "
             "or go online once so the hub copy is cached")
    if tok.eos_token_id is None:
        fail(f"the tokenizer of --model={cfg.model} has no end-of-sequence token; set eos_token in its config")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is masked out of the loss: any id will do
    # stop rules and the interruption match these tokens exactly; new rows start at the mean embedding
    missing = [t for t in (data.THINK_OPEN, data.THINK_CLOSE) if len(data.encode(tok, t)) != 1]
    if missing:
        tok.add_tokens(missing)
        if len(tok) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tok), mean_resizing=True)
        print0(f"note: {' and '.join(missing)} added to the tokenizer of {cfg.model} as single tokens (vocabulary "
               f"{len(tok)}), so the thinking close and the interruption phrase are exact")
    print0(f"loaded {cfg.model} in {time.time() - t0:.0f}s")
    return model, tok


def check_model(cfg, model, tok):
    """Refuse, in one line, a model the recipe cannot serve; each refusal says why."""
    kind, name = type(model).__name__, f"--model={cfg.model}"
    positions = getattr(model.config, "max_position_embeddings", None)  # GPT-2's n_positions too
    longest = cfg.max_prompt + cfg.think_max + cfg.answer_budget + cfg.interrupt * len(
        data.encode(tok, data.INTERRUPT_PHRASE))
    if positions and longest > positions:
        fail(f"a sequence can reach {longest:,} tokens (--max_prompt {cfg.max_prompt} + --think_max {cfg.think_max} "
             f"+ the interruption phrase + --answer_budget {cfg.answer_budget}), over the {positions:,} positions of "
             f"{name}; lower the budgets")
    if getattr(model, "_is_stateful", False):
        fail(f"{name} ({kind}) keeps a recurrent state, which the engines' KV caches do not hold; use an "
             "attention-only decoder")
    if not any(isinstance(m, torch.nn.ModuleList) for m in model.get_decoder().children()):
        fail(f"{name} ({kind}) has no stack of decoder layers (a ModuleList in get_decoder()) to shard and cache")
    if len(tok) > (rows := model.get_input_embeddings().weight.shape[0]):
        fail(f"the tokenizer of {name} has {len(tok):,} ids but the model embeds {rows:,}; pass the model's own "
             "tokenizer")
