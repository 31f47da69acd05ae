"""The README and docs/ hold together: every relative link and image names a file that exists, and every #anchor a
heading of the page it points into (GitHub's slugs), so moving text between pages cannot leave a reader stranded; every
table renders. And every figure the code can check is checked, so it cannot go stale: the recipe page's code names and
flags, its examples (they run), the README's code-map line counts, its commands in the order given, and the shape of
the transcript it prints."""
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ENV, python_blocks, scalerl_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # noqa: the same as conftest's
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def prose(path):
    # Indented lines are code blocks (commands, printed output), and backticks are code: neither holds links.
    lines = [ln for ln in open(path, encoding="utf-8").read().split("\n") if not ln.startswith("    ")]
    return re.sub(r"`[^`]*`", "", "\n".join(lines))


def anchors(path):
    # GitHub's slug: lower case, punctuation other than - and _ dropped, each space a hyphen.
    heads = re.findall(r"^#+ (.+)$", open(path, encoding="utf-8").read(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def links(path):
    return re.findall(r"\]\(([^)\s]+)\)", prose(path))


def test_every_link_resolves():
    bad = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            if not os.path.exists(dest):
                bad.append(f"{os.path.relpath(page, ROOT)}: {target} (no file)")
            elif anchor and anchor not in anchors(dest):
                bad.append(f"{os.path.relpath(page, ROOT)}: {target} (no heading)")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_links_and_anchors():
    readme = os.path.join(ROOT, "README.md")
    assert "docs/measurements.md#the-quick-start" in links(readme)
    assert "the-quick-start" in anchors(os.path.join(ROOT, "docs", "measurements.md"))
    assert "the-plan---dry_run" in anchors(os.path.join(ROOT, "docs", "torchrun.md"))


def run_blocks(blocks, cwd):
    """Each block run as its own script, in one process with the project root on the path; the process."""
    runner = "import json, sys\nfor block in json.loads(sys.argv[1]): exec(compile(block, 'block', 'exec'), {})"
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", runner, json.dumps(blocks)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


RECIPE = os.path.join(ROOT, "docs", "recipe.md")


def test_the_recipe_page_names_code_that_exists_and_flags_that_are_options():
    """Every `file.py:name` of docs/recipe.md is a function, class, method or table of that file, and every --flag
    of its ingredients an option of Config (or of sigmoid_fit's command line)."""
    import importlib
    import scalerl
    text = open(RECIPE, encoding="utf-8").read()
    named = re.findall(r"`((?:infra/)?\w+)\.py:([\w.]+)`", text)
    assert len(named) >= 25, named
    missing = []
    for module, attr in named:
        obj = importlib.import_module(module.replace("/", "."))
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        missing += [f"{module}.py:{attr}"] * (obj is None)
    assert not missing, missing
    ingredients = text.partition("## Extend it")[0]
    fields = {f.name for f in dataclasses.fields(scalerl.Config)}
    fit_options = set(re.findall(r'"--([\w-]+)"', open(os.path.join(ROOT, "sigmoid_fit.py")).read()))
    flags = set(re.findall(r"--(\w[\w-]*)", ingredients))
    assert len(flags) >= 20 and not flags - fields - fit_options, flags - fields - fit_options


def test_the_recipe_pages_examples_run(tmp_path):
    """The new loss, reward and task of docs/recipe.md, each block as a user would paste it."""
    blocks = python_blocks(RECIPE)
    assert len(blocks) == 3 and "LOSSES" in blocks[0] and "CHECKERS" in blocks[1] and "load_problems" in blocks[2]
    p = run_blocks(blocks, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # 297: the 3 training rows that repeat a held-out question are dropped
    assert "ratio max 9.0" in p.stdout and "297 train / 100 held-out" in p.stdout, p.stdout


def test_every_table_renders():
    """A markdown table is a header row, a |---| row and rows of the header's cell count, each on its own line (an
    escaped \\| is text): a row wrapped onto the next line, or rows run together on one, renders as broken text."""
    bad = []
    for page in PAGES:
        lines = open(page, encoding="utf-8").read().split("\n")
        rows = [(i, ln.strip()) for i, ln in enumerate(lines) if ln.strip().startswith("|") or "|---" in ln]
        tables, last = [], None
        for i, row in rows:  # consecutive rows make a table
            if last is None or i != last + 1:
                tables.append([])
            tables[-1].append((i, row))
            last = i
        for table in tables:
            cells = [len(re.split(r"(?<!\\)\|", row)) for _, row in table]
            where = f"{os.path.relpath(page, ROOT)}:{table[0][0] + 1}"
            if len(table) == 1 and not table[0][1].endswith("|"):
                continue  # a line of prose that starts with |x|
            if len(table) < 2 or not re.fullmatch(r"\|(-+\|)+", table[1][1]) or len(set(cells)) > 1 or any(
                    not row.endswith("|") or "|---" in row and k != 1 for k, (_, row) in enumerate(table)):
                bad.append(where)
    assert not bad, bad


README = os.path.join(ROOT, "README.md")
RECIPE_FILES = ("scalerl.py", "trainer.py", "losses.py", "pipeline_rl.py", "engine.py", "data.py", "sigmoid_fit.py")


def n_lines(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read().count("\n")


def test_the_readme_is_short_and_its_code_maps_line_counts_are_the_files():
    """The code map's counts (`name.py  N` rows, `runs/x.py N`) and its totals are `wc -l` of the files, and every
    recipe and infra/ module has its row. On a mismatch the message lists each row's count to write."""
    text = open(README, encoding="utf-8").read()
    assert text.count("\n") <= 300
    recipe, _, harness = text.partition("The harness, `infra/`")
    rows = [(name, n) for name, n in re.findall(r"^    ([\w/]+\.py) +(\d+)  ", recipe, flags=re.M)]
    rows += [(name if "/" in name else "infra/" + name, n)
             for name, n in re.findall(r"^    ([\w/]+\.py) +(\d+)  ", harness, flags=re.M)]
    rows += re.findall(r"(runs/\w+\.py) (\d+):", harness)
    infra = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "infra", "*.py")))
    assert {name for name, _ in rows} >= set(RECIPE_FILES) | set(infra), "a module without its row in the code map"
    totals = [("the recipe", re.search(r"The recipe, ([\d,]+) lines", recipe)[1], sum(map(n_lines, RECIPE_FILES))),
              ("infra/", re.search(r"^, ([\d,]+) lines", harness)[1], sum(map(n_lines, infra)))]
    wrong = [f"{name}: {n} in the README, {n_lines(name)} in the file" for name, n in rows if int(n) != n_lines(name)]
    wrong += [f"{name}: {n} lines in the README, {real:,} in the files" for name, n, real in totals
              if int(n.replace(",", "")) != real]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", ["README.md", "docs/own-model-and-data.md", "docs/miniature.md"])
def test_a_pages_commands_run_in_the_order_given(page, tmp_path, monkeypatch):
    """Each command that starts a run writes a directory no earlier one did (each preset its own), and each --resume,
    --eval_only or --export reads one an earlier command wrote: the page's commands, run in order, are not refused."""
    import scalerl
    monkeypatch.chdir(tmp_path)
    written, commands = set(), list(scalerl_commands(os.path.join(ROOT, page)))
    # the miniature's runs, named in its prose: one per RL seed
    commands += [("", ["--config=miniature", f"--rl_seed={s}"]) for s in range(3) if page.endswith("miniature.md")]
    assert commands
    for code, argv in commands:
        if "--dry_run" in argv:
            continue
        cfg = scalerl.parse_args(argv + ["--dry_run"])  # --dry_run: no vLLM needed to read the options
        if cfg.resume or cfg.eval_only or cfg.export:
            assert cfg.out_dir in written, f"{page}: {code}: reads {cfg.out_dir}, which no earlier command wrote"
        else:
            assert cfg.out_dir not in written, f"{page}: {code}: {cfg.out_dir} already holds an earlier run"
            written.add(cfg.out_dir)


def shape(line, run_dir):
    """A printed line with its run directory as RUN, every number as 9 and runs of spaces as one."""
    line = line.replace(str(run_dir), "RUN")
    return " ".join(re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "9", line).split())


