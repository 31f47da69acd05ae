"""Prompts, verifiable rewards and the filtering curriculum for scalerl. Standalone: no project imports.

Sections: 1. `Problem`, the prompt format `<think> ... </think> answer`, `char_tokenizer` (the tiny model's);
2. the built-in arithmetic task "arith"; 3. the code task: the built-in "code", programs read from completions,
DeepCoder-style rows; 4. rewards: `reward` (+1 pass / -1 fail, never raises), `parallel_map`; 5. sources:
`load_problems` (built-in, reasoning-gym, presets, hub, local files), `combine`; 6. the curriculum: `PromptPool`,
`MixedPool` (one pool per task, fixed shares), `make_pool`; 7. the code sandbox: `check_program`, `sandbox_mode`.

The paper's choices made here:
1. Binary reward +1 / -1 from a verifier (Sec. 3.2): math answers are checked with Math-Verify after stripping the
   thinking trace, code by running it against hidden stdin/stdout tests in a sandbox, pass = all pass (App. A.3).
2. A held-out validation split of fixed size that never enters training (1,000 Polaris prompts, App. A.3).
3. Zero-variance filtering: a group whose rewards are all equal leaves the loss and is counted, not refilled (Sec. 3.2).
4. No-Positive-Resampling: a prompt whose pass rate reaches 0.9 is never sampled in a later epoch (Sec. 3.2);
   **choice**: the latest observed pass rate decides, and removal takes effect at the next epoch.
5. The forced-interruption phrase (App. A.10) ends with `</think>`, so an interrupted completion still has an answer.

Run `python data.py` to print a few built-in problems, their prompt and their supervised target.
"""
import atexit
import concurrent.futures
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import json
import os
import queue
import random
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib

# ---------------------------------------------------------------------------------------------------
# Problems and the prompt format: the prompt ends with <think>; the model writes its thinking, </think>, the answer.

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INTERRUPT_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"  # App. A.10
PLAIN_TEMPLATE = "Q: {question}\nA: "  # for models without a chat template (the tiny char-level model)
RG_INSTRUCTION = "\nThink inside <think> </think>, then write only the final answer after </think>."
MATH_INSTRUCTION = "\nThink inside <think> </think>, then write the final answer after </think> in \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Problem:
    id: int          # stable prompt id, unique within a loaded source (PromptPool keys on it)
    question: str    # question text shown to the model (no template), with any per-task instruction
    answer: str      # reference answer; for "code", the hidden tests as JSON [[stdin, stdout], ...]
    task: str        # "arith" | "code" | "rg:<name>" | "math": selects the checker
    level: int = 0   # difficulty level of the built-in task; 0 when unknown
    trace: str = ""  # step-by-step thinking for the supervised warm start ("" when none)


def format_prompt(question, tokenizer=None):
    """The prompt text: the tokenizer's chat template when it has one, else PLAIN_TEMPLATE; ends with <think>."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    else:
        text = PLAIN_TEMPLATE.format(question=question)
    return text if text.rstrip().endswith(THINK_OPEN) else text + THINK_OPEN


def encode(tok, text):
    """Token ids of `text`, without the tokenizer's special tokens (the prompt format carries its own)."""
    return tok(text, add_special_tokens=False)["input_ids"]


