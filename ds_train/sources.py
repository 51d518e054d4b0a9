"""Data sources: which files a source holds, their documents, and the fingerprint of prepare's inputs.

A source (an entry of data.sources) is a text or JSONL file, a directory of them, the bundled
`python-stdlib` corpus, or a generated source `name:arg`. iter_documents reads their documents
(UTF-8 text, a JSONL record's text field), and check_sources checks them all before anything is
written. input_fingerprint records what `prepare` read (every file, the tokenizer, the split
settings) and fingerprint_differences names what changed since.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ds_train.errors import UserError

STDLIB = "python-stdlib"
# A generated source `name:arg` (for instance `ript-demos:32`): the caller maps each name to a
# function of `arg` that yields (document name, text). This module knows none of them itself.
Generators = Mapping[str, Callable[[str], Iterator[tuple[str, str]]]]
STDLIB_MAX_BYTES = 6 * 1024 * 1024  # "a few MB": enough text for a small model to learn from
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".yaml", ".yml", ".toml", ".c", ".h"}


def python_stdlib_files(max_bytes: int = STDLIB_MAX_BYTES) -> list[Path]:
    """The bundled default corpus: this Python's own standard-library source, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    # Skipped: tests, GUI demos, and the codec tables in encodings/ (hex tables, not Python prose).
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
            "encodings"}
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        files.append(path)
        total += size
    return files


def _is_text_file(path: Path) -> bool:
    return path.suffix == ".jsonl" or path.suffix in TEXT_SUFFIXES or not path.suffix


DIRECTORY_FILES = (f"files named *{', *'.join(sorted(TEXT_SUFFIXES | {'.jsonl'}))} or without a suffix; "
                   f"hidden files and directories are skipped")


def _source_files(source: str) -> list[tuple[str, Path]]:
    """(name relative to the source, path) of each file a path source contributes, in order: a file
    named in data.sources whatever its suffix; in a directory, the DIRECTORY_FILES. Every one must
    be UTF-8 text (_read_text).

    Names, not paths, decide the train/val split, which must not depend on where the corpus sits.
    """
    path = Path(source)
    if not path.exists():
        raise UserError(f"data.sources: {source!r} does not exist; correct the path or remove it from "
                        f"data.sources")
    if not path.is_dir():
        return [(path.name, path)]
    files = (p for p in sorted(path.rglob("*")) if p.is_file() and _is_text_file(p))
    return [(str(p.relative_to(path)), p) for p in files
            if not any(part.startswith(".") for part in p.relative_to(path).parts)]


def _read_text(path: Path, source: str) -> str:
    """A source file's text: UTF-8 without NUL bytes, else one line naming the file and the fix (a
    binary file in a source directory would otherwise be tokenised as replacement characters)."""
    data = path.read_bytes()
    why = f"a NUL byte at offset {data.index(0)}" if 0 in data else ""
    if not why:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            why = f"byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8"
    if Path(source).is_dir():
        fix = f"remove it from {source!r}, or list only its text files in data.sources"
    else:
        fix = "convert it to UTF-8 or remove it from data.sources"
    raise UserError(f"data.sources: {str(path)!r} is not UTF-8 text ({why}: a binary file?); {fix}")


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(str(p.relative_to(root)), p) for p in python_stdlib_files()]


def check_source_files(sources: list[str], generators: Generators) -> None:
    """Every path source exists and contributes a file."""
    for i, source in enumerate(sources):
        if source != STDLIB and source.partition(":")[0] not in generators and not _source_files(source):
            raise UserError(f"data.sources[{i}]: {source!r} holds no text documents (a directory source "
                            f"reads {DIRECTORY_FILES}); remove it from data.sources or add text files")


def no_documents_error(sources: list[str]) -> UserError:
    return UserError(f"data.sources: {sources} hold no text documents (every file or record is empty); add "
                     f"text to them or name other sources")


def check_sources(sources: list[str], text_key: str = "text", generators: Generators = {}) -> None:
    """Every source exists and every document reads (UTF-8 text, JSONL records with a text field),
    and there is one at least: checked before anything is written, so a bad source leaves nothing."""
    check_source_files(sources, generators)
    if sum(1 for _ in iter_documents(sources, text_key, generators)) == 0:  # reads them all
        raise no_documents_error(sources)


def iter_documents(sources: list[str], text_key: str = "text",
                   generators: Generators = {}) -> Iterator[tuple[str, str]]:
    """(name, text) for each non-empty document: a text file is one document, each JSONL line one."""
    for name, text in _documents(sources, text_key, generators):
        if text.strip():
            yield name, text


def _documents(sources: list[str], text_key: str, generators: Generators) -> Iterator[tuple[str, str]]:
    for source in sources:
        name, _, arg = source.partition(":")
        if source != STDLIB and name in generators:
            yield from generators[name](arg)
            continue
        for rel, p in _stdlib_files() if source == STDLIB else _source_files(source):
            text = _read_text(p, source)
            if p.suffix != ".jsonl":
                yield rel, text
                continue
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_key]
                except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                    text = None
                if not isinstance(text, str):
                    raise UserError(f"{p}:{lineno}: expected a JSON object with a string "
                                    f"{text_key!r} field (set data.text_key)")
                yield f"{rel}:{lineno}", text


# --- the fingerprint of prepare's inputs ---------------------------------------------------------
# meta.json records what data.dir was prepared from, so that a run whose sources, tokenizer or
# vocabulary changed since stops instead of training on stale tokens. Checked on every rank of every
# run, so it is cheap: a file whose size and mtime are unchanged is not read again.

