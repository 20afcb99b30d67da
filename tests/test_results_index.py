"""docs/results/INDEX.md names every current result file, names no file that is not there, and every
docs/results path the docs cite exists (pure file checks, no model)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "INDEX.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def current_files() -> list[str]:
    return sorted(
        str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
        if p.is_file() and p != INDEX and "history" not in p.relative_to(RESULTS).parts
    )


def test_every_current_result_file_is_named_in_the_index():
    text = INDEX.read_text(encoding="utf-8")
    named = set(re.findall(r"`([^`\s]+)`", text))
    assert [f for f in current_files() if f not in named] == []


def test_every_file_the_index_names_exists():
    text = INDEX.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    files = [line.split(" | ")[1] for line in rows]  # the table's second column: the files
    named = {name for cell in files for name in re.findall(r"`([^`\s]+)`", cell)}
    assert named and [n for n in sorted(named) if not (RESULTS / n).is_file()] == []
    assert set(current_files()) <= named


def expand(path: str) -> list[str]:
    """A cited path with a brace list (`x-{a,b}.txt`) is each of its forms."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not m:
        return [path]
    return [q for part in m.group(1).split(",") for q in expand(path[: m.start()] + part + path[m.end():])]


def test_every_results_path_the_docs_cite_exists():
    missing = []
    for doc in DOCS:
        if doc == INDEX or doc.is_relative_to(RESULTS):
            continue
        for cited in re.findall(r"docs/results/[\w./{},*-]*[\w*}/]", doc.read_text(encoding="utf-8")):
            for path in expand(cited):
                rel = path.removeprefix("docs/results/")
                if not rel or "{" in rel or (ROOT / path).is_dir():  # a {name} template in quoted code
                    continue
                found = list(RESULTS.glob(rel)) if "*" in rel else [RESULTS / rel] if (RESULTS / rel).is_file() else []
                if not found:
                    missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert missing == []