def char_tokenizer(chars):
    """A character-level `transformers` fast tokenizer with <think>/</think> as single tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, Regex
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<eos>", "<unk>", THINK_OPEN, THINK_CLOSE]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(chars) - set(specials)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.add_tokens([THINK_OPEN, THINK_CLOSE])
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}={% endif %}")
    return tok


def format_target(problem):
    """Supervised completion: trace, </think>, answer. For the built-in tasks the answer is what the trace itself
    ends at, so an imperfect trace teaches a consistent slip rather than a guess from nowhere."""
    answer = problem.answer
    if problem.task == "arith" and problem.trace:
        answer = problem.trace.rsplit("=", 1)[-1]  # the last running sum
    elif problem.task == "code":  # the built-in program prints the trace's last expression
        answer = CODE_HEAD + problem.trace.rsplit(",", 1)[-1] + ")" if problem.trace else ""
    return problem.trace + THINK_CLOSE + answer


def extract_answer(completion):
    """The text after the last </think>, stripped; None when there is none (the thinking never closed)."""
    if not isinstance(completion, str) or THINK_CLOSE not in completion:
        return None
    return completion.rsplit(THINK_CLOSE, 1)[1].strip()


# ---------------------------------------------------------------------------------------------------
# The built-in arithmetic task: level L is a chain of L+1 single-digit terms, "7+5+9+3"; the scratchpad keeps a running
# sum, "7+5=12,12+9=21,21+3=24". Short and regular so a ~1M-parameter character-level model learns it from scratch in
# minutes; the thinking grows with the level, so the top levels are the ones a length budget interrupts (App. A.10).

VAL_BUCKETS = 5  # 1 in 5 possible questions is reserved for validation, so val and train never share one
ARITH_CHARS = "".join(sorted(set("0123456789+=,\n " + PLAIN_TEMPLATE.replace("{question}", "")
                                 + THINK_OPEN + THINK_CLOSE + INTERRUPT_PHRASE)))


def _in_split(question, seed, split):
    """Whether `question` is on the `split` side ("val", "train"; None: either) of a hash of the space of questions,
    not of the list of draws (which would put all 100 level-1 questions into a 1,000-prompt validation set)."""
    return split is None or (zlib.crc32(f"{seed}:{question}".encode()) % VAL_BUCKETS == 0) == (split == "val")


def arith_problems(n, seed=0, levels=(1, 2, 3, 4, 5), error_rate=0.0, start_id=0, split=None):
    """n problems with ids start_id..; each is a function of (seed, id) only, levels cycle with the id. error_rate:
    each step of the trace slips (result off by +-1 or +-10) with this probability and the chain goes on from the
    wrong sum, so the warm-started model is only partly competent; `answer` is always the true sum."""
    if not levels or any(not isinstance(L, int) or L < 1 for L in levels):
        raise ValueError(f"arith levels must be integers >= 1, got {levels!r}")
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"arith error_rate must be in [0, 1], got {error_rate}")
    if split not in (None, "val", "train"):
        raise ValueError(f"arith split must be None, 'val' or 'train', got {split!r}")
    out = []
    for pid in range(start_id, start_id + n):
        level, rng = levels[pid % len(levels)], random.Random(f"arith:{seed}:{pid}")
        for _ in range(10_000):  # rejection sampling into the requested side of the split
            terms = [rng.randrange(10) for _ in range(level + 1)]
            question = "+".join(map(str, terms))
            if _in_split(question, seed, split):
                break
        else:
            raise RuntimeError(f"arith level {level} has no {split} question for seed {seed}")
        # Slips use their own stream and draw for every step, so the question does not depend on
        # error_rate and the slipped steps at a lower rate are a subset of those at a higher one.
        slip, steps, total = random.Random(f"slip:{seed}:{pid}"), [], terms[0]
        for term in terms[1:]:
            roll, delta = slip.random(), slip.choice((-10, -1, 1, 10))
            result = total + term
            if roll < error_rate:
                result = result + delta if result + delta >= 0 else result - delta
            steps.append(f"{total}+{term}={result}")
            total = result
        out.append(Problem(pid, question, str(sum(terms)), "arith", level, ",".join(steps)))
    return out


# ---------------------------------------------------------------------------------------------------
# The code task (math+code runs add DeepCoder, checked in a sandbox against tests, App. A.3; Table 1 fits one curve
# per task). A program reads stdin and prints to stdout; it passes when its output on every hidden test equals the
# expected one after trailing whitespace is stripped (the sandbox is the last section).

CODE_INSTRUCTION = ("\nThink inside <think> </think>, then after </think> write a Python program that reads "
                    "stdin and prints the answer, in a ```python block.")
CODE_TIME_LIMIT = 2.0                # seconds of wall clock per test
CODE_WORKERS = min(64, 4 * (os.cpu_count() or 1))  # checks parallel_map runs at once: most of one is waiting
CODE_HEAD = "a,b=map(int,input().split())\nprint("  # every built-in program: this, the expression, ")"
CODE_CHARS = "".join(sorted(set("f(a,b)=0123456789+-*," + CODE_HEAD + ")")))
CODE_ANSWER_TOKENS = len(CODE_HEAD) + 3 * len("-9*a*b") + 2  # the longest built-in program and the end token
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def _term(sign, coef, var, first, python):
    body = ([str(coef)] if coef > 1 or not var else []) + list(var)
    return ("-" if sign == "-" else "" if first else "+") + ("*".join(body) if python else "".join(body))


def code_problems(n, seed=0, levels=(1, 2, 3), error_rate=0.0, start_id=0, split=None, n_tests=3):
    """n built-in code problems, as `arith_problems`: level L is f(a,b) with L terms in math notation, "f(a,b)=3ab-a+7",
    printed by the program for the a b on stdin. The thinking builds the Python expression a term at a time,
    "3*a*b,3*a*b-a,3*a*b-a+7"; slips (a coefficient off by one, a sign flipped, a variable swapped) carry on."""
    if not levels or any(not isinstance(L, int) or not 1 <= L <= 3 for L in levels):
        raise ValueError(f"code levels must be integers in 1..3, got {levels!r}")
    out, values = [], [v for v in range(-30, 31) if v not in (0, 1)]  # a single slip changes every output
    for pid in range(start_id, start_id + n):
        level, rng = levels[pid % len(levels)], random.Random(f"code:{seed}:{pid}")
        for _ in range(10_000):  # rejection sampling into the requested side of the split
            terms = [(rng.choice("+-"), rng.randint(1, 9), rng.choice(("a", "b", "ab", ""))) for _ in range(level)]
            question = "f(a,b)=" + "".join(_term(*t, i == 0, False) for i, t in enumerate(terms))
            if _in_split(question, seed, split):
                break
        tests = []
        for a, b in (rng.sample(values, 2) for _ in range(n_tests)):  # a != b
            f = sum((1 if s == "+" else -1) * c * (a if "a" in v else 1) * (b if "b" in v else 1) for s, c, v in terms)
            tests.append((f"{a} {b}\n", f"{f}\n"))
        slip, steps = random.Random(f"codeslip:{seed}:{pid}"), []
        for i, (sign, coef, var) in enumerate(terms):
            roll, kind, up = slip.random(), slip.randrange(3), slip.random() < 0.5  # drawn whatever the rate
            slipped = [(sign, coef + 1 if coef == 1 or up else coef - 1, var), ("+-"[sign == "+"], coef, var),
                       (sign, coef, {"a": "b", "b": "a", "ab": "a", "": "a"}[var])]  # coefficient, sign or variable
            sign, coef, var = slipped[kind] if roll < error_rate else (sign, coef, var)
            steps.append((steps[-1] if steps else "") + _term(sign, coef, var, i == 0, True))
        out.append(Problem(pid, question, json.dumps(tests), "code", level, ",".join(steps)))
    return out


@functools.lru_cache(maxsize=256)
def code_tests(answer):
    return [tuple(t) for t in json.loads(answer)]  # a code problem's answer: its hidden tests as JSON


@functools.lru_cache(maxsize=4096)  # a group often holds the same program several times: run it once
def _code_verdict(program, answer, time_limit):
    return check_program(program, code_tests(answer), time_limit)


def _stdin_tests(cell):
    """A DeepCoder/TACO-style `tests` cell (a list of {input, output} or [input, output], or a dict of inputs/outputs
    lists, maybe as JSON) as a code answer, JSON [[stdin, stdout], ...]; function tests are left out; None if none."""
    try:
        raw = json.loads(cell) if isinstance(cell, str) else cell
        if isinstance(raw, dict):  # {"inputs": [...], "outputs": [...]}, or "fn_name" for a function's tests
            raw = [] if raw.get("fn_name") else list(zip(raw["inputs"], raw["outputs"]))
        cases = [dict(input=c[0], output=c[1]) if isinstance(c, (list, tuple)) else c for c in raw]
        tests = [(c["input"], c["output"]) for c in cases if isinstance(c["input"], str) and isinstance(
            c["output"], str) and c.get("testtype", "stdin") == "stdin" and c.get("type", "stdin_stdout")
            == "stdin_stdout"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # unreadable tests: the row cannot be checked
    return json.dumps(tests) if tests else None


# ---------------------------------------------------------------------------------------------------
# Rewards: +1 pass / -1 fail (Sec. 3.2). Every checker returns a bool; anything unexpected is a fail.

_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?", re.ASCII)  # ASCII digits only: "٢٤" is not 24
_RG_ENTRIES = {}  # Problem -> (reasoning-gym dataset, entry): the entry its scorer needs (Problem is frozen)


def _check_rg(problem, text, timeout):
    dataset, entry = _RG_ENTRIES.get(problem, (None, None))
    if dataset is None:  # not generated in this process: fall back to an exact match
        return text == problem.answer
    scores = []  # scorers are plain Python: a daemon thread with a deadline bounds them (a stuck one lingers)
    thread = threading.Thread(target=lambda: scores.append(dataset.score_answer(answer=text, entry=entry)), daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(scores) and scores[0] >= 1.0


class _MathWorker:
    """Math-Verify in a child process. Its own time-outs use signals (main thread only) and a thread cannot stop SymPy
    inside one long C call (e.g. 9^{9^{9^9}} holds the GIL), so a check that runs past its deadline kills the child;
    the next check starts a fresh one (~1 s). Cost ~1-5 ms a check."""

    def __init__(self):
        self.proc, self.lock = None, threading.Lock()

    def _read(self, timeout):  # one line from the child, or None after timeout seconds
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        return self.proc.stdout.readline().strip() if ready else None

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def check(self, gold, pred, timeout):
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--math-worker"],
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                 stderr=subprocess.DEVNULL, text=True, encoding="utf-8")
                    if self._read(120.0) != "ready":
                        raise RuntimeError("math-verify worker did not start; is math-verify installed?")
                self.proc.stdin.write(json.dumps([gold, pred]) + "\n")
                self.proc.stdin.flush()
                out = self._read(timeout)
            except (OSError, RuntimeError, ValueError):
                out = None
            if out is None:  # too slow or dead: start over on the next check
                self.stop()
            return out == "1"


def _math_worker_loop():
    import logging
    from math_verify import parse, verify
    logging.disable(logging.WARNING)
    gold_cache = {}
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            gold, pred = json.loads(line)
            if gold not in gold_cache:  # bare gold answers ("3/4", "\frac{3}{4}") parse as LaTeX math
                latex = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
                gold_cache[gold] = parse(latex, parsing_timeout=None)
            ok = verify(gold_cache[gold], parse(pred, parsing_timeout=None), timeout_seconds=None)
        except Exception:  # any parser/SymPy failure is a failed check, never a crash
            ok = False
        print("1" if ok else "0", flush=True)


_MATH_WORKER = _MathWorker()
atexit.register(_MATH_WORKER.stop)  # a child stuck in SymPy would not notice its parent leaving
_REWARD_THREADS = concurrent.futures.ThreadPoolExecutor(CODE_WORKERS, thread_name_prefix="reward")  # parallel_map's


def reward(problem, completion, timeout=5.0):
    """+1.0 if the answer after the last </think> passes the problem's checker, else -1.0. Never raises."""
    try:
        text = extract_answer(completion)
        if not text:
            return -1.0
        if problem.task == "arith":  # the first number must be an integer equal to the answer
            number = _NUMBER.search(text)
            ok = bool(number) and number[1] is None and len(number[0]) <= 30 and int(number[0]) == int(problem.answer)
        elif problem.task.startswith("rg:"):
            ok = _check_rg(problem, text, timeout)
        elif problem.task == "math":  # answers are short; the tail keeps a final \boxed{} of a long one
            ok = _MATH_WORKER.check(problem.answer, text[-2000:], timeout)
        elif problem.task == "code":  # the program: the first ```python block when there is one, else all of it
            fenced = _FENCE.search(text)
            ok = _code_verdict(fenced[1] if fenced else text, problem.answer, min(timeout, CODE_TIME_LIMIT))
        else:
            ok = False
    except Exception:  # a reward never takes down the run: an unexpected failure is a fail
        ok = False
    return 1.0 if ok else -1.0


