"""Tokenised datasets: `prepare` text into train.bin / val.bin / meta.json, then read packed sequences.

Reading the sources, and the fingerprint of them that meta.json records, is ds_train.sources'.

Sample order is a pure function of (seed, global sample index): global sample g lives in epoch
g // n at position perm_epoch[g % n], so the data position is just `samples_consumed` and a resume
(at any world size) continues the exact same stream. Each rank reads a disjoint slice of every
global batch.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from ds_train.errors import UserError
from ds_train.fs import check_writable, file_lock, replacing, write_atomic
from ds_train.sources import (NO_RECORD, TOKENIZER_FILES, Generators, check_source_files, check_sources,
                              fingerprint_differences, input_fingerprint, iter_documents, no_documents_error)

EOS = "<|endoftext|>"


# --- prepare -------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """A byte-level BPE (GPT-2 style) trained locally: no hub needed. Saved as a HF tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.save_pretrained(str(out_dir))
    return fast


def _is_prepared_tokenizer(path: Path) -> bool:
    """`path` is the BPE `prepare` trained into a data directory (data.dir/tokenizer)."""
    return path.name == "tokenizer" and (path.parent / "meta.json").is_file()


def _tokenizer_fix(path: Path) -> str:
    """How to repair the tokenizer directory `path`: it is a prepared data.dir's own, a model
    directory's, or one given as data.tokenizer."""
    if _is_prepared_tokenizer(path):
        return (f"it is the tokenizer `ds-train prepare` trained into {str(path.parent)!r}: prepare that "
                f"directory again (data.reprepare=true with data.sources, or `ds-train prepare --overwrite`)")
    if (path / "config.json").is_file():
        return "re-export or re-download the model directory"
    return "save the tokenizer there again (save_pretrained), or point data.tokenizer at another one"


def _tokenizer_file_problem(path: Path) -> str:
    """The first tokenizer JSON file in `path` that is not a UTF-8 JSON object, as `FILE is ...`."""
    for name in (*[n for n in TOKENIZER_FILES if n.endswith(".json")], "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            return f"{str(file)!r} is not UTF-8 text"
        except json.JSONDecodeError as e:
            return f"{str(file)!r} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        if not isinstance(value, dict):
            return f"{str(file)!r} is not a JSON object"
    return ""


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer in directory `path`; one line naming the file and the fix when it
    cannot be loaded."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' config validators
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        fix = (_tokenizer_fix(path) if _is_prepared_tokenizer(path) else
               "point data.tokenizer (or model.path) at a tokenizer directory")
        raise UserError(f"tokenizer: {str(path)!r} is not a directory; {fix}")
    problem = _tokenizer_file_problem(path)
    if problem:
        raise UserError(f"tokenizer: {problem}; {_tokenizer_fix(path)}")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as e:
        said = " ".join(f"{type(e).__name__}: {e}".split())
        said = said if len(said) <= 200 else said[:200] + "..."
        raise UserError(f"tokenizer: cannot load {str(path)!r} ({said}); {_tokenizer_fix(path)}") from None


def _is_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


PREPARED = ("meta.json", "train.bin", "val.bin", "tokenizer")  # what prepare writes into out_dir
OUT_KEY = "--out (data.dir)"


def prepare(sources: list[str], out_dir: str | Path, tokenizer: str = "", vocab_size: int = 4096,
            val_fraction: float = 0.02, text_key: str = "text", generators: Generators = {},
            overwrite: bool = False) -> dict:
    """Tokenise `sources` into out_dir/{train,val}.bin and meta.json (written last: the done marker).

    Every input is checked before the first write; an out_dir that already holds prepared data is
    refused unless `overwrite`."""
    out = Path(out_dir)
    held = [name for name in PREPARED if (out / name).exists()]
    if held and not overwrite:
        raise UserError(f"prepare: {str(out)!r} already holds prepared data ({', '.join(held)}); give "
                        f"another {OUT_KEY}, or --overwrite to replace it")
    check_writable(out, OUT_KEY)
    check_source_files(sources, generators)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    # Taken before the sources are read: a file edited meanwhile then differs from the record.
    fingerprint = input_fingerprint(sources, tokenizer, vocab_size, val_fraction, text_key, generators)
    docs = list(iter_documents(sources, text_key, generators))  # every document read before any write
    if not docs:
        raise no_documents_error(sources)
    out.mkdir(parents=True, exist_ok=True)
    val_docs = [t for n, t in docs if _is_val(n, val_fraction)]
    train_docs = [t for n, t in docs if not _is_val(n, val_fraction)]
    if not val_docs or not train_docs:  # too few documents for a hashed split: hold out the last one
        train_docs, val_docs = [t for _, t in docs[:-1]] or [docs[0][1]], [docs[-1][1]]
    if tok is not None:
        tok_dir = Path(tokenizer).resolve()
    else:
        tok_dir = (out / "tokenizer").resolve()
        tok = train_tokenizer(train_docs, vocab_size, tok_dir)
        if len(tok) < vocab_size:
            print(f"note: the BPE trained on {len(train_docs)} document(s) has {len(tok)} tokens, fewer than "
                  f"the {vocab_size} asked for (data.vocab_size, --vocab-size): the corpus has no more "
                  f"merges to learn; a model built from this data gets vocab_size {len(tok)}")
    vocab = len(tok)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    eos = tok.eos_token_id
    # A tokenizer inside out_dir is recorded relative to it, so the data directory can move.
    tok_rel = tok_dir.relative_to(out.resolve()) if tok_dir.is_relative_to(out.resolve()) else tok_dir
    meta = {"vocab_size": vocab, "dtype": np.dtype(dtype).name, "tokenizer": str(tok_rel),
            "eos_token_id": eos, "sources": sources, "max_token_id": 0, "scan": {}}
    for split, texts in (("train", train_docs), ("val", val_docs)):
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((i for doc in ids for i in (*doc, eos)), dtype=np.int64)
        with replacing(out / f"{split}.bin") as tmp:
            flat.astype(dtype).tofile(tmp)
        st = (out / f"{split}.bin").stat()
        meta[f"{split}_tokens"] = int(flat.size)
        meta[f"{split}_documents"] = len(texts)
        meta["scan"][split] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "max_token_id": int(flat.max())}
        meta["max_token_id"] = max(meta["max_token_id"], int(flat.max()))
    meta["fingerprint"] = fingerprint
    write_atomic(out / "meta.json", json.dumps(meta, indent=2))
    return meta


