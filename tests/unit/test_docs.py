"""The docs stay navigable and short: every relative link in README.md, docs/**/*.md and trainer_example/README.md
names a file that exists and, with a #anchor, a heading of that file (GitHub's slug); the README stays under 12 KB
and every doc under docs/ (and trainer_example/README.md) under 25 KB (docs/history/, the dated runs, excepted)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 12_000
DOC_LIMIT = 25_000

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files():
    files = [ROOT / "README.md", ROOT / "trainer_example" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def prose_lines(text):
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m.group()) - 2) + "`", line)


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)       # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            found.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return found


def links(path):
    for i, line in enumerate(prose_lines(path.read_text()), 1):
        for m in LINK.finditer(line):
            yield i, m.group(1)


def test_slug_matches_github():
    assert slug("Speculation on vs off (`bench/speculation.py`)") == "speculation-on-vs-off-benchspeculationpy"
    assert slug("k = 0 costs (almost) nothing") == "k--0-costs-almost-nothing"
    assert slug("Checked against measured GPU steps (H200)") == "checked-against-measured-gpu-steps-h200"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for line, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"line {line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {line}: {target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size < README_LIMIT, f"README.md is {size} bytes (limit {README_LIMIT}): move detail into docs/"


def test_every_doc_is_under_the_limit():
    history = ROOT / "docs" / "history"
    big = {str(f.relative_to(ROOT)): f.stat().st_size for f in doc_files()
           if f != ROOT / "README.md" and not f.is_relative_to(history) and f.stat().st_size >= DOC_LIMIT}
    assert not big, f"over {DOC_LIMIT} bytes (dated runs belong in docs/history/): {big}"