def parallel_map(fn, items):
    """[fn(x) for x in items] on a shared pool of CODE_WORKERS threads: a batch's code checks run side by side."""
    return list(_REWARD_THREADS.map(fn, items))


# ---------------------------------------------------------------------------------------------------
# Sources. A math answer column holds the answer, or a worked solution it is read from: MATH's last \boxed{}, and
# (**choice**: in any source but "math") for an answer containing "####", a GSM8K solution, the number after the last
# "####" with commas removed ("1,234" -> "1234"); the text before it is the trace.

def _gsm8k_answer(text):  # (trace, answer) of an answer cell: "steps #### 1,234" -> ("steps ", "1234"); else ("", text)
    solution, hashes, tail = text.rpartition("####")
    number = _NUMBER.search(tail.replace(",", ""))
    return (solution, number[0] if number else None) if hashes else ("", text)


def last_boxed(text):
    """Content of the last \\boxed{...} in text (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


PRESETS = {  # name -> (hub dataset, config, question column, answer column, answer cell -> (trace, answer))
    "polaris": ("POLARIS-Project/Polaris-Dataset-53K", None, "problem", "answer", _gsm8k_answer),
    "gsm8k": ("openai/gsm8k", "main", "question", "answer", _gsm8k_answer),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", "problem", "solution", lambda s: (s, last_boxed(s))),
    "deepcoder": ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "problem", "tests", None),  # code
}
FILE_TYPES = (".json", ".jsonl", ".parquet")


def _read_rows(source, path, hub, config, split):
    """The rows of the local file `path`, or when it is None of the hub dataset (offline: from the local cache)."""
    if path is None:
        import datasets
        try:
            return list(datasets.load_dataset(hub, config, split=split))
        except Exception as e:  # offline, unreachable or unknown: one actionable line
            why = (str(e) or repr(e)).splitlines()[0][:160]
            raise ValueError(f"cannot load dataset {source!r} (hub: {hub}): {why}. Provide it locally: save it as "
                             f".json/.jsonl/.parquet and pass --data_path=FILE (or the file as the source)") from None
    if not path.endswith(FILE_TYPES) or not os.path.isfile(path):
        why = "does not exist" if path.endswith(FILE_TYPES) else "is not a .json, .jsonl or .parquet file"
        raise ValueError(f"dataset file {path!r} {why}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    if isinstance(data, dict):  # column-oriented {"problem": [...], "answer": [...]}
        data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path!r}: expected a list of records or a dict of columns")
    return data


def _rows_to_problems(rows, source, prompt_key, answer_key, trace_key, answer_fn):
    """Problems from rows, code when answer_fn is None; a row without a question or a checkable answer is skipped."""
    for key in (prompt_key, answer_key):
        if rows and key not in rows[0]:
            raise ValueError(f"dataset {source!r} has no column {key!r}; columns: {sorted(rows[0])}; pass "
                             f"--prompt_key/--answer_key")
    out = []
    for i, row in enumerate(rows):
        question, answer, trace = row.get(prompt_key), row.get(answer_key), ""
        if answer_fn is None:
            answer = _stdin_tests(answer)
        elif answer is not None:
            trace, answer = answer_fn(str(answer))
            trace = str(row.get(trace_key) or "") if trace_key else trace
        if question is not None and answer is not None and str(question).strip() and str(answer).strip():
            out.append(Problem(i, str(question).strip() + (MATH_INSTRUCTION if answer_fn else CODE_INSTRUCTION),
                               str(answer).strip(), "math" if answer_fn else "code", 0, trace.strip()))
    if not out and answer_fn is None:
        raise ValueError(f"dataset {source!r}: no row has stdin/stdout tests in its {answer_key!r} column")
    return out


def _reasoning_gym(source, size, seed, options):
    """Problems of the reasoning-gym task "rg:<name>" with `options` (its config's fields), each scored by the task."""
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
        why = (str(e) or repr(e)).splitlines()[0][:160]
        raise ValueError(f"reasoning-gym task {name!r} with options {options}: {why}") from None
    problems = []
    for i in range(len(dataset)):
        entry = dataset[i]
        problems.append(Problem(i, entry["question"] + RG_INSTRUCTION, str(entry["answer"]), source))
        _RG_ENTRIES[problems[-1]] = (dataset, entry)
    return problems


def _split(problems, n_val, n_train, seed, source):
    if len(problems) <= n_val:
        raise ValueError(f"source {source!r} has {len(problems)} usable prompts; n_val={n_val} leaves "
                         f"none for training; pass a smaller n_val")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    val = [problems[i] for i in order[:n_val]]
    seen = {p.question for p in val}  # the same question under another id must not leak into training
    train = [problems[i] for i in order[n_val:] if problems[i].question not in seen]
    return train[:n_train] if n_train is not None else train, val


def load_problems(source, n_val=1000, seed=0, n_train=None, prompt_key=None, answer_key=None, data_path=None,
                  rg_options=None, **kw):
    """(train, val) lists of Problem; val has n_val prompts whose ids and questions never appear in train.

    source: "arith" or "code", the built-in tasks (kw: levels, error_rate); "rg:<task>", a reasoning-gym task (its
    options as rg_options={...} or as kw); for both, n_train defaults to 5000. Or a preset "polaris", "gsm8k",
    "math" or "deepcoder" (data_path=FILE reads a local copy), a hub dataset "owner/name" (offline: from the local
    cache only) or a .json/.jsonl/.parquet file: prompt_key/answer_key override the question and answer columns,
    kw trace_key names a column of worked solutions, config/split pick the hub's; rows with `tests` are code.
    """
    rg, is_file = source.startswith("rg:"), source.endswith(FILE_TYPES)
    allowed = (("levels", "error_rate") if source in ("arith", "code") else ("rg_options",) if rg else
               ("prompt_key", "answer_key", "data_path", "config", "split", "trace_key"))
    given = {k for k, v in dict(prompt_key=prompt_key, answer_key=answer_key, data_path=data_path,
                                rg_options=rg_options).items() if v is not None} | (set() if rg else set(kw))
    if given - set(allowed):
        raise ValueError(f"unknown options for source {source!r}: {sorted(given - set(allowed))}; expected "
                         f"{', '.join(allowed)}")
    if source in ("arith", "code"):  # the built-in tasks
        make = arith_problems if source == "arith" else code_problems
        val = make(n_val, seed, split="val", start_id=0, **kw)
        return make(5000 if n_train is None else n_train, seed, split="train", start_id=n_val, **kw), val
    if rg:
        n_train = 5000 if n_train is None else n_train
        problems = _reasoning_gym(source, n_val + n_train, seed, {**(rg_options or {}), **kw})
        return _split(problems, n_val, n_train, seed, source)
    if source not in PRESETS and not is_file and ("/" not in source or os.path.exists(source)):
        raise ValueError(f"unknown source {source!r}: expected arith, code, rg:<task> (a reasoning-gym task), a preset "
                         f"({', '.join(PRESETS)}; --data_path=FILE reads a local copy), a hub dataset owner/name or a "
                         f"file path ending .json/.jsonl/.parquet")
    hub, config, prompt_col, answer_col, answer_fn = PRESETS.get(source, (source, None, "problem", "answer",
                                                                          _gsm8k_answer))
    rows = _read_rows(source, data_path or (source if is_file else None), hub, kw.get("config", config),
                      kw.get("split", "train"))
    if answer_fn is None or rows and "tests" in rows[0] and answer_key in (None, "tests"):  # DeepCoder-style
        answer_col, answer_fn = "tests", None
    elif importlib.util.find_spec("math_verify") is None:  # else every math reward would quietly fail
        raise ValueError(f"source {source!r} is checked with math-verify: pip install math-verify")
    problems = _rows_to_problems(rows, source, prompt_key or prompt_col, answer_key or answer_col,
                                 kw.get("trace_key"), answer_fn)
    return _split(problems, n_val, n_train, seed, source)


def combine(parts):
    """One (train, val) from several sources' (train, val) pairs, ids shifted to stay unique across them."""
    train, val = [], []
    for part_train, part_val in parts:
        if train or val:
            shift = max(p.id for p in train + val) + 1
            renamed = {p: dataclasses.replace(p, id=p.id + shift) for p in part_train + part_val}
            _RG_ENTRIES.update({renamed[p]: _RG_ENTRIES[p] for p in renamed if p in _RG_ENTRIES})
            part_train, part_val = [renamed[p] for p in part_train], [renamed[p] for p in part_val]
        train, val = train + part_train, val + part_val
    return train, val


# ---------------------------------------------------------------------------------------------------
# The curriculum: seeded epochs, zero-variance filtering and No-Positive-Resampling (Sec. 3.2).

class PromptPool:
    """Yields problems epoch by epoch in a seeded order and keeps the curriculum's statistics."""

    def __init__(self, problems, seed=0, npr=True, npr_threshold=0.9, zero_var=True):
        self.problems = {p.id: p for p in problems}
        if not self.problems or len(self.problems) != len(problems):
            raise ValueError(f"PromptPool needs a non-empty list of problems with unique ids, got {len(problems)} "
                             f"problems with {len(self.problems)} distinct ids")
        self.seed, self.npr, self.npr_threshold, self.zero_var = seed, npr, npr_threshold, zero_var
        self.epoch, self.position, self.removed, self.history = 0, 0, set(), {}
        self.groups_seen = self.zero_var_dropped = 0
        self.order = self._epoch_order()  # ids of the current epoch, fixed when the epoch starts

    def _epoch_order(self):
        ids = sorted(set(self.problems) - self.removed)
        random.Random(f"pool:{self.seed}:{self.epoch}").shuffle(ids)  # a function of (seed, epoch)
        return ids

    npr_removed = property(lambda self: len(self.removed))
    zero_var_frac = property(lambda self: self.zero_var_dropped / self.groups_seen if self.groups_seen else 0.0)

    def next(self):
        if self.position >= len(self.order):  # epoch exhausted: the next one leaves out removed prompts
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._epoch_order()
            if not self.order:
                raise RuntimeError(f"PromptPool: all {len(self.problems)} prompts were removed by No-Positive-"
                                   f"Resampling (pass rate >= {self.npr_threshold}); nothing left to sample")
        self.position += 1
        return self.problems[self.order[self.position - 1]]

    def record(self, prompt_id, rewards):
        """Record a finished group's rewards (+1/-1); returns kept: False when zero-variance filtering drops it."""
        if prompt_id not in self.problems:
            raise KeyError(f"PromptPool.record: unknown prompt id {prompt_id}")
        if len(rewards) == 0:
            raise ValueError(f"PromptPool.record: empty rewards for prompt {prompt_id}")
        rate = sum(r > 0 for r in rewards) / len(rewards)
        self.groups_seen += 1
        self.history[prompt_id] = rate  # the latest observed pass rate decides (Sec. 3.2, our choice)
        if self.npr and rate >= self.npr_threshold:
            self.removed.add(prompt_id)  # not in any later epoch; this epoch's order is left as is
        else:
            self.removed.discard(prompt_id)  # a later, lower pass rate (a group still in flight) wins
        if self.zero_var and all(r == rewards[0] for r in rewards):
            self.zero_var_dropped += 1  # zero advantage, zero gradient: drop, do not refill (Sec. 3.2)
            return False
        return True

    def state_dict(self):
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "order": list(self.order),
                "removed": sorted(self.removed), "history": [[i, r] for i, r in sorted(self.history.items())],
                "groups_seen": self.groups_seen, "zero_var_dropped": self.zero_var_dropped}

    def load_state_dict(self, state):
        unknown = set(state["order"]) - set(self.problems)
        if unknown:
            raise ValueError(f"PromptPool state names {len(unknown)} prompt ids this pool does not have "
                             f"(e.g. {sorted(unknown)[:3]}); load the same problems before restoring")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.order, self.removed = [int(i) for i in state["order"]], {int(i) for i in state["removed"]}
        self.history = {int(i): float(r) for i, r in state["history"]}
        self.groups_seen, self.zero_var_dropped = state["groups_seen"], state["zero_var_dropped"]


