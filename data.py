"""Problems, the prompt format, the built-in tasks and the reward contract for scalerl. No project imports.

A prompt ends with <think>; the model writes its thinking, </think>, then the answer. Datasets and the checkers that
need a process or a sandbox (in `CHECKERS`): infra/sources.py, infra/sandbox.py. The paper's choices made here:
1. Binary reward +1 / -1 from a verifier (Sec. 3.2), read after the thinking trace: math with Math-Verify, code by
   running it against hidden stdin/stdout tests in a sandbox, pass = all pass (App. A.3).
2. A held-out validation split that never enters training (App. A.3): the built-in tasks split questions by a hash.
3. The forced-interruption phrase (App. A.10) ends with `</think>`, so an interrupted completion still has an answer.
"""
import concurrent.futures
import dataclasses
import functools
import json
import os
import random
import re
import zlib

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INTERRUPT_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"  # App. A.10
PLAIN_TEMPLATE = "Q: {question}\nA: "  # for models without a chat template (the tiny character-level model)
RG_INSTRUCTION = "\nThink inside <think> </think>, then write only the final answer after </think>."
MATH_INSTRUCTION = "\nThink inside <think> </think>, then write the final answer after </think> in \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Problem:
    id: int          # stable prompt id, unique within a loaded source (the curriculum keys on it)
    question: str    # question text shown to the model (no template), with any per-task instruction
    answer: str      # reference answer; for "code", the hidden tests as JSON [[stdin, stdout], ...]
    task: str        # "arith" | "code" | "rg:<name>" | "math": selects the checker
    level: int = 0   # difficulty level of the built-in task; 0 when unknown
    trace: str = ""  # step-by-step thinking for the supervised warm start ("" when none)


def format_prompt(question, tokenizer=None):
    """The prompt text: the tokenizer's chat template when it has one, else PLAIN_TEMPLATE; ends with <think>."""
    text = PLAIN_TEMPLATE.format(question=question)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    return text if text.rstrip().endswith(THINK_OPEN) else text + THINK_OPEN


def encode(tok, text):
    """Token ids of `text`, without the tokenizer's special tokens (the prompt format carries its own)."""
    return tok(text, add_special_tokens=False)["input_ids"]


