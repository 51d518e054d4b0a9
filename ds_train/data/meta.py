"""What a prepared data.dir is: meta.json checked against train.bin / val.bin (and, sft, the target
masks and example offsets), the largest token id of each file, and the check that every id is
one of the model's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ds_train.errors import UserError
from ds_train.fs import file_lock, read_json, write_atomic

META = "meta.json"  # a prepared data.dir's record of its files, written last: the done marker
PREPARED = (META, "train.bin", "val.bin", "tokenizer")  # what prepare writes into out_dir
SFT_FILES = ("mask", "idx")  # data.format sft: {split}.mask (1: a target token), {split}.idx (offsets)
FORMATS = ("text", "sft", "preference")
SPLITS = ("train", "val")
DTYPES = {"uint16": 2**16, "uint32": 2**32}  # dtype -> ids it can hold
PREPARE_AGAIN = "prepare it again (data.reprepare=true with data.sources, or `ds-train prepare --overwrite`)"
# meta.json fields: (what a valid value is, the test); optional ones are checked when present.
META_FIELDS = {
    "vocab_size": ("a positive integer", lambda v: _whole(v) and v > 0),
    "dtype": ("uint16 or uint32", lambda v: isinstance(v, str) and v in DTYPES),
    "tokenizer": ("a directory name", lambda v: isinstance(v, str) and bool(v)),
    "train_tokens": ("a token count (an integer >= 0)", lambda v: _whole(v) and v >= 0),
    "val_tokens": ("a token count (an integer >= 0)", lambda v: _whole(v) and v >= 0),
}
OPTIONAL_META_FIELDS = {
    "format": ("text, sft or preference", lambda v: v in FORMATS),
    "eos_token_id": ("a token id (an integer >= 0)", lambda v: _whole(v) and v >= 0),
    "max_token_id": ("a token id (an integer)", lambda v: _whole(v)),
    "scan": ("a mapping", lambda v: isinstance(v, dict)),
}


def check_is_dir(data_dir: Path) -> None:
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"data.dir: {str(data_dir)!r} is a file, not a directory; point data.dir at the "
                        f"directory that holds (or will hold) train.bin, val.bin and {META}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_meta_json(data_dir: Path) -> dict:
    check_is_dir(data_dir)
    path = data_dir / META
    if not path.is_file():
        raise UserError(f"data.dir: {str(data_dir)!r} has no {META}; run `ds-train prepare` first")
    return read_json(path, META, "data.dir", fix=PREPARE_AGAIN)


def read_meta(data_dir: Path) -> dict:
    """meta.json as written, checked against the .bin files it describes. Writes nothing."""
    meta = read_meta_json(data_dir)
    missing = [k for k in META_FIELDS if k not in meta]
    if missing:
        raise UserError(f"{data_dir / META}: missing {', '.join(map(repr, missing))}; {PREPARE_AGAIN}")
    for key, (valid, ok) in {**META_FIELDS, **OPTIONAL_META_FIELDS}.items():
        if key in meta and not ok(meta[key]):
            raise UserError(f"{data_dir / META}: {key!r} is {meta[key]!r}, not {valid}; "
                            f"{PREPARE_AGAIN}")
    dtype, vocab = meta["dtype"], meta["vocab_size"]
    if vocab > DTYPES[dtype]:
        raise UserError(f"data.dir {str(data_dir)!r}: {META} dtype {dtype} cannot hold vocab_size {vocab} "
                        f"(ids below {DTYPES[dtype]}); {PREPARE_AGAIN}")
    for split in SPLITS:
        if not (data_dir / f"{split}.bin").is_file():
            raise UserError(f"data.dir: {str(data_dir / f'{split}.bin')!r} is missing; {PREPARE_AGAIN}")
    itemsize = np.dtype(dtype).itemsize
    for split in SPLITS:
        size, tokens = (data_dir / f"{split}.bin").stat().st_size, meta[f"{split}_tokens"]
        if size != tokens * itemsize:
            raise UserError(f"data.dir {str(data_dir)!r}: {split}.bin is {size} bytes, not {tokens} {dtype} "
                            f"tokens ({tokens * itemsize} bytes) as {META} records (truncated or "
                            f"overwritten); {PREPARE_AGAIN}")
    if meta.get("format", "text") != "text":  # the targets and the example offsets agree with it too
        for split in SPLITS:
            docs = meta.get(f"{split}_documents")
            for name, want in ((f"{split}.mask", meta[f"{split}_tokens"]),
                               (f"{split}.idx", None if not _whole(docs) else (docs + 1) * 8)):
                path = data_dir / name
                size = path.stat().st_size if path.is_file() else None
                if size is None or (want is not None and size != want):
                    said = "is missing" if size is None else f"is {size} bytes, not {want}"
                    raise UserError(f"data.dir {str(data_dir)!r}: {name} {said} as {META} records; "
                                    f"{PREPARE_AGAIN}")
    return meta


def max_token_id(path: Path, dtype: str, chunk_tokens: int = 1 << 24) -> int:
    """The largest token id in a .bin file (-1 when empty), read in chunks through a memmap."""
    if path.stat().st_size == 0:
        return -1
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    return int(max(tokens[i:i + chunk_tokens].max() for i in range(0, len(tokens), chunk_tokens)))


def _scans(data_dir: Path, meta: dict, rescan: bool) -> dict | None:
    """Each split file's max token id: the recorded one while the file's size and mtime match the
    record; otherwise None (rescan=False) or scanned again (rescan=True)."""
    out = {}
    for split in SPLITS:
        path = data_dir / f"{split}.bin"
        st, rec = path.stat(), meta.get("scan", {}).get(split)
        if not (isinstance(rec, dict) and rec.get("size") == st.st_size
                and rec.get("mtime_ns") == st.st_mtime_ns and _whole(rec.get("max_token_id"))):
            if not rescan:
                return None
            rec = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "max_token_id": max_token_id(path, meta["dtype"])}
        out[split] = rec
    return out


def load_meta(data_dir: str | Path) -> dict:
    """meta.json, checked against train.bin / val.bin, with its tokenizer path resolved and
    max_token_id taken from the files themselves: scanned once per file version and recorded in
    meta.json (under the prepare lock), so later loads read no tokens."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    scans = _scans(data_dir, meta, rescan=False)
    if scans is None and os.access(data_dir, os.W_OK):
        with file_lock(data_dir / ".prepare.lock"):
            meta = read_meta(data_dir)  # another rank may have scanned (or prepared) meanwhile
            scans = _scans(data_dir, meta, rescan=False)
            if scans is None:
                meta["scan"] = scans = _scans(data_dir, meta, rescan=True)
                write_atomic(data_dir / META, json.dumps(meta, indent=2))
    elif scans is None:  # a read-only copy: scan on every load rather than refuse it
        scans = _scans(data_dir, meta, rescan=True)
    meta["scan"] = scans
    meta["max_token_id"] = max(s["max_token_id"] for s in scans.values())
    meta["tokenizer"] = str(data_dir / meta["tokenizer"])  # absolute stays absolute
    return meta


def check_vocab(meta: dict, vocab_size: int | None, data_dir: str | Path) -> None:
    """Every token id of the prepared data must be an id of the model's embedding."""
    if vocab_size is None:
        return
    scans = meta.get("scan") or {}
    split, top = max(((s, r["max_token_id"]) for s, r in scans.items()), key=lambda x: x[1],
                     default=(None, meta.get("max_token_id", 0)))
    if top >= vocab_size:
        where = f"{split}.bin holds token id {top}" if split else f"token id {top}"
        raise UserError(f"data.dir {str(data_dir)!r}: {where} >= the model's vocab_size {vocab_size} (a GPU "
                        f"run would stop with a device-side assert); prepare the data with the model's "
                        f"tokenizer or raise model.config.vocab_size")


def token_dtype(vocab: int):
    """The smallest unsigned type that holds every id of a vocabulary (DTYPES)."""
    return np.uint16 if vocab <= 2**16 else np.uint32