class MixedPool:
    """A PromptPool per task (each with its own NPR and zero-variance curriculum), drawn from in fixed shares.
    **choice** (the paper does not say how it mixes math and code, App. A.3): each draw goes to the task furthest
    below its share so far, so every B consecutive prompts hold B x share of each task, to within one."""

    def __init__(self, problems, shares, seed=0, **pool_kw):
        self.shares = {t: w / sum(shares.values()) for t, w in shares.items() if w > 0}
        self.pools = {t: PromptPool([p for p in problems if p.task == t], seed, **pool_kw) for t in self.shares}
        self.task_of, self.drawn = {p.id: p.task for p in problems}, dict.fromkeys(self.pools, 0)

    npr_removed = property(lambda self: sum(p.npr_removed for p in self.pools.values()))
    epoch = property(lambda self: min(p.epoch for p in self.pools.values()))  # the slowest task's epoch

    def next(self):
        n = sum(self.drawn.values()) + 1
        task = max(self.pools, key=lambda t: n * self.shares[t] - self.drawn[t])
        self.drawn[task] += 1
        return self.pools[task].next()

    def record(self, prompt_id, rewards):
        """PromptPool.record in the pool of the prompt's task (an unknown id is a KeyError): True if kept."""
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
    others = [t for t in tasks if t != "code"]
    rest = (1 - code_frac if "code" in tasks else 1) / max(len(others), 1)
    return MixedPool(problems, {t: code_frac if t == "code" else rest for t in tasks}, **pool_kw)


