"""The README and docs/ hold together: every relative link and image names a file that exists, and every #anchor a
heading of the page it points into (GitHub's slugs), so moving text between pages cannot leave a reader stranded."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
