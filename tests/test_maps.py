"""The two maps stay whole: benchmarks/README.md names every benchmark script, docs/README.md
every page, and every result at the top of benchmarks/results/ is named somewhere a reader
looks (the README, docs/, benchmarks/README.md or a write-up beside it). Links and result paths
in the Markdown point at files that exist, so a move into results/archive/ cannot leave a
dangling reference behind."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
DOCS = REPO / "docs"


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8")


def _names(name: str, text: str) -> bool:
    """`name` appears in `text` as a whole file name, or through the shorthands the write-ups
    use: `stem.*`, `stem.{md,json}`, a folder as `name/`."""
    stem, dot, ext = name.partition(".")
    if re.search(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])", text):
        return True
    if not dot:
        return False
    if re.search(r"(?<![\w-])" + re.escape(stem) + r"\.\*", text):
        return True
    return any(ext in m.split(",") for m in re.findall(r"(?<![\w-])" + re.escape(stem) + r"\.\{([\w,]+)\}", text))


def _markdown_sources() -> list[Path]:
    return ([REPO / "README.md", BENCH / "README.md"] + sorted(DOCS.rglob("*.md"))
            + sorted(RESULTS.rglob("*.md")))


def test_benchmark_map_names_every_script():
    text = _read(BENCH / "README.md")
    scripts = sorted(p.name for p in BENCH.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))
    assert scripts, "no benchmark scripts found"
    missing = [s for s in scripts if f"`{s}`" not in text]
    assert not missing, f"benchmarks/README.md does not name: {missing}"


def test_docs_index_names_every_page():
    text = _read(DOCS / "README.md")
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*")
                   if p.is_file() and p.name != "README.md")
    assert pages, "no docs pages found"
    missing = [p for p in pages if f"({p})" not in text]
    assert not missing, f"docs/README.md does not link: {missing}"


def test_every_top_level_result_is_named():
    readers = [REPO / "README.md", BENCH / "README.md"] + sorted(DOCS.rglob("*.md"))
    writeups = sorted(RESULTS.glob("*.md"))
    entries = sorted(p for p in RESULTS.iterdir() if p.name != "archive")
    assert entries, "benchmarks/results/ is empty"
    missing = []
    for entry in entries:
        texts = [_read(p) for p in readers + writeups if p != entry]
        if not any(_names(entry.name, t) for t in texts):
            missing.append(entry.name)
    assert not missing, ("named nowhere (README.md, docs/, benchmarks/README.md or a write-up in "
                         f"benchmarks/results/): {missing}; move superseded runs to results/archive/")


def test_every_archived_result_says_what_replaced_it():
    text = _read(RESULTS / "archive" / "README.md")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    missing = []
    for p in sorted((RESULTS / "archive").iterdir()):
        if p.name == "README.md":
            continue
        stem, _, ext = p.name.partition(".")
        # a row names the file itself, or its stem's first file followed by `.ext`
        if not any(_names(p.name, r) or (f"`{stem}." in r and f"`.{ext}`" in r) for r in rows):
            missing.append(p.name)
    assert not missing, f"results/archive/README.md has no line for: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", _read(md), flags=re.M)}


def test_markdown_links_and_result_paths_resolve():
    bad = []
    for src in _markdown_sources():
        text = _read(src)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            dest = (src.parent / path).resolve()
            if not dest.exists():
                bad.append(f"{src.relative_to(REPO)}: link to missing {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{src.relative_to(REPO)}: no heading for #{anchor} in {path}")
        # result paths written out in full (not inside `git show REV:path`); `x.{md,json}`
        # names each extension, `x.*` any
        for path, tail in re.findall(r"(?<![\w:/.-])(benchmarks/results/[\w./-]*\w)(\.\{[\w,]+\}|\.\*)?", text):
            if tail == ".*":
                ok = any((REPO / path).parent.glob((REPO / path).name + ".*"))
                paths = [] if ok else [path + tail]
            else:
                paths = [path + "." + e for e in tail[2:-1].split(",")] if tail else [path]
            bad += [f"{src.relative_to(REPO)}: {q} does not exist" for q in paths if not (REPO / q).exists()]
    assert not bad, "\n".join(bad)
