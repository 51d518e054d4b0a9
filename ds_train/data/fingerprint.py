"""The fingerprint of prepare's inputs: meta.json records what data.dir was prepared from, so that
a run whose sources, tokenizer or vocabulary changed since stops instead of training on stale
tokens. Checked on every rank of every run, so it is cheap: a file whose size and mtime are
unchanged is not read again. `input_fingerprint` records what `prepare` read (every file, the
tokenizer, the split settings) and `fingerprint_differences` names what changed since.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path
from typing import Callable

from ds_train.data.meta import META
from ds_train.data.sources import STDLIB, source_files

FINGERPRINT_VERSION = 1
SETTING_DEFAULTS = {"format": "text"}  # settings recorded since (an older record did not name them)
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


def _unit_files(name: str, path: Path) -> list[tuple[str, Path]]:
    """A `datasets` directory is fingerprinted file by file."""
    if not path.is_dir():
        return [(name, path)]
    return [(f"{name}/{p.relative_to(path)}", p) for p in sorted(path.rglob("*")) if p.is_file()]


def _source_record(source: str, hashed: bool) -> dict:
    if source == STDLIB:
        return {"source": source, "kind": "stdlib", "python": platform.python_version(),
                "files": _file_records(source_files(STDLIB), hashed)}
    if not hashed and not Path(source).exists():  # a difference to report, not an error here
        return {"source": source, "kind": "path", "missing": True, "files": {}}
    files = [f for name, path in source_files(source) for f in _unit_files(name, path)]
    return {"source": source, "kind": "path", "files": _file_records(files, hashed)}


def _tokenizer_record(tokenizer: str, vocab_size: int, split_digits: bool, hashed: bool) -> dict:
    if not tokenizer:
        return {"trained": True, "vocab_size": vocab_size, **({"split_digits": True} if split_digits else {})}
    tok_dir = Path(tokenizer).resolve()
    files = _file_records([(n, tok_dir / n) for n in TOKENIZER_FILES if (tok_dir / n).is_file()], hashed)
    record = {"path": str(tok_dir), "files": files}
    if hashed:
        record["sha256"] = hashlib.sha256("".join(f"{n} {r['sha256']}\n" for n, r in files.items())
                                          .encode()).hexdigest()
    return record


def input_fingerprint(sources: list[str], tokenizer: str, vocab_size: int, val_fraction: float,
                      text_key: str, fmt: str = "text", chat_template: str = "", *, split_digits: bool = False,
                      hashed: bool = True) -> dict:
    """What `prepare` reads: every file of every source (size, mtime_ns, sha256), the tokenizer (its
    files' hashes, or the vocab_size of the BPE trained on the sources), the split and format settings.
    hashed=False: the current inputs to compare with a recorded fingerprint (hashes taken on demand)."""
    return {"version": FINGERPRINT_VERSION,
            "sources": [_source_record(s, hashed) for s in sources],
            "tokenizer": _tokenizer_record(tokenizer, vocab_size, split_digits, hashed),
            "val_fraction": val_fraction, "text_key": text_key, "format": fmt, "chat_template": chat_template}


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
                            sha256: Callable[[Path], str] = file_sha256,
                            content: Callable[[str], str] | None = None) -> list[str]:
    """How the inputs `current` (input_fingerprint) differ from those `recorded` in meta.json, one
    readable phrase each; empty when they are the same. `content(tokenizer_dir)`: the tokenizer's
    content id (data.tokenizer.content_id), so that a tokenizer is compared by what it is: one whose
    files moved or were saved again is the same."""
    if not isinstance(recorded, dict) or recorded.get("version") != FINGERPRINT_VERSION:
        return [NO_RECORD]
    try:
        return _differences(recorded, current, sha256, content)
    except (KeyError, TypeError, AttributeError, IndexError):  # a record edited or cut short
        return [f"{META}'s record of its inputs is damaged"]


def _differences(recorded: dict, current: dict, sha256: Callable[[Path], str],
                 content: Callable[[str], str] | None) -> list[str]:
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
        elif o["kind"] != n["kind"]:
            diffs.append(f"{label} (prepared from {o['source']!r})")
        elif n.get("missing"):
            diffs.append(f"{label} no longer exists")
        elif n["kind"] == "stdlib" and o["python"] != n["python"]:
            diffs.append(f"{label}: Python {o['python']} -> {n['python']}")
        else:
            diffs += [f"{label}: {d}" for d in _file_differences(o["files"], n["files"], sha256)]
    diffs += _tokenizer_differences(recorded["tokenizer"], current["tokenizer"], sha256, content)
    for key in ("val_fraction", "text_key", "format"):
        if recorded.get(key, SETTING_DEFAULTS.get(key)) != current[key]:
            diffs.append(f"data.{key} {recorded.get(key, SETTING_DEFAULTS.get(key))!r} -> {current[key]!r}")
    if recorded.get("chat_template", "") != current["chat_template"]:
        diffs.append("data.chat_template changed")
    return diffs


def _tokenizer_differences(o: dict, n: dict, sha256: Callable[[Path], str],
                           content: Callable[[str], str] | None) -> list[str]:
    """The recorded tokenizer `o` against the current `n`: a BPE to train (its settings), or a
    directory compared by its files, then by its content (the recorded content id; for a BPE
    prepare trained, the one in data.dir, whose `path` the caller fills in)."""
    if o.get("trained") and n.get("trained"):
        diffs = []
        if o["vocab_size"] != n["vocab_size"]:
            diffs.append(f"data.vocab_size {o['vocab_size']} -> {n['vocab_size']}")
        if o.get("split_digits", False) != n.get("split_digits", False):  # recorded only when true
            diffs.append(f"data.split_digits {o.get('split_digits', False)} -> {n.get('split_digits', False)}")
        return diffs
    if n.get("trained"):
        return [f"tokenizer: {o['path']!r} -> a BPE trained on the sources (data.tokenizer is empty)"]
    if not n["files"]:
        return [f"tokenizer {n['path']!r} holds no tokenizer files"]
    if not o.get("trained") and not _file_differences(o["files"], n["files"], sha256):
        return []
    recorded = o.get("content") or (content(o["path"]) if content and o.get("trained") and o.get("path") else None)
    if content and recorded and recorded == content(n["path"]):
        return []  # the same tokenizer, elsewhere or saved again
    if o.get("trained"):
        old = f"{o['path']!r} (the BPE trained on the sources)" if o.get("path") else "a BPE trained on the sources"
        return [f"tokenizer: {old} -> {n['path']!r}, a different tokenizer"]
    return [f"tokenizer {n['path']!r} changed" if o["path"] == n["path"]
            else f"tokenizer {o['path']!r} -> {n['path']!r}, a different tokenizer"]