def _inputs_changed(data_dir: Path, diffs: list[str]) -> str:
    if diffs == [NO_RECORD]:
        return (f"data.dir {str(data_dir)!r} was {NO_RECORD} (an older prepare), so data.sources cannot "
                f"be checked against it; prepare it again with data.reprepare=true, point data.dir "
                f"elsewhere, or set data.sources=[] to use it as it is")
    shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    return (f"data.dir {str(data_dir)!r} was prepared from other inputs ({shown}); prepare it again "
            f"with data.reprepare=true, or point data.dir elsewhere")


def ensure_prepared(data_dir: str | Path, sources: list[str], tokenizer: str, vocab_size: int,
                    val_fraction: float, text_key: str, generators: Generators = {},
                    reprepare: bool = False) -> dict:
    """Prepare once: the first rank to take the lock tokenises, the others wait and then read.

    With sources, a data.dir prepared from other inputs (files, tokenizer, vocab_size, split
    settings) stops the run, or is prepared again (reprepare). Without, data.dir is used as it is.
    """
    data_dir = Path(data_dir)
    _check_is_dir(data_dir)

    meta_path = data_dir / "meta.json"

    def problem() -> str:
        """Why the prepared data.dir cannot be used as it is ("" when it can): damaged (meta.json,
        the .bin files, its own tokenizer) or, with sources, prepared from other inputs."""
        try:
            if sources:
                current = input_fingerprint(sources, tokenizer, vocab_size, val_fraction, text_key,
                                            generators, hashed=False)
                diffs = fingerprint_differences(_read_meta_json(data_dir).get("fingerprint"), current)
                if diffs:
                    return _inputs_changed(data_dir, diffs)
            own = data_dir / _read_meta(data_dir)["tokenizer"]  # reads, never waits for the lock
            if not tokenizer and own.resolve().parent == data_dir.resolve():  # the BPE prepare trained
                load_tokenizer(own)
        except UserError as e:
            return str(e)
        return ""

    if meta_path.is_file():
        why = problem()
        if not why:
            return load_meta(data_dir)
        if not (sources and reprepare):
            raise UserError(why)
    elif not sources:
        raise UserError(f"data.dir: {str(data_dir)!r} has no meta.json and data.sources is empty; "
                        f"run `ds-train prepare` or set data.sources")
    # Checked before the lock file is made: a bad source, tokenizer or data.dir leaves nothing behind.
    _check_can_prepare(data_dir)
    check_sources(sources, text_key, generators)
    if tokenizer:
        load_tokenizer(tokenizer)
    with file_lock(data_dir / ".prepare.lock"):
        if not meta_path.is_file() or problem():  # another rank may have prepared it meanwhile
            prepare(sources, data_dir, tokenizer, vocab_size, val_fraction, text_key, generators,
                    overwrite=True)
    return load_meta(data_dir)


def _check_can_prepare(data_dir: Path) -> None:
    """data.dir is, or can be made as, a writable directory. Only its nearest existing ancestor is
    checked: check_writable would create and remove data.dir itself, under another rank's lock."""
    existing = next(p for p in (data_dir.absolute(), *data_dir.absolute().parents) if p.exists())
    try:
        check_writable(existing, "data.dir")  # an existing directory: check_writable makes nothing
    except UserError as e:
        if existing == data_dir.absolute():
            raise
        why = str(e).removeprefix("data.dir: ")
        raise UserError(f"data.dir: {str(data_dir)!r} cannot be created: {why}") from None