def char_tokenizer(chars):
    """A character-level `transformers` fast tokenizer with <think>/</think> as single tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, Regex
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", THINK_OPEN, THINK_CLOSE] + sorted(set(chars)))}
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
    elif problem.task == "code":
        answer = CODE_HEAD + problem.trace.rsplit(",", 1)[-1] + ")" if problem.trace else ""
    return problem.trace + THINK_CLOSE + answer


def extract_answer(completion):
    """The text after the last </think>, stripped; None when there is none (the thinking never closed)."""
    closed = isinstance(completion, str) and THINK_CLOSE in completion
    return completion.rsplit(THINK_CLOSE, 1)[1].strip() if closed else None


# The built-in arithmetic task: level L sums L+1 single-digit terms, "7+5+9+3", thinking "7+5=12,12+9=21,21+3=24"; a
# ~1M-parameter model learns it in minutes. The thinking grows with the level: a length budget cuts the top (App. A.10).
ARITH_CHARS = "".join(sorted(set("0123456789+=,\n " + PLAIN_TEMPLATE.replace("{question}", "")
                                 + THINK_OPEN + THINK_CLOSE + INTERRUPT_PHRASE)))


def _in_split(question, seed, split):
    """Whether `question` is on the `split` side ("val": 1 in 5; "train"; None: either) of a hash of the question, not
    of the list of draws (which would put all 100 level-1 questions into a 1,000-prompt validation set)."""
    return split is None or (zlib.crc32(f"{seed}:{question}".encode()) % 5 == 0) == (split == "val")


def arith_problems(n, seed=0, levels=(1, 2, 3, 4, 5), error_rate=0.0, start_id=0, split=None):
    """n problems, ids start_id.., each a function of (seed, id), levels cycling with the id. error_rate: a trace step
    slips (+-1 or +-10) with this probability, the chain goes on (a partly competent warm start); `answer`: true sum."""
    assert levels and all(isinstance(L, int) and L >= 1 for L in levels), levels
    assert 0.0 <= error_rate <= 1.0 and split in (None, "val", "train"), (error_rate, split)
    out = []
    for pid in range(start_id, start_id + n):
        level, rng = levels[pid % len(levels)], random.Random(f"arith:{seed}:{pid}")
        for _ in range(10_000):
            terms = [rng.randrange(10) for _ in range(level + 1)]
            question = "+".join(map(str, terms))
            if _in_split(question, seed, split):
                break
        # slips draw from their own stream at every step: questions ignore error_rate, a lower rate's slips are a subset
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


def feasible_share(problems, think_budget, n_tokens=len):
    """The pass rate of a never-slipping policy whose thinking must fit: the mean chance that a budget drawn from
    (lo, hi) holds the error-free trace and </think> (an interrupted one has no final sum, App. A.10)."""
    lo, hi = think_budget
    return sum(max(0, hi - max(lo, n_tokens(p.trace) + 1) + 1) for p in problems) / (hi - lo + 1) / len(problems)


# The code task (App. A.3): a program passes when its stdout, trailing whitespace stripped, matches every hidden test.
CODE_INSTRUCTION = ("\nThink inside <think> </think>, then after </think> write a Python program that reads "
                    "stdin and prints the answer, in a ```python block.")
CODE_TIME_LIMIT = 2.0  # seconds of wall clock per test
CODE_WORKERS = min(64, 4 * (os.cpu_count() or 1))  # checks parallel_map runs at once: most of one is waiting
CODE_HEAD = "a,b=map(int,input().split())\nprint("  # every built-in program: this, the expression, ")"
CODE_CHARS = "".join(sorted(set("f(a,b)=0123456789+-*," + CODE_HEAD + ")")))
CODE_ANSWER_TOKENS = len(CODE_HEAD) + 3 * len("-9*a*b") + 2  # the longest built-in program and the end token


def _term(sign, coef, var, first, python):
    body = ([str(coef)] if coef > 1 or not var else []) + list(var)
    return ("-" if sign == "-" else "" if first else "+") + ("*".join(body) if python else "".join(body))


def code_problems(n, seed=0, levels=(1, 2, 3), error_rate=0.0, start_id=0, split=None, n_tests=3):
    """n code problems, as `arith_problems`: level L is f(a,b) of L terms, "f(a,b)=3ab-a+7", printed for stdin's a b;
    the thinking builds it term by term, "3*a*b,3*a*b-a,3*a*b-a+7"; a slip changes a coefficient, sign or variable."""
    assert levels and all(isinstance(L, int) and 1 <= L <= 3 for L in levels), levels
    # no 0 or 1, so a single slip changes every output
    out, values = [], [v for v in range(-30, 31) if v not in (0, 1)]
    for pid in range(start_id, start_id + n):
        level, rng = levels[pid % len(levels)], random.Random(f"code:{seed}:{pid}")
        for _ in range(10_000):
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
            roll, kind, up = slip.random(), slip.randrange(3), slip.random() < 0.5
            slipped = [(sign, coef + 1 if coef == 1 or up else coef - 1, var), ("+-"[sign == "+"], coef, var),
                       (sign, coef, {"a": "b", "b": "a", "ab": "a", "": "a"}[var])]
            sign, coef, var = slipped[kind] if roll < error_rate else (sign, coef, var)
            steps.append((steps[-1] if steps else "") + _term(sign, coef, var, i == 0, True))
        out.append(Problem(pid, question, json.dumps(tests), "code", level, ",".join(steps)))
    return out


@functools.lru_cache(maxsize=256)
def code_tests(answer):
    """A code problem's hidden tests, [(stdin, stdout), ...], from its answer (JSON)."""
    return [tuple(t) for t in json.loads(answer)]


# Rewards: +1 pass / -1 fail (Sec. 3.2). ASCII digits only: "٢٤" is not 24.
_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?", re.ASCII)


def _check_arith(problem, text, timeout):
    """The first number of the answer must be an integer (at most 30 digits) equal to the reference."""
    number = _NUMBER.search(text)
    return bool(number) and number[1] is None and len(number[0]) <= 30 and int(number[0]) == int(problem.answer)


# task (or prefix such as "rg:") -> check(problem, answer text, timeout) -> bool; infra/sources.py adds math, rg:, code
CHECKERS = {"arith": _check_arith}
_REWARD_THREADS = concurrent.futures.ThreadPoolExecutor(CODE_WORKERS, thread_name_prefix="reward")


def reward(problem, completion, timeout=5.0):
    """+1.0 if the answer after the last </think> passes its task's checker, else -1.0; raises if the task has none."""
    if (check := CHECKERS.get(problem.task) or CHECKERS.get(problem.task.partition(":")[0] + ":")) is None:
        raise LookupError(f"no checker {problem.task!r} registered in data.CHECKERS: import infra.sources, which "
                          "registers math, rg: and code, or register your own")
    try:  # a checker's error fails the answer
        return 1.0 if (text := extract_answer(completion)) and check(problem, text, timeout) else -1.0
    except Exception:
        return -1.0


def parallel_map(fn, items):
    """[fn(x) for x in items] on a shared pool of CODE_WORKERS threads: a batch's code checks run side by side."""
    return list(_REWARD_THREADS.map(fn, items))
