"""Tests for data.py (the built-in task, prompt format, rewards), infra/sources.py (sources, the math and
reasoning-gym checkers) and pipeline_rl.PromptPool (the curriculum).

Run: python -m pytest tests/test_data.py -q   (offline; about half a minute on a laptop CPU)
"""
import json
import re
import subprocess
import sys
import time

import pytest

import data
from data import (ARITH_CHARS, INTERRUPT_PHRASE, THINK_CLOSE, THINK_OPEN, Problem, arith_problems, extract_answer,
                  format_prompt, format_target, reward)
from conftest import ENV, ROOT
from infra.sources import last_boxed, load_problems
from pipeline_rl import PromptPool


def naive_steps(p):
    """(a, b, c) of every step, parsed independently of data.py."""
    return [tuple(map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)", s).groups())) for s in p.trace.split(",")]


def trace_errors(p):
    """Indices of the trace steps whose arithmetic is wrong or that do not follow the question's chain."""
    terms, steps = [int(t) for t in p.question.split("+")], p.trace.split(",") if p.trace else []
    bad, total = [], terms[0]
    for k in range(len(terms) - 1):
        m = re.fullmatch(r"(\d+)\+(\d+)=(\d+)", steps[k]) if k < len(steps) else None
        if m is None or (int(m[1]), int(m[2])) != (total, terms[k + 1]) or int(m[1]) + int(m[2]) != int(m[3]):
            bad.append(k)
        total = int(m[3]) if m else total + terms[k + 1]
    return bad + list(range(len(terms) - 1, len(steps)))  # extra steps are errors too


# --- the built-in task ------------------------------------------------------------------------------

def test_arith_deterministic_per_seed_and_id():
    a = arith_problems(50, seed=3, error_rate=0.2)
    assert a == arith_problems(50, seed=3, error_rate=0.2)
    assert a != arith_problems(50, seed=4, error_rate=0.2)
    assert arith_problems(10, seed=3, error_rate=0.2, start_id=40) == a[40:]  # a function of (seed, id)
    assert [p.id for p in a] == list(range(50))


def test_arith_levels_answers_and_traces():
    probs = arith_problems(500, seed=1, levels=(1, 3, 5))
    assert [p.level for p in probs[:6]] == [1, 3, 5, 1, 3, 5]
    for p in probs:
        terms = [int(t) for t in p.question.split("+")]
        assert len(terms) == p.level + 1 and all(0 <= t <= 9 for t in terms)
        assert p.answer == str(sum(terms)) and p.task == "arith"
        steps, total = naive_steps(p), terms[0]
        assert len(steps) == p.level
        for (a, b, c), t in zip(steps, terms[1:]):  # every step is the running sum plus the next term
            assert (a, b, c) == (total, t, total + t)
            total = c
        assert trace_errors(p) == []
        assert format_target(p) == p.trace + THINK_CLOSE + p.answer
    mean_len = {L: sum(len(p.trace) for p in probs if p.level == L) / 100 for L in (1, 3, 5)}
    assert mean_len[1] < mean_len[3] < mean_len[5]  # thinking grows with the level
    assert arith_problems(1, levels=(2,))[0].trace.count(",") == 1


def test_the_budgets_bound_counts_the_budgets_that_hold_each_trace_and_its_close():
    """A trace of n tokens and </think> fit a budget b drawn uniformly from [lo, hi] when b >= n + 1; the bound is the
    mean of that chance over the problems, and the built-in levels outgrow the default 36-48 budget from level 5."""
    p = lambda n: Problem(0, "q", "1", "arith", trace="x" * n)  # noqa: E731
    assert data.feasible_share([p(10)], (36, 48)) == 1.0 and data.feasible_share([p(48)], (36, 48)) == 0.0
    assert data.feasible_share([p(40), p(47)], (36, 48)) == pytest.approx((8 / 13 + 1 / 13) / 2)  # b in 41..48, 48
    assert data.feasible_share([p(3)], (5, 5), n_tokens=lambda t: 2 * len(t)) == 0.0  # 7 tokens, a 5-token budget
    val = arith_problems(800, levels=tuple(range(1, 9)), split="val")
    share = {L: data.feasible_share([q for q in val if q.level == L], (36, 48)) for L in range(1, 9)}
    assert [share[L] for L in (1, 2, 3, 4, 7, 8)] == [1.0] * 4 + [0.0] * 2 and 0 < share[6] < share[5] < 1
    assert data.feasible_share(val, (64, 72)) == 1.0


def test_arith_imperfect_traces_exactly_where_slipped():
    clean = arith_problems(2000, seed=7, error_rate=0.0)
    low = arith_problems(2000, seed=7, error_rate=0.1)
    high = arith_problems(2000, seed=7, error_rate=0.3)
    n_steps = n_bad = 0
    for c, lo, hi in zip(clean, low, high):
        assert c.question == lo.question == hi.question and c.answer == hi.answer  # answer stays the true sum
        bad = [k for k, (a, b, r) in enumerate(naive_steps(hi)) if a + b != r]
        assert trace_errors(hi) == bad
        assert set(trace_errors(lo)) <= set(bad)  # slips at a lower rate are a subset
        for k, ((_, _, r0), (_, _, r)) in enumerate(zip(naive_steps(c), naive_steps(hi))):
            if r0 != r:  # the first step that differs from the clean trace is the first slip
                assert bad[0] == k and r - r0 in (-10, -1, 1, 10)
                break
        else:
            assert bad == []
        # the supervised answer is the trace's own last running sum (consistent with the slips)
        assert format_target(hi).endswith(THINK_CLOSE + str(naive_steps(hi)[-1][2]))
        n_steps, n_bad = n_steps + hi.level, n_bad + len(bad)
    assert 0.27 < n_bad / n_steps < 0.33
    every = arith_problems(200, seed=7, error_rate=1.0)
    assert all(trace_errors(p) == list(range(p.level)) for p in every)


def test_trace_errors_flags_broken_chains():
    p = Problem(0, "7+5+9", "21", "arith", 2, "7+5=12,12+9=21")
    assert trace_errors(p) == []
    assert trace_errors(Problem(0, "7+5+9", "21", "arith", 2, "7+5=12,11+9=20")) == [1]  # wrong operand
    assert trace_errors(Problem(0, "7+5+9", "21", "arith", 2, "7+5=12")) == [1]  # missing step
    assert trace_errors(Problem(0, "7+5+9", "21", "arith", 2, "7+5=12,12+9=21,21+1=22")) == [2]


def test_arith_chars_cover_the_task():
    texts = [INTERRUPT_PHRASE, THINK_OPEN, THINK_CLOSE]
    for p in arith_problems(300, error_rate=0.5):
        texts += [format_prompt(p.question), format_target(p), p.answer]
    assert set("".join(texts)) <= set(ARITH_CHARS)
    assert len(set(ARITH_CHARS)) == len(ARITH_CHARS) == 43


def test_arith_bad_arguments():
    for kw in (dict(levels=()), dict(levels=(0,)), dict(error_rate=1.5), dict(split="test")):
        with pytest.raises(AssertionError):
            arith_problems(3, **kw)


def test_load_arith_split_is_disjoint():
    train, val = load_problems("arith", n_val=300, n_train=2000, seed=5, error_rate=0.1)
    assert len(val) == 300 and len(train) == 2000
    assert not {p.id for p in train} & {p.id for p in val}
    assert not {p.question for p in train} & {p.question for p in val}
    assert {p.level for p in train} == {p.level for p in val} == {1, 2, 3, 4, 5}
    assert (train, val) == load_problems("arith", n_val=300, n_train=2000, seed=5, error_rate=0.1)
    assert len(load_problems("arith", n_val=10)[0]) == 5000
    with pytest.raises(ValueError, match="unknown options"):
        load_problems("arith", n_val=10, n_train=10, level=3)


# --- prompt format and answer extraction ------------------------------------------------------------

def test_format_prompt_plain_and_chat_template():
    assert format_prompt("7+5") == "Q: 7+5\nA: <think>"
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert format_prompt("7+5", tok) == "<|user|>7+5\n<|assistant|><think>"
    tok.chat_template = tok.chat_template.replace("<|assistant|>", "<|assistant|><think>\n")
    assert format_prompt("7+5", tok) == "<|user|>7+5\n<|assistant|><think>\n"  # not doubled


@pytest.mark.parametrize("completion, expected", [
    ("7+5=12</think>12", "12"), ("a</think> 12 \n", "12"), ("a</think>b</think>c", "c"),
    ("no tag at all", None), ("", None), ("</think>", ""), ("x" + INTERRUPT_PHRASE + "42", "42"), (None, None),
])
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


# --- rewards ----------------------------------------------------------------------------------------

ARITH = Problem(0, "7+5+9+3", "24", "arith", 3, "7+5=12,12+9=21,21+3=24")


@pytest.mark.parametrize("completion, expected", [
    ("7+5=12,12+9=21,21+3=24</think>24", 1.0), ("</think>24", 1.0), ("x</think> The answer is 24.", 1.0),
    ("</think>+24", 1.0), ("</think>024", 1.0), ("<think>a</think><think>b</think>24", 1.0),
    (f"7+5=12,12{INTERRUPT_PHRASE} 24", 1.0),
    ("</think>25", -1.0), ("</think>-24", -1.0), ("</think>24.5", -1.0), ("</think>2 4", -1.0),
    ("24", -1.0), ("</think>", -1.0), ("", -1.0), ("<think>24", -1.0), ("</think>twenty-four", -1.0),
    ("24</think>", -1.0), ("</think>" + "9" * 5000, -1.0), ("</think>" + "x" * 1_000_000, -1.0),
    ("</think>٢٤", -1.0), ("</think>\x00\ud800💥", -1.0), ("</thinK>24", -1.0), ("</ think>24", -1.0), (None, -1.0),
    (b"</think>24", -1.0), (12345, -1.0),
])
def test_reward_arith_adversarial(completion, expected):
    assert reward(ARITH, completion) == expected


def test_reward_fails_a_bad_answer_and_refuses_a_task_without_a_checker():
    assert reward(Problem(0, "q", "not a number", "arith"), "</think>24") == -1.0  # the checker's error: a fail
    with pytest.raises(LookupError, match="no checker 'no-such-task' registered in data.CHECKERS"):
        reward(Problem(0, "q", "24", "no-such-task"), "</think>24")


def test_math_and_code_are_not_scored_without_their_checkers():
    """data alone registers arith only: a math or code answer is an error naming where its checker comes from, not
    a silent -1 (a run that forgot to import infra.sources would train on noise)."""
    program = ("import data\nfor task in ('math', 'code', 'rg:chain_sum'):\n    try:\n"
               "        data.reward(data.Problem(0, 'q', '72', task), '</think>72')\n    except LookupError as e:\n"
               "        print(e)\nimport sys\nprint(sorted(data.CHECKERS), 'infra' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    for line, task in zip(lines, ("math", "code", "rg:chain_sum")):
        assert line == (f"no checker {task!r} registered in data.CHECKERS: import infra.sources, which registers "
                        "math, rg: and code, or register your own")
    assert lines[3:] == ["['arith'] False"]


@pytest.mark.parametrize("gold, completion, expected", [
    ("0.75", "think</think>\\boxed{3/4}", 1.0), ("\\frac{3}{4}", "</think>0.75", 1.0),
    ("3/4", "</think>The answer is $\\frac{3}{4}$", 1.0), ("72", "</think>\\boxed{72}", 1.0),
    ("x^2+2x+1", "</think>\\boxed{(x+1)^2}", 1.0),
    ("\\frac{\\sqrt{2}}{2}", "</think>\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),
    ("\\pi", "</think>\\boxed{3.14}", -1.0), ("0.75", "</think>\\boxed{3/5}", -1.0),
    ("0.75", "\\boxed{3/4}", -1.0),  # no </think>: the thinking never closed
    ("0.75", "</think>", -1.0), ("0.75", "</think>" + "x" * 1_000_000, -1.0),
    ("0.75", "</think>ünïcødé 💥", -1.0),
    ("0.75", "</think>\\boxed{", -1.0), ("0.75", "\\boxed{3/4}</think>\\boxed{1}", -1.0),
])
def test_reward_math_verify(gold, completion, expected):
    assert reward(Problem(0, "q", gold, "math"), completion) == expected


def test_reward_math_timeout_fails_and_recovers():
    p = Problem(0, "q", "72", "math")
    t = time.time()
    assert reward(p, "</think>\\boxed{9^{9^{9^{9}}}}", timeout=1.0) == -1.0  # SymPy would run for ever
    assert time.time() - t < 5.0
    assert reward(p, "</think>\\boxed{72}") == 1.0  # a fresh checker takes over


def test_reasoning_gym_source():
    train, val = load_problems("rg:chain_sum", n_val=20, n_train=60, seed=2)
    assert len(val) == 20 and 0 < len(train) <= 60
    assert not {p.id for p in train} & {p.id for p in val}
    assert not {p.question for p in train} & {p.question for p in val}
    for p in val[:5] + train[:5]:
        assert p.task == "rg:chain_sum" and p.question.endswith(data.RG_INSTRUCTION)
        assert reward(p, f"some thinking</think> {p.answer}\n") == 1.0
        assert reward(p, f"</think>{int(p.answer) + 1}") == -1.0
        assert reward(p, p.answer) == -1.0
    assert [p.question for p in val] == [p.question for p in load_problems("rg:chain_sum", n_val=20, n_train=60,
                                                                           seed=2)[1]]
    with pytest.raises(ValueError, match="no_such_task"):
        load_problems("rg:no_such_task", n_val=2, n_train=2)


# --- dataset sources --------------------------------------------------------------------------------

ROWS = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "extra": i} for i in range(30)]


def write(path, rows, kind):
    if kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "json-columns":
        path.write_text(json.dumps({k: [r[k] for r in rows] for k in rows[0]}))
    elif kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


@pytest.mark.parametrize("kind, suffix", [("json", ".json"), ("jsonl", ".jsonl"), ("parquet", ".parquet")])
def test_local_files(tmp_path, kind, suffix):
    with pytest.raises(ValueError, match="expected a list of records"):  # a .json file of columns is not read
        load_problems(write(tmp_path / "columns.json", ROWS, "json-columns"), n_val=5)
    path = write(tmp_path / f"d{suffix}", ROWS, kind)
    train, val = load_problems(path, n_val=5, seed=1)
    assert len(val) == 5 and len(train) == 25
    assert sorted(p.id for p in train + val) == list(range(30))
    for p in train + val:
        i = p.id
        assert p.question == f"What is {i} + {i}?" + data.MATH_INSTRUCTION and p.answer == str(2 * i)
        assert p.task == "math"
    p = val[0]
    assert reward(p, f"</think>\\boxed{{{p.answer}}}") == 1.0 and reward(p, "</think>\\boxed{-1}") == -1.0
    assert load_problems(path, n_val=5, seed=1) == (train, val) and load_problems(path, n_val=5, seed=2) != (train, val)
    assert len(load_problems(path, n_val=5, n_train=7)[0]) == 7


def test_local_file_mapping_and_errors(tmp_path):
    rows = [{"q": f"Question {i % 10}", "a": i % 10, "why": "because"} for i in range(40)]  # repeated questions
    path = write(tmp_path / "d.jsonl", rows, "jsonl")
    train, val = load_problems(path, n_val=4, prompt_key="q", answer_key="a", trace_key="why")
    assert not {p.question for p in train} & {p.question for p in val}  # duplicates never leak across
    assert val[0].trace == "because" and val[0].answer in {str(i) for i in range(10)}
    with pytest.raises(ValueError, match="no column 'problem'"):
        load_problems(path, n_val=4)
    with pytest.raises(ValueError, match="holding out 40 for evaluation"):
        load_problems(path, n_val=40, prompt_key="q", answer_key="a")
    with pytest.raises(ValueError, match="does not exist"):
        load_problems(str(tmp_path / "missing.parquet"))
    with pytest.raises(ValueError, match="unknown options"):
        load_problems(path, n_val=4, levels=(1,))


def test_presets_from_local_copies(tmp_path):
    gsm = [{"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
           for i in range(10)]
    train, val = load_problems("gsm8k", n_val=2, data_path=write(tmp_path / "g.jsonl", gsm, "jsonl"))
    p = (train + val)[0]
    assert p.answer == str(int(p.question.split()[2]) + 2) and p.trace.endswith(f"= {p.answer}")
    math_rows = [{"problem": f"P{i}", "solution": f"So it is $\\boxed{{\\frac{{{i}}}{{7}}}}$."} for i in range(1, 9)]
    train, val = load_problems("math", n_val=2, data_path=write(tmp_path / "m.parquet", math_rows, "parquet"))
    p = val[0]
    assert p.answer == f"\\frac{{{p.question.split()[0][1:]}}}{{7}}"
    assert reward(p, f"</think>\\boxed{{{p.answer}}}") == 1.0
    assert last_boxed("a \\boxed{x} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None


@pytest.mark.parametrize("source", ["polaris", "gsm8k", "someone/no-such-dataset"])
def test_unreachable_hub_fails_fast(source):
    t = time.time()
    with pytest.raises(ValueError) as err:
        load_problems(source, n_val=10)
    msg = str(err.value)
    assert time.time() - t < 10 and "\n" not in msg
    assert repr(source) in msg and "--data_path=FILE" in msg


# --- bring your own data: local copies, column names, reasoning-gym options ----------------------

GSM_ROWS = [{"question": f"Sam sells {i} boxes of 1,000 pens and 234 more pens. How many pens?",
             "answer": f"{i} boxes hold {i},000 pens.\n{i},000 + 234 = {i},234\n#### {i},234"} for i in range(1, 11)]


@pytest.mark.parametrize("as_preset", [True, False])
def test_gsm8k_worked_solutions(tmp_path, as_preset):
    path = write(tmp_path / "gsm.jsonl", GSM_ROWS, "jsonl")
    train, val = load_problems("gsm8k", data_path=path, n_val=2) if as_preset else load_problems(
        path, n_val=2, prompt_key="question")  # a plain file: an answer with #### is read as a GSM8K solution
    p = next(p for p in train + val if p.question.startswith("Sam sells 1 boxes"))
    assert p.answer == "1234" and p.trace.endswith("1,000 + 234 = 1,234") and p.task == "math"
    assert reward(p, "</think>\\boxed{1234}") == 1.0 and reward(p, "</think>1234") == 1.0
    assert reward(p, "</think>\\boxed{12}") == -1.0 and reward(p, "</think>\\boxed{1,000}") == -1.0
    assert {q.answer for q in train + val} == {f"{i}234" for i in range(1, 11)}


def test_columns_and_sources_errors_list_the_choices(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"q": "1+1?", "a": "2", "extra": 0}] * 3, "jsonl")
    for kw, missing in ((dict(), "'problem'"), (dict(prompt_key="q"), "'answer'"),
                        (dict(prompt_key="q", answer_key="ans"), "'ans'")):
        with pytest.raises(ValueError) as err:
            load_problems(path, n_val=1, **kw)
        msg = str(err.value)
        assert f"no column {missing}" in msg and "['a', 'extra', 'q']" in msg and "--prompt_key/--answer_key" in msg
    with pytest.raises(ValueError, match="no column 'question'"):
        load_problems("gsm8k", data_path=path, n_val=1)  # a preset's columns apply to its local copy
    (tmp_path / "d.csv").write_text("q,a\n")
    for source in ("gsm8", "polars", "my.csv", str(tmp_path / "d.csv")):  # a name not known, a file not readable
        with pytest.raises(ValueError) as err:
            load_problems(source, n_val=1)
        msg = str(err.value)
        assert "\n" not in msg and repr(source) in msg
        assert all(name in msg for name in ("polaris", "gsm8k", "math", "deepcoder", "rg:<task>", ".jsonl", ".parquet"))
    with pytest.raises(ValueError, match="not a .json, .jsonl or .parquet file"):
        load_problems("gsm8k", data_path=str(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match=r"unknown options for source 'arith': \['data_path'\]"):
        load_problems("arith", n_val=2, data_path=path)
    with pytest.raises(ValueError, match=r"unknown options for source 'rg:chain_sum': \['prompt_key'\]"):
        load_problems("rg:chain_sum", n_val=2, prompt_key="q")
    with pytest.raises(ValueError, match="rg_options"):
        load_problems(path, n_val=1, prompt_key="q", answer_key="a", rg_options={"min_terms": 2})


def test_reasoning_gym_options_and_errors():
    by_dict = load_problems("rg:chain_sum", n_val=5, n_train=20, rg_options=dict(min_terms=4, max_terms=4))
    by_kw = load_problems("rg:chain_sum", n_val=5, n_train=20, min_terms=4, max_terms=4)
    assert by_dict == by_kw and by_dict != load_problems("rg:chain_sum", n_val=5, n_train=20)
    for p in by_dict[1]:
        assert p.question.count("+") + p.question.count("-") >= 3  # 4 terms
        assert reward(p, f"</think>{p.answer}") == 1.0
    errors = {}
    for source, kw in (("rg:chain_sum", dict(rg_options={"min_term": 2})), ("rg:chain_sum", dict(nope=1)),
                       ("rg:chain_sum", dict(min_terms=5, max_terms=2)), ("rg:chain_summ", {}), ("rg:no_such", {})):
        with pytest.raises(ValueError) as err:
            load_problems(source, n_val=2, n_train=2, **kw)
        errors[source + str(kw)] = msg = str(err.value)
        assert "\n" not in msg and source[3:] in msg
    msgs = list(errors.values())
    assert "['min_term']" in msgs[0] and "min_terms, max_terms" in msgs[0] and "['nope']" in msgs[1]
    assert "max_terms must be >= min_terms" in msgs[2]
    assert "chain_sum" in msgs[3] and "tasks, e.g." in msgs[4]  # a close match, else a few of the valid names


# --- PromptPool -------------------------------------------------------------------------------------

def pool_problems(n=10):
    return [Problem(100 + i, f"q{i}", "1", "arith") for i in range(n)]


def test_pool_epochs_are_seeded_permutations():
    pool = PromptPool(pool_problems(), seed=3)
    first = [pool.next().id for _ in range(10)]
    second = [pool.next().id for _ in range(10)]
    assert sorted(first) == sorted(second) == list(range(100, 110)) and first != second
    assert pool.epoch == 1 and pool.position == 10
    again = PromptPool(pool_problems(), seed=3)
    assert [again.next().id for _ in range(20)] == first + second
    other = PromptPool(pool_problems(), seed=4)
    assert [other.next().id for _ in range(10)] != first
    with pytest.raises(AssertionError):  # internal invariants: problems, with unique ids
        PromptPool([])
    with pytest.raises(AssertionError):
        PromptPool(pool_problems() + pool_problems(1))


def test_pool_zero_variance_filter():
    pool = PromptPool(pool_problems(), npr=False)
    kept = [pool.record(100, r) for r in ([1, 1, 1], [-1, -1, -1], [1, -1, -1], [-1, 1, 1, 1])]
    assert kept == [False, False, True, True]
    assert pool.groups_seen == 4 and pool.zero_var_dropped == 2 and pool.zero_var_frac == 0.5
    assert pool.history == {100: 0.75} and pool.npr_removed == 0
    off = PromptPool(pool_problems(), zero_var=False)
    assert off.record(100, [1, 1]) is True and off.zero_var_dropped == 0
    with pytest.raises(AssertionError):  # internal invariants: a known prompt, a non-empty group
        pool.record(7, [1])
    with pytest.raises(AssertionError):  # an internal invariant: the pipeline never records an empty group
        pool.record(100, [])


def naive_curriculum(ids, seed, epochs, passes_of, threshold=0.9):
    """Reference: per epoch, shuffle the survivors; a prompt whose latest rate >= threshold leaves at the end."""
    import random
    removed, seen = set(), []
    for epoch in range(epochs):
        order = sorted(set(ids) - removed)
        random.Random(f"pool:{seed}:{epoch}").shuffle(order)
        for i in order:
            seen.append(i)
            if passes_of(i, epoch) / 8 >= threshold:
                removed.add(i)
    return seen, removed


def test_pool_no_positive_resampling_across_epochs():
    first = dict(zip(range(100, 110), [8, 4, 0, 7, 8, 8, 4, 0, 2, 6]))  # passes out of 8 in epoch 0
    passes_of = lambda i, epoch: first[i] if epoch == 0 else (8 if epoch == 1 and i == 103 else 1)
    expected, expected_removed = naive_curriculum(list(first), 1, 4, passes_of)
    assert len(expected) == 10 + 7 + 6 + 6 and expected_removed == {100, 103, 104, 105}
    pool, seen = PromptPool(pool_problems(), seed=1), []
    while len(seen) < len(expected):
        p = pool.next()
        seen.append(p.id)
        n = passes_of(p.id, pool.epoch)
        pool.record(p.id, [1] * n + [-1] * (8 - n))
    assert seen == expected and pool.removed == expected_removed and pool.npr_removed == 4
    assert set(seen[10:17]) == {i for i, n in first.items() if n < 8}  # 7/8 = 0.875 stays in
    assert pool.history[103] == 1.0 and pool.history[101] == 0.125

    pool = PromptPool(pool_problems(3), npr_threshold=0.5)
    pool.record(100, [1, 1])
    pool.record(100, [1, -1, -1])  # the latest observed pass rate decides (a group still in flight)
    assert pool.removed == set()
    for _ in range(3):
        pool.record(pool.next().id, [1, -1])  # pass rate 0.5 >= threshold: every prompt leaves
    assert pool.npr_removed == 3 and pool.removed == {100, 101, 102}
    with pytest.raises(RuntimeError, match="No-Positive-Resampling"):
        pool.next()
    off = PromptPool(pool_problems(3), npr=False)
    for _ in range(9):
        off.record(off.next().id, [1, 1])
    assert off.npr_removed == 0 and off.epoch == 2 and off.history[100] == 1.0


def test_pool_removal_waits_for_the_epoch_boundary():
    pool = PromptPool(pool_problems(4), seed=0)
    first = pool.next()
    pool.record(first.id, [1, 1])
    pool.record(pool.order[2], [1, 1])  # a prompt not yet drawn this epoch is still drawn this epoch
    rest = [pool.next().id for _ in range(3)]
    assert sorted([first.id] + rest) == [100, 101, 102, 103]
    assert sorted(pool.next().id for _ in range(2)) == sorted(set(range(100, 104)) - pool.removed)


def test_pool_state_round_trip_mid_epoch(tmp_path):
    import torch
    pool = PromptPool(pool_problems(), seed=9, npr_threshold=0.75)
    for k in range(14):  # into the second epoch, with removals and drops on the way
        p = pool.next()
        pool.record(p.id, [1, 1, 1, 1] if k % 3 == 0 else [1, -1, -1, 1])
    state = pool.state_dict()
    torch.save(state, tmp_path / "s.pt")
    restored = [PromptPool(pool_problems(), seed=9, npr_threshold=0.75) for _ in range(2)]
    restored[0].load_state_dict(json.loads(json.dumps(state)))
    restored[1].load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))

    def run(pl):
        out = []
        for k in range(25):
            p = pl.next()
            out.append((p.id, pl.epoch, pl.position, pl.record(p.id, [1, 1] if k % 10 == 0 else [1, -1])))
        return out, pl.state_dict()

    expected = run(pool)
    assert run(restored[0]) == expected and run(restored[1]) == expected
    assert expected[1]["groups_seen"] == 39 and expected[1]["removed"]
    with pytest.raises(ValueError, match="prompt ids"):
        PromptPool(pool_problems(3)).load_state_dict(state)