# ---------------------------------------------------------------------------------------------------
# The code sandbox: one fresh interpreter per program (per 16 tests), confined as tightly as this machine allows.

_SANDBOX_MODE, _SANDBOX_LOCK = [], threading.Lock()  # sandbox_mode's answer, found once per process
_SLOTS = queue.SimpleQueue()  # a uid per concurrent check (as root), so a sweep by uid finds only its processes
for _slot in range(64):
    _SLOTS.put(_slot)


def check_program(program, tests, time_limit=CODE_TIME_LIMIT, memory_mb=512, output_bytes=1 << 20):
    """True iff `program` (Python source) prints the expected stdout for every (stdin, stdout) test. It runs in a
    fresh `python -I -S` (no site-packages, an empty environment) in a temporary directory, removed after, with
    `time_limit` seconds of wall clock per test (then all its processes are killed) and limits on address space,
    output and file size, open files and process count; network, subprocesses and signals are refused, and (with
    Landlock) no system call creates, changes or removes a file, or reads one outside the standard library.
    Stops at the first failed test; never raises."""
    try:
        mode = sandbox_mode()
        if mode is None or not isinstance(program, str) or not program.strip() or not tests:
            return False
        tests = [(str(i), str(o)) for i, o in tests]  # 16 tests per interpreter: two open files each
        return all(_run_tests(program, tests[k:k + 16], float(time_limit), memory_mb << 20, output_bytes, mode)
                   for k in range(0, len(tests), 16))
    except Exception:  # noqa: BLE001 -- a verifier never takes down the run
        return False


