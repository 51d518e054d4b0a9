"""Data sources: which files a source holds, and their records streamed in chunks.

A source (an entry of data.sources) is a file, a directory of them, a Hugging Face `datasets`
directory (saved with `save_to_disk`), or the bundled `python-stdlib` corpus. Files by kind:
text (.txt, .py, .md, ...: one document each), JSONL (.jsonl, .jsonl.gz: a record per line),
parquet (a record per row) and files `datasets` loads locally (.csv, .arrow). `chunks` streams
them in bounded pieces (raw lines, texts or rows, never a whole corpus) and `records` turns a
chunk into (name, record) pairs, checking each one; prepare's worker processes do that part.
What `prepare` read is recorded by ds_train.data.fingerprint.
"""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ds_train.errors import UserError

STDLIB = "python-stdlib"
STDLIB_MAX_BYTES = 6 * 1024 * 1024  # "a few MB": enough text for a small model to learn from
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".yaml", ".yml", ".toml", ".c", ".h"}
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".csv", ".arrow")  # a record per line / row
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # save_to_disk writes these
CHUNK_BYTES = 2 << 20  # the text a chunk carries at most (one larger document goes alone)
CHUNK_ROWS = 2048  # the rows of a table a chunk carries at most


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


def _kind(path: Path) -> str:
    """How a file is read: 'text' (one document), 'jsonl', 'parquet' or 'table' (via `datasets`)."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".csv", ".arrow")):
        return "table"
    return "text"


def _is_source_file(path: Path) -> bool:
    return path.name.lower().endswith(RECORD_SUFFIXES) or path.suffix in TEXT_SUFFIXES or not path.suffix


def is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS)


DIRECTORY_FILES = (f"files named *{', *'.join(sorted(TEXT_SUFFIXES | set(RECORD_SUFFIXES)))} or without a "
                   f"suffix; hidden files and directories are skipped")


def _source_files(source: str, key: str = "data.sources") -> list[tuple[str, Path]]:
    """(name relative to the source, path) of each file a path source contributes, in order: a file
    named in data.sources whatever its suffix; in a directory, the DIRECTORY_FILES; a `datasets`
    directory is one unit (every file in it is fingerprinted). `key`: the config key that names the
    sources (data.sources; a data-driven task's ript.tasks[i].data), for messages.

    Names, not paths, decide the train/val split, which must not depend on where the corpus sits.
    """
    path = Path(source)
    if not path.exists():
        listed = key.rpartition("[")[0] or key  # the list, where `key` names an entry of it
        raise UserError(f"{key}: {source!r} does not exist; correct the path or remove it from {listed}")
    if not path.is_dir() or is_dataset_dir(path):
        return [(path.name, path)]
    files = (p for p in sorted(path.rglob("*")) if p.is_file() and _is_source_file(p))
    out = [(str(p.relative_to(path)), p) for p in files
           if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    for name, _ in out:  # the OS gives names as bytes; one that is not UTF-8 cannot name a document
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(name).decode("utf-8", "backslashreplace")
            raise UserError(f"{key}: {source!r} holds a file whose name is not UTF-8 ('{shown}'); rename it "
                            f"in UTF-8 (convmv -f latin1 -t utf-8 does a whole tree) or move it out") from None
    return out


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(str(p.relative_to(root)), p) for p in python_stdlib_files()]


def source_files(source: str, key: str = "data.sources") -> list[tuple[str, Path]]:
    return _stdlib_files() if source == STDLIB else _source_files(source, key)


def check_source_files(sources: list[str]) -> None:
    """Every path source exists and contributes a file."""
    for i, source in enumerate(sources):
        if source != STDLIB and not _source_files(source, f"data.sources[{i}]"):
            raise UserError(f"data.sources[{i}]: {source!r} holds no documents (a directory source "
                            f"reads {DIRECTORY_FILES}); remove it from data.sources or add files")


def no_documents_error(sources: list[str]) -> UserError:
    return UserError(f"data.sources: {sources} hold no text documents (every file or record is empty); add "
                     f"text to them or name other sources")


def input_bytes(sources: list[str]) -> int:
    """The size of every file the sources hold (a progress bar's total)."""
    return sum(_size(path) for source in sources for _, path in source_files(source))


def _size(path: Path) -> int:
    """A file's size, or the sum of a (`datasets`) directory's files."""
    return sum(p.stat().st_size for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())


# --- streaming the records -----------------------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    """A bounded piece of one file: raw JSONL lines, a text file's bytes, or a table's rows."""
    source: int  # index in data.sources (or the key's list)
    file: str  # the path, for messages
    name: str  # the file's name within its source (documents are named after it)
    kind: str  # "text", "jsonl" or "rows"
    first: int  # line (jsonl, from 1) or row (rows, from 0) of items[0]
    items: list  # bytes (text, jsonl) or dicts (rows)
    nbytes: int  # input bytes this chunk moves the progress on by
    directory: str = ""  # the directory source the file came from (for the fix a message names)
    key: str = "data.sources"  # the config key that names the sources, for messages


def chunks(sources: list[str], columns: tuple[str, ...], key: str = "data.sources") -> Iterator[Chunk]:
    """Every source's files in order, in chunks of at most CHUNK_BYTES of text or CHUNK_ROWS rows.
    `columns`: the record fields a table must have (a table without them is refused by name); `key`:
    the config key that names `sources`, which every message names."""
    for index, source in enumerate(sources):
        directory = source if source != STDLIB and Path(source).is_dir() and not is_dataset_dir(Path(source)) else ""
        for name, path in source_files(source, f"{key}[{index}]"):
            kind = "dataset" if path.is_dir() else _kind(path)
            if kind == "text":
                data = path.read_bytes()
                yield Chunk(index, str(path), name, "text", 1, [data], len(data), directory, key)
            elif kind == "jsonl":
                yield from _jsonl_chunks(index, path, name, key)
            else:
                yield from _table_chunks(index, path, name, kind, columns, key)


def _jsonl_chunks(index: int, path: Path, name: str, key: str = "data.sources") -> Iterator[Chunk]:
    with open(path, "rb") as raw:
        fh = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
        lines, size, first, lineno, done = [], 0, 1, 0, 0
        try:
            for lineno, line in enumerate(fh, 1):
                lines.append(line)
                size += len(line)
                if size >= CHUNK_BYTES:
                    yield Chunk(index, str(path), name, "jsonl", first, lines, raw.tell() - done, key=key)
                    lines, size, first, done = [], 0, lineno + 1, raw.tell()
        except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
            raise UserError(f"{path}: cannot be read after line {lineno} ({e}); replace the file or remove "
                            f"it from {key}") from None
        if lines:
            yield Chunk(index, str(path), name, "jsonl", first, lines, raw.tell() - done, key=key)


def _table_chunks(index: int, path: Path, name: str, kind: str, columns: tuple[str, ...],
                  key: str = "data.sources") -> Iterator[Chunk]:
    """Rows of a parquet file (pyarrow, by row group), a `datasets` directory (memory-mapped) or a
    .csv / .arrow file (`datasets`, streamed), CHUNK_ROWS at a time."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.ParquetFile(path)
            names, rows = table.schema_arrow.names, table.metadata.num_rows
            _check_columns(path, names, columns)
            batches = (b.to_pylist()
                       for b in table.iter_batches(batch_size=CHUNK_ROWS, columns=_present(names, columns)))
        else:
            dataset = _open_dataset(path, kind)
            names = list(dataset.column_names or next(iter(dataset.take(1)), {}))  # streamed: from its first row
            _check_columns(path, names, columns)
            dataset = dataset.select_columns(_present(names, columns))
            rows = getattr(dataset, "num_rows", None)
            batches = ([dict(zip(b, vals)) for vals in zip(*b.values())] for b in dataset.iter(batch_size=CHUNK_ROWS))
        size = _size(path)
        first = 0
        for batch in batches:
            step = size * len(batch) // rows if rows else 0
            yield Chunk(index, str(path), name, "rows", first, batch, step, key=key)
            first += len(batch)
    except UserError:
        raise
    except Exception as e:  # pyarrow's and datasets' own errors: a damaged or foreign file
        said = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise UserError(f"{path}: cannot be read as {kind} ({said}); replace it or remove it from "
                        f"{key}") from None


def _present(names: list[str], columns: tuple[str, ...]) -> list[str]:
    return [c for c in columns if c in names]


def _check_columns(path: Path, names: list[str], columns: tuple[str, ...]) -> None:
    """A table holds the text column (text) or the conversation columns (sft)."""
    if columns == SFT_FIELDS:
        if "messages" in names or {"prompt", "completion"} <= set(names):
            return
        want = "a 'messages' column, or 'prompt' and 'completion'"
    elif columns == PREFERENCE_FIELDS:
        if {"chosen", "rejected"} <= set(names):
            return
        want = "'chosen' and 'rejected' columns"
    elif set(columns) <= set(names):
        return
    else:
        want = f"column {columns[0]!r}"
    raise UserError(f"{path}: no {want} (columns: {', '.join(names) or 'none'}); "
                    + ("set data.text_key to the text column" if columns not in RECORD_FIELDS else
                       f"data.format {RECORD_FIELDS[columns]} reads "
                       + ("conversations" if columns == SFT_FIELDS else "pairs") + " from those"))


def _open_dataset(path: Path, kind: str):
    """A `datasets` Dataset: load_from_disk for a saved directory (its 'train' split, or its only
    one, of a DatasetDict); a streamed local .csv / .arrow file otherwise. Never the hub."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    if kind == "table":
        builder = "csv" if path.suffix.lower() == ".csv" else "arrow"
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) != 1:
            raise UserError(f"{path}: a DatasetDict with splits {', '.join(loaded)} and no 'train'; save the "
                            f"split to train on alone (dataset_dict[split].save_to_disk(dir))")
        return next(iter(loaded.values()))
    return loaded


SFT_FIELDS = ("messages", "prompt", "completion")
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")
RECORD_FIELDS = {SFT_FIELDS: "sft", PREFERENCE_FIELDS: "preference"}  # formats whose records are objects


def format_fields(fmt: str, text_key: str) -> tuple[str, ...]:
    """The record fields a data.format reads."""
    return {"sft": SFT_FIELDS, "preference": PREFERENCE_FIELDS}.get(fmt, (text_key,))


def records(chunk: Chunk, fields: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    """(document name, record) for each non-empty record of a chunk, checked: text (fields =
    (text_key,)) is a str; sft (fields = SFT_FIELDS) a dict holding some of those fields, checked
    further by ds_train.data.chat. A bad one is one line naming the file and its line or row."""
    if chunk.kind == "text":
        text = _decode_text(chunk)
        if fields in RECORD_FIELDS:
            raise UserError(f"{chunk.key}: {chunk.file!r} is a text file, and data.format {RECORD_FIELDS[fields]} "
                            f"reads records (JSONL, parquet, datasets); remove it or set data.format=text")
        if text.strip():
            yield chunk.name, text
        return
    for offset, item in enumerate(chunk.items):
        if chunk.kind == "jsonl":
            lineno = chunk.first + offset
            if not item.strip():
                continue
            where, name = f"{chunk.file}:{lineno}", f"{chunk.name}:{lineno}"
            try:
                item = json.loads(item)
            except UnicodeDecodeError as e:
                raise UserError(f"{where}: not UTF-8 text ({e.reason}); convert the file to UTF-8") from None
            except json.JSONDecodeError:
                item = None
        else:
            row = chunk.first + offset
            where, name = f"{chunk.file} row {row}", f"{chunk.name}:{row}"
        record = _field_record(item, fields, where, chunk.kind == "jsonl")
        if record is not None:
            yield name, record


def _field_record(item, fields: tuple[str, ...], where: str, jsonl: bool):
    """The checked record of a parsed line or row; None when it holds no text."""
    if fields in RECORD_FIELDS:
        if not isinstance(item, dict):
            raise UserError(f"{where}: expected a JSON object " + (
                "(a conversation: 'messages', or 'prompt' and 'completion')" if fields == SFT_FIELDS else
                "(a preference pair: 'prompt', 'chosen' and 'rejected')"))
        return item
    key = fields[0]
    text = item.get(key) if isinstance(item, dict) else None
    if not isinstance(text, str):
        what = "a JSON object with a string" if jsonl else "a string in the"
        raise UserError(f"{where}: expected {what} {key!r} field (set data.text_key)")
    return text if text.strip() else None


def _decode_text(chunk: Chunk) -> str:
    """A text file's content: UTF-8 without NUL bytes, else one line naming the file and the fix (a
    binary file in a source directory would otherwise be tokenised as replacement characters)."""
    data = chunk.items[0]
    why = f"a NUL byte at offset {data.index(0)}" if 0 in data else ""
    if not why:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            why = f"byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8"
    if chunk.directory:
        fix = f"remove it from {chunk.directory!r}, or list only its text files in {chunk.key}"
    else:
        fix = f"convert it to UTF-8 or remove it from {chunk.key}"
    raise UserError(f"{chunk.key}: {chunk.file!r} is not UTF-8 text ({why}: a binary file?); {fix}")


# --- the fingerprint of prepare's inputs ---------------------------------------------------------
# meta.json records what data.dir was prepared from, so that a run whose sources, tokenizer or
# vocabulary changed since stops instead of training on stale tokens. Checked on every rank of every
# run, so it is cheap: a file whose size and mtime are unchanged is not read again.