def _check_is_dir(data_dir: Path) -> None:
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"data.dir: {str(data_dir)!r} is a file, not a directory; point data.dir at the "
                        f"directory that holds (or will hold) train.bin, val.bin and meta.json")


# --- reading prepared data -----------------------------------------------------------------------

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
    "eos_token_id": ("a token id (an integer >= 0)", lambda v: _whole(v) and v >= 0),
    "max_token_id": ("a token id (an integer)", lambda v: _whole(v)),
    "scan": ("a mapping", lambda v: isinstance(v, dict)),
}


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_meta_json(data_dir: Path) -> dict:
    _check_is_dir(data_dir)
    path = data_dir / "meta.json"
    if not path.is_file():
        raise UserError(f"data.dir: {str(data_dir)!r} has no meta.json; run `ds-train prepare` first")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (damaged); {PREPARE_AGAIN}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}; {PREPARE_AGAIN}") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: expected a JSON object; {PREPARE_AGAIN}")
    return meta


def _read_meta(data_dir: Path) -> dict:
    """meta.json as written, checked against the .bin files it describes. Writes nothing."""
    meta = _read_meta_json(data_dir)
    missing = [k for k in META_FIELDS if k not in meta]
    if missing:
        raise UserError(f"{data_dir / 'meta.json'}: missing {', '.join(map(repr, missing))}; {PREPARE_AGAIN}")
    for key, (valid, ok) in {**META_FIELDS, **OPTIONAL_META_FIELDS}.items():
        if key in meta and not ok(meta[key]):
            raise UserError(f"{data_dir / 'meta.json'}: {key!r} is {meta[key]!r}, not {valid}; "
                            f"{PREPARE_AGAIN}")
    dtype, vocab = meta["dtype"], meta["vocab_size"]
    if vocab > DTYPES[dtype]:
        raise UserError(f"data.dir {str(data_dir)!r}: meta.json dtype {dtype} cannot hold vocab_size {vocab} "
                        f"(ids below {DTYPES[dtype]}); {PREPARE_AGAIN}")
    for split in SPLITS:
        if not (data_dir / f"{split}.bin").is_file():
            raise UserError(f"data.dir: {str(data_dir / f'{split}.bin')!r} is missing; {PREPARE_AGAIN}")
    itemsize = np.dtype(dtype).itemsize
    for split in SPLITS:
        size, tokens = (data_dir / f"{split}.bin").stat().st_size, meta[f"{split}_tokens"]
        if size != tokens * itemsize:
            raise UserError(f"data.dir {str(data_dir)!r}: {split}.bin is {size} bytes, not {tokens} {dtype} "
                            f"tokens ({tokens * itemsize} bytes) as meta.json records (truncated or "
                            f"overwritten); {PREPARE_AGAIN}")
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
    meta = _read_meta(data_dir)
    scans = _scans(data_dir, meta, rescan=False)
    if scans is None and os.access(data_dir, os.W_OK):
        with file_lock(data_dir / ".prepare.lock"):
            meta = _read_meta(data_dir)  # another rank may have scanned (or prepared) meanwhile
            scans = _scans(data_dir, meta, rescan=False)
            if scans is None:
                meta["scan"] = scans = _scans(data_dir, meta, rescan=True)
                write_atomic(data_dir / "meta.json", json.dumps(meta, indent=2))
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


class TokenData:
    """Packed fixed-length windows over a .bin memmap, sharded by rank, in a seeded order."""

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int):
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples <= 0:
            raise UserError(f"{path}: {len(self.tokens)} tokens is fewer than train.seq_len + 1 "
                            f"= {seq_len + 1}; use a shorter seq_len or more data")
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def window(self, sample: int, shuffle: bool = True) -> np.ndarray:
        """Global sample index -> seq_len + 1 tokens (inputs and shifted targets)."""
        epoch, i = divmod(sample, self.num_samples)
        idx = self._order(epoch)[i] if shuffle else i
        start = int(idx) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def batch(self, first_sample: int, size: int, shuffle: bool = True) -> np.ndarray:
        return np.stack([self.window(first_sample + j, shuffle) for j in range(size)])


def rank_micro_batches(data: TokenData, step: int, global_batch: int, micro: int, rank: int,
                       world: int) -> list[np.ndarray]:
    """The micro-batches this rank trains on at `step` (0-based): a disjoint slice of the global batch."""
    per_rank = global_batch // world
    first = step * global_batch + rank * per_rank
    return [data.batch(first + k * micro, micro) for k in range(per_rank // micro)]


def eval_micro_batches(data: TokenData, batches: int, micro: int, rank: int,
                       world: int) -> list[np.ndarray]:
    """A fixed evaluation set: the first batches x micro x world windows of val.bin, in file order."""
    out = []
    for b in range(batches):
        first = (b * world + rank) * micro
        out.append(np.stack([data.window(s % data.num_samples, shuffle=False)
                             for s in range(first, first + micro)]))
    return out