def sandbox_mode():
    """(command prefix, own uid?, Landlock?) of the strongest sandbox that runs a canary program here: network and
    PID namespaces (`unshare`; as a plain user inside a user namespace), as root a uid of its own, Landlock (see
    _BOOT); None if none. What is missing is said once, on stderr."""
    with _SANDBOX_LOCK:
        if not _SANDBOX_MODE:
            root, unshare = os.geteuid() == 0, shutil.which("unshare")
            namespaces = [unshare] + ([] if root else ["-r"]) + ["-n", "-p", "-f", "--kill-child"] if unshare else None
            for mode in [(ns, root, landlock) for ns in ([namespaces] if namespaces else []) + [[]]
                         for landlock in (True, False)]:
                if _run_tests("import math\nprint(int(input())+1)", [("41\n", "42")], 10.0, 256 << 20, 64, mode):
                    _SANDBOX_MODE.append(mode)
                    missing = [what for what, have in (("network and PID namespaces", mode[0]),
                                                       ("Landlock (files: permissions and audit hook only)", mode[2]))
                               if not have]
                    if missing:
                        print("warning: the code sandbox runs without " + "; without ".join(missing), file=sys.stderr)
                    break
            else:  # never run untrusted code as root without a uid of its own
                _SANDBOX_MODE.append(None)
                print("warning: no code sandbox works here; every program fails its tests", file=sys.stderr)
        return _SANDBOX_MODE[0]