@pytest.mark.parametrize("text, expected", [
    (b'{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": \n', "rows.jsonl' line 2: not valid JSON"),
    (b'{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n', "rows.jsonl' line 3: not valid JSON ("
     "Expecting value); expected one {column: value} object per line"),
    (b'{"problem": "a\x01", "answer": "1"}\n', "rows.jsonl' line 1: not valid JSON (Invalid control character"),
    (b'{"problem": "a", "answer": "1"}\n{"problem": "\xff"}\n', "rows.jsonl' line 2: not UTF-8 text"),
    (b"\n\n", "rows.jsonl' is empty"),
])
def test_a_bad_file_names_itself_and_the_line(tmp_path, text, expected):
    (tmp_path / "rows.jsonl").write_bytes(text)
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_problems(str(tmp_path / "rows.jsonl"), n_val=1)


def test_unusable_rows_are_counted_wherever_they_are(tmp_path, capsys):
    """A first row without the prompt column does not reject the file; rows without a question or an answer are
    skipped and counted in one line; too few left for the held-out set names --eval_prompts."""
    rows = [{"other": 1}] + [{"problem": f"q{i}", "answer": str(i)} for i in range(10)] + [{"problem": "x"}]
    path = write(tmp_path / "rows.jsonl", rows, "jsonl")
    train, val = load_problems(path, n_val=2)
    assert len(train) + len(val) == 10
    assert "2 of 12 rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="pass a smaller --eval_prompts"):
        load_problems(path, n_val=10)


def test_a_prompt_too_long_for_any_tokenizer_is_dropped_untokenized(tmp_path, capsys):
    import scalerl
    from infra import sources
    rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(12)] + [{"problem": "x" * 5_000_000, "answer": "1"}]
    path = write(tmp_path / "rows.jsonl", rows, "jsonl")
    cfg = scalerl.parse_args([f"--task={path}", "--model=some/model", "--eval_prompts=2", "--max_prompt=64"])
    train, val, _ = sources.load_data(cfg)
    assert len(train) + len(val) == 12 and max(len(p.question) for p in train + val) < 1000
    assert "1 prompts of over 16,384 characters skipped" in capsys.readouterr().out