@pytest.mark.slow
def test_the_readmes_transcript_has_the_shape_of_what_a_run_prints(finished_run, tmp_path):
    """Each line the README shows a run ending with has the shape of a line that a smoke run (the session's finished
    run) or its sigmoid fit prints, and every line a run ends with is shown: the transcript cannot go stale."""
    import sigmoid_fit
    text = open(README, encoding="utf-8").read()
    shown = text[text.index("The run ends by"):text.index("![held-out pass rate")]
    readme = [shape(ln[4:], "out/tiny") for ln in shown.split("\n") if ln.startswith("    ")]
    printed = (finished_run.parent / "stdout.txt").read_text().split("\n")
    last_step = max(i for i, ln in enumerate(printed) if ln.startswith("step "))
    ending = [ln for ln in printed[last_step:] if ln and not ln.startswith("sigmoid fit skipped")]
    # the fit's lines (the smoke run is too short to fit): the README's own curve, fitted as the run fits it
    rates = re.findall(r"\d\.\d{3}", text[text.index("every 10 steps:"):text.index("The run ends by")])
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "metrics.jsonl").write_text("".join(
        json.dumps(dict(step=10 * i, device_hours=0.00924 * i / 12, pass_rate=float(r))) + "\n"
        for i, r in enumerate(rates)))
    fit = sigmoid_fit.analyze([str(tmp_path / "tiny")], plot=str(tmp_path / "tiny" / "curve.png")).split("\n")
    can_print = {shape(ln, finished_run) for ln in ending} | {shape(ln, tmp_path / "tiny") for ln in fit}
    assert len(rates) == 13 and not [ln for ln in readme if ln and ln not in can_print], (readme, can_print)
    assert not [ln for ln in ending if shape(ln, finished_run) not in readme], ending
