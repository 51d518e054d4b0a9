"""The commands the documentation shows, collected in the order a reader meets them: the README's,
then docs/*.md's, then the benches' READMEs (bench/**/README.md), then the recipes' comments
(tests/test_doc_commands.py runs or checks each one).

In Markdown a command is a line of a fenced block: every line of a `bash` / `sh` / `shell` block,
and the `$ `-prompted lines of a `console` block or one without a language (the rest of those is
output). A `# comment` ending a line is dropped, and a line ending in `\\` continues on the next.
In prose, an inline code span (`` `ds-train export ...` ``, possibly broken over two lines of its
paragraph) is a command when its first word is one of PROGRAMS, and so is a line of an indented
code block (four spaces, after a blank line) that starts with one of them or with `source`. In a
recipe, a comment line indented by three spaces (`#   deepspeed ... \\`) is a command when its first
word is one of PROGRAMS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROGRAMS = ("ds-train", "deepspeed", "torchrun", "python", "python3", "bash", "sbatch", "srun")
SHELL_BLOCKS = ("bash", "sh", "shell")
PROMPTED_BLOCKS = ("console", "")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)  # an inline code span (its backticks, its text)


@dataclass(frozen=True)
class Documented:
    text: str  # the command as a shell reads it: continuations joined, whitespace collapsed, no comment
    where: str  # FILE:LINE of its first line

    @property
    def program(self) -> str:
        """The first word after any VAR=value assignments."""
        words = self.text.split()
        return next((w for w in words if not ASSIGNMENT.fullmatch(w)), "")


def collect(root: Path) -> list[Documented]:
    """Every documented command under `root`, in reading order (README.md, docs/*.md,
    bench/**/README.md, recipes/*.yaml)."""
    out: list[Documented] = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md")),
                 *sorted((root / "bench").glob("**/README.md"))]:
        out += markdown_commands(path.read_text(), str(path.relative_to(root)))
    for path in sorted((root / "recipes").glob("*.yaml")):
        out += recipe_commands(path.read_text(), str(path.relative_to(root)))
    return out


def markdown_commands(text: str, name: str) -> list[Documented]:
    out: list[Documented] = []
    lang = None  # None: outside a fenced block
    block: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, block = line.strip()[3:].strip().lower(), []
            else:
                out += _block_commands(block, lang, name)
                lang = None
            prose.append((number, ""))  # a fence ends a paragraph
        elif lang is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    out += _inline_commands(prose, name) + _indented_commands(prose, name)
    return sorted(out, key=lambda d: int(d.where.rsplit(":", 1)[1]))  # stable: a line's spans in order


def _paragraphs(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(first line's number, its lines joined by newlines) of each run of non-blank lines."""
    out: list[tuple[int, str]] = []
    current: list[tuple[int, str]] = []
    for number, line in [*lines, (0, "")]:
        if line.strip():
            current.append((number, line))
        elif current:
            out.append((current[0][0], "\n".join(text for _, text in current)))
            current = []
    return out


def _inline_commands(prose: list[tuple[int, str]], name: str) -> list[Documented]:
    out = []
    for first, text in _paragraphs(prose):
        for m in SPAN.finditer(text):
            words = m.group(2).split()
            if words and words[0] in PROGRAMS:
                out.append(Documented(" ".join(words), f"{name}:{first + text[:m.start()].count(chr(10))}"))
    return out


def _indented_commands(prose: list[tuple[int, str]], name: str) -> list[Documented]:
    out, previous = [], ""
    block: list[tuple[int, str]] = []
    for number, line in [*prose, (0, "")]:
        if line.startswith("    ") and line.strip() and (block or not previous.strip()):
            block.append((number, line.strip()))
        elif not line.strip() and block and number:
            continue  # a blank line inside an indented block (number 0: the end)
        elif block:
            out += [Documented(" ".join(strip_comment(text).split()), f"{name}:{n}")
                    for n, text in logical_lines(block) if text.split()[0] in (*PROGRAMS, "source")]
            block = []
        previous = line
    return out


def _block_commands(block: list[tuple[int, str]], lang: str, name: str) -> list[Documented]:
    if lang not in SHELL_BLOCKS + PROMPTED_BLOCKS:
        return []
    out = []
    for number, line in logical_lines(block):
        if lang in PROMPTED_BLOCKS:
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        command = " ".join(strip_comment(line).split())
        if command:
            out.append(Documented(command, f"{name}:{number}"))
    return out


def recipe_commands(text: str, name: str) -> list[Documented]:
    out: list[Documented] = []
    joined: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        body = line[1:] if line.startswith("#") else ""
        first = body.split()[0] if body.startswith("   ") and body[3:4].strip() else ""
        if joined or first in PROGRAMS:  # a command, or the continuation of one
            joined.append((number, body.strip()))
            if not strip_comment(body).endswith("\\"):
                out += [Documented(" ".join(strip_comment(command).split()), f"{name}:{n}")
                        for n, command in logical_lines(joined)]
                joined = []
    return out


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines ending in a backslash joined to the next, each numbered by its first line."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
        stripped = line.rstrip()
        if stripped.endswith("\\") and strip_comment(stripped) == stripped:  # a comment ending in \\ ends the line
            pending = (number, stripped[:-1].rstrip())
            continue
        pending = None
        out.append((number, line))
    if pending is not None:
        out.append(pending)
    return out


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment`: a # that starts a word outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()