def sandbox_description():
    """What confines a program here, in one line for the run's header (see sandbox_mode and _BOOT)."""
    mode = sandbox_mode()
    if mode is None:
        return "none works here: every program fails its tests"
    names, landlock = {"-r": "user", "-n": "net", "-p": "pid"}, "no Landlock"
    if mode[2]:
        import ctypes
        abi = ctypes.CDLL(None).syscall(444, None, 0, 1)  # landlock_create_ruleset(LANDLOCK_CREATE_RULESET_VERSION)
        landlock = f"Landlock ABI {abi} (no file writes; reads: the standard library)"
    return "; ".join([
        "namespaces: " + ", ".join(names[f] for f in mode[0] if f in names) if mode[0] else "no namespaces",
        f"uids {1_000_000 + os.getpid() % 4_000_000 * 64}+ (one per check)" if mode[1] else f"uid {os.getuid()}",
        landlock, "rlimits", "audit hook"])


def _run_tests(program, tests, time_limit, memory, output_cap, mode):
    """True iff `program` passes every test, all in one sandboxed interpreter (see _BOOT) run under `mode`."""
    namespaces, own_uid, landlock = mode
    slot, box, files, proc = _SLOTS.get(), tempfile.mkdtemp(prefix="scalerl-code-"), [], None
    uid = 1_000_000 + os.getpid() % 4_000_000 * 64 + slot if own_uid else -1
    try:
        with open(os.path.join(box, "prog.py"), "w", encoding="utf-8") as f:
            f.write(program)
        for stdin, _ in tests:  # unnamed files: nothing a program could open by a path
            files += [tempfile.TemporaryFile(dir=box), tempfile.TemporaryFile(dir=box)]  # its stdin, its stdout
            files[-2].write(stdin.encode())
            files[-2].seek(0)
        # RLIMIT_NPROC counts all processes of a uid: absolute with a uid or a user namespace of its own, else
        # on top of what this user runs already
        nproc = 16 if namespaces or own_uid else 16 + sum(int(status["Threads"]) for _, status in _processes(
            lambda pid, status: int(status["Uid"].split()[0]) == os.getuid()))
        fds = [f.fileno() for f in files]
        limits = [memory, output_cap + 1, nproc, uid, int(landlock)]
        args = [sys.executable, "-I", "-S", "-c", _BOOT, *map(str, limits + fds)]
        proc = subprocess.Popen(namespaces + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, pass_fds=fds, cwd=box, env={"LC_ALL": "C.UTF-8"},
                                start_new_session=True)
        if not select.select([proc.stdout], [], [], 10.0)[0] or proc.stdout.readline() != b"ready\n":
            return False  # the interpreter did not start: not the program's fault, but a fail
        for k, (_, want) in enumerate(tests):  # the wall clock of each test runs from the previous report
            if not select.select([proc.stdout], [], [], time_limit)[0] or proc.stdout.readline().strip() != b"0":
                return False
            files[2 * k + 1].seek(0)
            got = files[2 * k + 1].read(output_cap + 1)
            if len(got) > output_cap or _stripped_lines(got.decode(errors="replace")) != _stripped_lines(want):
                return False
        return True
    finally:
        try:
            if proc is not None:
                _kill_sandbox(proc, uid, box)
        finally:
            for f in files:
                f.close()
            shutil.rmtree(box, ignore_errors=True)
            _SLOTS.put(slot)