FINGERPRINT_VERSION = 1
NO_RECORD = "prepared without a record of its inputs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_records(files: list[tuple[str, Path]], hashed: bool) -> dict[str, dict]:
    """name -> size, mtime_ns and the content's sha256 (hashed) or the path to hash it later (not)."""
    out = {}
    for name, path in files:
        st = path.stat()
        out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                     **({"sha256": file_sha256(path)} if hashed else {"path": str(path)})}
    return out


def _source_record(source: str, generators: Generators, hashed: bool) -> dict:
    if source == STDLIB:
        return {"source": source, "kind": "stdlib", "python": platform.python_version(),
                "files": _file_records(_stdlib_files(), hashed)}
    if source.partition(":")[0] in generators:
        return {"source": source, "kind": "generated"}
    if not hashed and not Path(source).exists():  # a difference to report, not an error here
        return {"source": source, "kind": "path", "missing": True, "files": {}}
    return {"source": source, "kind": "path", "files": _file_records(_source_files(source), hashed)}


def _tokenizer_record(tokenizer: str, vocab_size: int, hashed: bool) -> dict:
    if not tokenizer:
        return {"trained": True, "vocab_size": vocab_size}
    tok_dir = Path(tokenizer).resolve()
    files = _file_records([(n, tok_dir / n) for n in TOKENIZER_FILES if (tok_dir / n).is_file()], hashed)
    record = {"path": str(tok_dir), "files": files}
    if hashed:
        record["sha256"] = hashlib.sha256("".join(f"{n} {r['sha256']}\n" for n, r in files.items())
                                          .encode()).hexdigest()
    return record


def input_fingerprint(sources: list[str], tokenizer: str, vocab_size: int, val_fraction: float,
                      text_key: str, generators: Generators = {}, hashed: bool = True) -> dict:
    """What `prepare` reads: every file of every source (size, mtime_ns, sha256), the tokenizer (its
    files' hashes, or the vocab_size of the BPE trained on the sources) and the split settings.
    hashed=False: the current inputs to compare with a recorded fingerprint (hashes taken on demand)."""
    return {"version": FINGERPRINT_VERSION,
            "sources": [_source_record(s, generators, hashed) for s in sources],
            "tokenizer": _tokenizer_record(tokenizer, vocab_size, hashed),
            "val_fraction": val_fraction, "text_key": text_key}


def _file_differences(old: dict, new: dict, sha256: Callable[[Path], str]) -> list[str]:
    """Size and mtime equal: the same file, unread. Size equal, mtime not: the same if the content
    hashes the same (a copy). Size different: changed."""
    out = []
    for name, o in old.items():
        n = new.get(name)
        if n is None:
            out.append(f"{name} removed")
        elif n["size"] != o["size"]:
            out.append(f"{name} size {o['size']} -> {n['size']}")
        elif n["mtime_ns"] != o["mtime_ns"] and (n.get("sha256") or sha256(Path(n["path"]))) != o["sha256"]:
            out.append(f"{name} content changed (same size)")
    return out + [f"{name} added" for name in new if name not in old]


def fingerprint_differences(recorded: dict | None, current: dict,
                            sha256: Callable[[Path], str] = file_sha256) -> list[str]:
    """How the inputs `current` (input_fingerprint) differ from those `recorded` in meta.json, one
    readable phrase each; empty when they are the same."""
    if not isinstance(recorded, dict) or recorded.get("version") != FINGERPRINT_VERSION:
        return [NO_RECORD]
    try:
        return _differences(recorded, current, sha256)
    except (KeyError, TypeError, AttributeError, IndexError):  # a record edited or cut short
        return ["meta.json's record of its inputs is damaged"]


def _differences(recorded: dict, current: dict, sha256: Callable[[Path], str]) -> list[str]:
    diffs = []
    old_sources, new_sources = recorded["sources"], current["sources"]
    for i in range(max(len(old_sources), len(new_sources))):
        if i >= len(new_sources):
            diffs.append(f"data.sources[{i}] {old_sources[i]['source']!r} removed")
            continue
        o, n = old_sources[i] if i < len(old_sources) else None, new_sources[i]
        label = f"data.sources[{i}] {n['source']!r}"
        if o is None:
            diffs.append(f"{label} added")
        elif o["kind"] != n["kind"] or (n["kind"] == "generated" and o["source"] != n["source"]):
            diffs.append(f"{label} (prepared from {o['source']!r})")
        elif n.get("missing"):
            diffs.append(f"{label} no longer exists")
        elif n["kind"] == "stdlib" and o["python"] != n["python"]:
            diffs.append(f"{label}: Python {o['python']} -> {n['python']}")
        elif n["kind"] != "generated":
            diffs += [f"{label}: {d}" for d in _file_differences(o["files"], n["files"], sha256)]
    o, n = recorded["tokenizer"], current["tokenizer"]
    if o.get("trained") and n.get("trained"):
        if o["vocab_size"] != n["vocab_size"]:
            diffs.append(f"data.vocab_size {o['vocab_size']} -> {n['vocab_size']}")
    elif o.get("trained"):
        diffs.append(f"tokenizer: a BPE trained on the sources -> {n['path']!r}")
    elif n.get("trained"):
        diffs.append(f"tokenizer: {o['path']!r} -> a BPE trained on the sources (data.tokenizer is empty)")
    elif not n["files"]:
        diffs.append(f"tokenizer {n['path']!r} holds no tokenizer files")
    elif _file_differences(o["files"], n["files"], sha256):
        diffs.append(f"tokenizer {n['path']!r} changed" if o["path"] == n["path"]
                     else f"tokenizer {o['path']!r} -> {n['path']!r}")
    for key in ("val_fraction", "text_key"):
        if recorded[key] != current[key]:
            diffs.append(f"data.{key} {recorded[key]!r} -> {current[key]!r}")
    return diffs
