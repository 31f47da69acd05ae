"""The README and docs/ hold together: every relative link and image names a file that exists, and every #anchor a
heading of the page it points into (GitHub's slugs), so moving text between pages cannot leave a reader stranded."""
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

from conftest import ENV

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


def python_blocks(path):
    """The ```python blocks of a page, in order."""
    return re.findall(r"^```python\n(.*?)^```$", open(path, encoding="utf-8").read(), flags=re.M | re.S)


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
    assert "ratio max 9.0" in p.stdout and "297 train / 100 held-out" in p.stdout, p.stdout  # 3 repeats of a held-out question dropped


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
