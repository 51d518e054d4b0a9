"""The documentation as a whole: the README is a front door (the two commands first, short, every
docs/ page linked from it), every relative link of README.md, docs/*.md and BENCHMARKS.md reaches a
file that exists (and a heading of it, for a `#anchor`), and the figure blocks the benches rewrite
are where the benches look for them.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from conftest import ROOT
from doc_commands import collect

README_MAX_LINES = 280  # issue 41: "under ~250 lines"; the reference lives in docs/
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\".*\")?\s*$")
EXTERNAL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "BENCHMARKS.md"]


def prose(text: str, code_spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked unless `code_spans`."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        mark = line.lstrip()[:3]
        if mark in ("```", "~~~"):
            fence = None if fence == mark else (fence or mark)
            continue
        if fence is None:
            out.append((number, line if code_spans else re.sub(r"(`+)(.+?)\1", "", line)))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """Every link and image target in the prose of a markdown text, with its line number."""
    found = []
    for number, line in prose(text):
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
        ref = REFERENCE.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return found


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings; a repeated one gets -1, -2, ... as on GitHub."""
    out: set[str] = set()
    for _, line in prose(text, code_spans=True):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base, n = anchor(m.group(1)), 0
            while (name := base if n == 0 else f"{base}-{n}") in out:
                n += 1
            out.add(name)
    return out


def broken_links(root: Path, files: list[Path]) -> list[str]:
    """`FILE:LINE: target (why)` for each relative link that reaches no file, or no heading of it."""
    out = []
    for page in files:
        text = page.read_text()
        for number, target in links(text):
            if EXTERNAL.match(target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                out.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
                out.append(f"{where} (no heading #{fragment} in {dest.relative_to(root)})")
    return out


def test_every_relative_link_of_the_docs_reaches_a_file_and_its_heading():
    broken = broken_links(ROOT, pages(ROOT))
    assert not broken, "relative links that lead nowhere:\n" + "\n".join(broken)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `run` directory\n\ntext\n")
    (tmp_path / "img.png").write_bytes(b"")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#the-run-directory) ![ok](img.png) [ok](https://x.org/none.md)\n"
        "[gone](docs/b.md) and [bad anchor](docs/a.md#nothing) and ![gone](docs/img.png)\n"
        "`[in code](docs/c.md)`\n```\n[in a block](docs/d.md)\n```\n[self](#no-such)\n[ref]: docs/e.md\n")
    assert broken_links(tmp_path, [tmp_path / "README.md"]) == [
        "README.md:2: docs/b.md (no such file)",
        "README.md:2: docs/a.md#nothing (no heading #nothing in docs/a.md)",
        "README.md:2: docs/img.png (no such file)",
        "README.md:7: #no-such (no heading #no-such in README.md)",
        "README.md:8: docs/e.md (no such file)"]


def test_the_readme_is_a_front_door_linking_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README grows: move the reference into docs/"
    first = [d.text for d in collect(ROOT)[:2]]
    assert first == ["bash scripts/quickstart.sh", "bash scripts/test.sh"], first
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(readme)}
    unlinked = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_figure_blocks_the_benches_rewrite_are_in_their_files():
    """bench/rl_vs_sft.py and bench/dpo.py rewrite the text between `<!-- NAME:start -->` and
    `<!-- NAME:end -->` in their FIGURES page and in BENCHMARKS.md: each pair is there once, in order."""
    rl = importlib.import_module("bench.rl_vs_sft")
    dpo = importlib.import_module("bench.dpo")
    blocks = [(rl.FIGURES, demo.marker) for demo in rl.DEMOS.values()] + [(dpo.FIGURES, "dpo-bench")]
    for path, name in blocks + [(ROOT / "BENCHMARKS.md", name) for _, name in blocks]:
        text = path.read_text()
        begin, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
        assert text.count(begin) == 1 and text.count(end) == 1, (path, name)
        assert text.index(begin) < text.index(end), (path, name)
    assert {p.relative_to(ROOT).as_posix() for p, _ in blocks} == {"docs/post_training.md", "docs/fine_tuning.md"}


ARCHITECTURE_ENTRIES = ("A new RL advantage estimator", "A new parallel dimension", "How a checkpoint is committed",
                        "A new subcommand", "A new doctor finding", "A new data format")


def paths_named(text: str) -> list[str]:
    """The repository paths a page names in code spans (`ds_train/...`, `tests/...`): a file or a folder."""
    spans = re.findall(r"`([^`\s]+)`", text)
    return [s.rstrip("/") for s in spans if re.match(r"(ds_train|tests|bench|scripts|recipes|ds_configs)/", s)]


def missing_paths(text: str, root: Path) -> list[str]:
    return [p for p in paths_named(text) if not (root / p).exists()]


def test_the_architecture_names_where_each_change_goes_and_every_path_it_names_exists():
    """docs/ARCHITECTURE.md maps each kind of change to its files, one line each; a path that a move
    or a rename left behind fails here."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    lines = {line.split("**")[1]: line for line in text.splitlines() if line.startswith("- **")}
    assert set(ARCHITECTURE_ENTRIES) <= set(lines), set(ARCHITECTURE_ENTRIES) - set(lines)
    for entry in ARCHITECTURE_ENTRIES:
        assert any(p.startswith("ds_train/") for p in paths_named(lines[entry])), entry
        assert any(p.startswith("tests/") for p in paths_named(lines[entry])), entry
    assert len(paths_named(text)) >= 20
    assert missing_paths(text, ROOT) == []
    packages = {p.name for p in (ROOT / "ds_train").iterdir() if (p / "__init__.py").is_file()}
    assert all(f"`{name}/`" in text for name in packages), packages  # every room on the floor plan


def test_a_path_the_architecture_names_that_is_gone_is_found():
    assert paths_named("`ds_train/run.py` and `ds_train/start.py`, `tests/x.py`, `docs/y.md`, `ript/`") == [
        "ds_train/run.py", "ds_train/start.py", "tests/x.py"]
    page = "`ds_train/start.py` builds it; `ds_train/trainer.py` (a module that moved) and `tests/test_run.py`"
    assert missing_paths(page, ROOT) == ["ds_train/trainer.py"]