# One interpreter per program: limits, Landlock, as root a uid of its own, an audit hook, then a forked child per test
# with that test's input and output files as stdin and stdout; each exit code is reported on stdout.
# Files are confined by the kernel, with Landlock (Linux >= 5.13), which the interpreter applies to itself before the
# program runs: then no system call (open, mknod, mkfifo, bind to a socket path, link, rename, truncate, exec; through
# ctypes, mmap or /proc/self alike) creates, changes or removes a file anywhere, or reads one outside the standard
# library (not /, /etc, /proc, the project), and nothing lifts it. Its own files, stdin and stdout, are open already,
# bounded by RLIMIT_FSIZE (memfds also by RLIMIT_NOFILE): disk use is bounded. Chosen over a mount namespace with a
# minimal root (bind mounts, tmpfs, pivot_root) as it needs no privilege nor mount calls Python lacks: it works as a
# plain user and in containers that refuse user namespaces or mounts; over bwrap or nsjail as it needs nothing
# installed. What it leaves: stat() of names outside, and metadata (chmod, utime, xattrs; no Landlock right): as root
# the program's uid owns nothing to change, as a plain user the audit hook refuses it. The hook is a second line only
# (PEP 578 hooks are no security boundary); the first are the kernel's: namespaces, the uid, Landlock.
_BOOT = r"""# scalerl sandbox
import os, resource as R, sys
mem, fsize, nproc, uid, landlock, *fds = map(int, sys.argv[1:])
for k, v in ((R.RLIMIT_AS, mem), (R.RLIMIT_FSIZE, fsize), (R.RLIMIT_NPROC, nproc), (R.RLIMIT_CORE, 0),
             (R.RLIMIT_NOFILE, 64)):
    R.setrlimit(k, (v, v))
code, null = compile(open("prog.py", encoding="utf-8").read(), "prog.py", "exec"), os.open(os.devnull, os.O_WRONLY)
if landlock:  # system calls 444-446: landlock_create_ruleset, landlock_add_rule, landlock_restrict_self
    import ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    # refused: every file access this ABI knows (13, REFER from 2, TRUNCATE from 3, IOCTL_DEV from 5), TCP bind and
    # connect (from 4), abstract unix sockets and signals reaching outside (from 6); allowed: one rule, below
    access = struct.pack("QQQ", (1 << 13 + (abi >= 2) + (abi >= 3) + (abi >= 5)) - 1, 3 * (abi >= 4), 3 * (abi >= 6))
    ruleset, lib = libc.syscall(444, access, 24, 0), os.open(os.path.dirname(os.__file__), os.O_PATH)
    rule = struct.pack("=Qi", 4 | 8, lib)  # READ_FILE | READ_DIR beneath the standard library
    if (abi < 1 or ruleset < 0 or libc.syscall(445, ruleset, 1, rule, 0) or libc.prctl(38, 1, 0, 0, 0)
            or libc.syscall(446, ruleset, 0)):  # PR_SET_NO_NEW_PRIVS, then restrict this process and its children
        raise SystemExit("sandbox: Landlock failed: " + os.strerror(ctypes.get_errno()))
    os.close(ruleset)
    os.close(lib)
    del ctypes, struct, libc, abi, access, ruleset, lib, rule
    for m in ("ctypes", "ctypes._endian", "_ctypes"):
        sys.modules.pop(m, None)
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, 0, 0)
    if not os.access(os.__file__, os.R_OK):  # the standard library is closed to other users: load the usual now
        import array, bisect, collections, functools, heapq, itertools, math, operator, re, string
    os.setresuid(uid, uid, uid)
def hook(event, args, lib=os.path.realpath(os.path.dirname(os.__file__)) + os.sep, real=os.path.realpath,
         write=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, isinstance=isinstance,
         deny=("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.ch",
               "signal.pthread_kill", "pty.", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink",
               "os.link", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.", "ctypes."),
         Err=PermissionError):
    if (event.startswith(deny) or event == "object.__setattr__" and args[0] is hook
            or event == "import" and args[0].partition(".")[0] in ("ctypes", "_ctypes", "_posixsubprocess")
            or event == "open" and not isinstance(args[0], int)
            and ((args[2] or 0) & write or not real(args[0]).startswith(lib))):  # reads of the standard library only
        raise Err("sandbox: " + event + " is not allowed")
sys.addaudithook(hook)
sys.argv = ["prog.py"]
os.write(1, b"ready\n")
for i in range(0, len(fds), 2):
    pid = os.fork()
    if pid == 0:  # one test: its input and output files, nothing else open
        for fd, std in ((fds[i], 0), (fds[i + 1], 1), (null, 2)):
            os.dup2(fd, std)
        os.closerange(3, 1 << 16)
        try:
            exec(code, {"__name__": "__main__"})
            rc = 0
        except SystemExit as e:
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except BaseException:
            rc = 1
        try:
            sys.stdout.flush()
        except BaseException:
            rc = 1
        os._exit(rc & 255)
    os.write(1, b"%d\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def _kill_sandbox(proc, uid, box):
    """Kill a sandbox's process group (with a PID namespace the kernel then kills the rest), then sweep: what left
    the group by setsid() still has the sandbox's uid, or its directory as working directory (chdir is refused)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, 9)
    proc.wait()
    proc.stdout.close()
    for _ in range(200):
        strays = _processes(lambda pid, status: status["State"].split()[0] != "Z" and (
            int(status["Uid"].split()[0]) == uid or os.readlink(f"/proc/{pid}/cwd") == box))
        for pid, _ in strays:
            with contextlib.suppress(OSError):  # it may have died since the scan
                os.kill(pid, 9)
        if not strays:
            break
        time.sleep(0.005)


def _processes(match):
    """[(pid, status fields)] of the processes for which match(pid, status) holds, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if match(pid, status):
                found.append((int(pid), status))
        except (OSError, KeyError, ValueError):
            pass  # gone meanwhile, or not ours to inspect
    return found


def _stripped_lines(text):  # outputs compare line by line, trailing whitespace ignored
    return [line.rstrip() for line in text.rstrip().splitlines()]


if __name__ == "__main__":
    if sys.argv[1:] == ["--math-worker"]:
        _math_worker_loop()
    else:
        for p in arith_problems(5, seed=0, error_rate=0.2) + code_problems(3, seed=0, error_rate=0.3):
            print(f"{p.task} level {p.level}: {format_prompt(p.question)!r} -> {format_target(p)!r}"
                  + (f", tests {p.answer}" if p.task == "code" else ""))
        print(f"ARITH_CHARS ({len(ARITH_CHARS)}): {ARITH_CHARS!r}")
