"""Tokenised datasets: `prepare` text into train.bin / val.bin / meta.json, then read packed sequences.

Reading the sources, and the fingerprint of them that meta.json records, is ds_train.sources'.

Sample order is a pure function of (seed, global sample index): global sample g lives in epoch
g // n at position perm_epoch[g % n], so the data position is just `samples_consumed` and a resume
(at any world size) continues the exact same stream. Each rank reads a disjoint slice of every
global batch.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from ds_train.config import DataConfig
from ds_train.errors import UserError
from ds_train.fs import check_writable, file_lock, write_atomic
from ds_train.chat import Renderer, conversation
from ds_train.sources import (NO_RECORD, SFT_FIELDS, TOKENIZER_FILES, Chunk, check_source_files, chunks,
                              fingerprint_differences, input_bytes, input_fingerprint, no_documents_error, records)

EOS = "<|endoftext|>"


# --- prepare -------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, chat_template: str = "",
                    split_digits: bool = False):
    """A byte-level BPE (GPT-2 style) trained locally: no hub needed. Saved as a HF tokenizer dir.
    split_digits: every digit is its own token (as in Llama's and DeepSeek's tokenizers), so a number
    reads the same digit by digit wherever it stands."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    if chat_template:
        fast.chat_template = chat_template  # saved with it: a model exported from the run renders chats alike
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
SFT_FILES = ("mask", "idx")  # data.format sft: {split}.mask (1: a target token), {split}.idx (offsets)
OUT_KEY = "--out (data.dir)"
FORMATS = ("text", "sft")
BPE_SAMPLE_BYTES = 64 << 20  # the BPE (no tokenizer given) learns from at most this much text
SMALL_CORPUS_BYTES = 8 << 20  # below this, workers=0 (all cores) tokenises in this process


@dataclass(frozen=True)
class Encoded:
    """One chunk's documents of one split: their tokens (and targets, sft) and each one's length."""
    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None = None


class Encoder:
    """Records -> token arrays per split: what a worker process does with each chunk. Text: each
    document's tokens and EOS, through the tokenizer's Rust backend alone (`backend`: its JSON, as
    the main process loaded it; a worker then never imports transformers); sft: each
    conversation's tokens and its target mask (ds_train.chat, the whole Hugging Face tokenizer)."""

    def __init__(self, tokenizer_dir: str, backend: str, eos: int, vocab: int, fmt: str, text_key: str,
                 chat_template: str, val_fraction: float):
        self.fmt, self.val_fraction, self.eos = fmt, val_fraction, eos
        self.fields = SFT_FIELDS if fmt == "sft" else (text_key,)
        self.dtype = token_dtype(vocab)
        if fmt == "text" and backend:
            from tokenizers import Tokenizer

            fast = Tokenizer.from_str(backend)
            self._batch = lambda texts: [e.ids for e in fast.encode_batch_fast(texts, add_special_tokens=False)]
        else:
            tok = load_tokenizer(tokenizer_dir)
            self.renderer = Renderer(tok, chat_template) if fmt == "sft" else None
            self._batch = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, chunk: Chunk) -> dict[str, Encoded]:
        splits: dict[str, list] = {"train": [], "val": []}
        for name, record in records(chunk, self.fields):
            splits["val" if _is_val(name, self.val_fraction) else "train"].append((name, record))
        return {split: self._encode(docs, chunk) for split, docs in splits.items()}

    def _encode(self, docs: list, chunk: Chunk) -> Encoded:
        if self.fmt == "text":
            ids = self._batch([text for _, text in docs])
            lengths = np.array([len(d) + 1 for d in ids], dtype=np.int64)
            flat = list(itertools.chain.from_iterable(d + [self.eos] for d in ids))
            return Encoded(np.array(flat, dtype=self.dtype), lengths)
        pairs = [self.renderer.encode(record, _where(chunk, name)) for name, record in docs]
        lengths = np.array([len(t) for t, _ in pairs], dtype=np.int64)
        if not pairs:
            return Encoded(np.zeros(0, self.dtype), lengths, np.zeros(0, np.uint8))
        return Encoded(np.concatenate([t for t, _ in pairs]).astype(self.dtype), lengths,
                       np.concatenate([m for _, m in pairs]))


def _where(chunk: Chunk, name: str) -> str:
    """A record's place for messages: FILE:LINE (JSONL) or FILE row N (tables)."""
    at = name.rpartition(":")[2]
    return f"{chunk.file}:{at}" if chunk.kind == "jsonl" else f"{chunk.file} row {at}"


_ENCODER: Encoder | None = None


def _worker_start(args: tuple) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _ENCODER = Encoder(*args)


def _worker_encode(chunk: Chunk) -> tuple[int, int, dict[str, Encoded]]:
    return chunk.source, chunk.nbytes, _ENCODER(chunk)


def encoded_chunks(sources: list[str], fields: tuple[str, ...], encoder_args: tuple,
                   workers: int) -> Iterator[tuple[int, int, dict[str, Encoded]]]:
    """(source index, input bytes, encoded splits) of every chunk, in input order, whatever the
    number of workers; at most 2 chunks per worker in flight, so memory does not grow with the corpus."""
    if workers <= 1:
        _worker_start(encoder_args)
        for chunk in chunks(sources, fields):
            yield _worker_encode(chunk)
        return
    with mp.get_context("spawn").Pool(workers, _worker_start, (encoder_args,)) as pool:
        pending: deque = deque()
        for chunk in chunks(sources, fields):
            pending.append(pool.apply_async(_worker_encode, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class SplitWriter:
    """Appends a split's encoded chunks to partial files (tokens; sft: mask and offsets)."""

    def __init__(self, out: Path, split: str, sft: bool):
        self.out, self.sft = out, sft
        self.tokens, self.docs, self.max_id, self.itemsize, self.last = 0, 0, -1, 1, None
        self._open(split, "wb")
        if sft:
            np.zeros(1, np.int64).tofile(self.files[2])  # offsets: 0, then each example's end

    def _open(self, split: str, mode: str) -> None:
        self.names = [f"{split}.bin", *([f"{split}.{k}" for k in SFT_FILES] if self.sft else [])]
        self.paths = [self.out / f".{name}.partial" for name in self.names]
        self.files = [open(p, mode) for p in self.paths]

    def write(self, part: Encoded) -> None:
        if not len(part.lengths):
            return
        part.tokens.tofile(self.files[0])
        if self.sft:
            part.mask.tofile(self.files[1])
            (self.tokens + np.cumsum(part.lengths)).tofile(self.files[2])
        self.tokens += len(part.tokens)
        self.docs += len(part.lengths)
        self.max_id, self.itemsize = max(self.max_id, int(part.tokens.max())), part.tokens.itemsize
        n = int(part.lengths[-1])
        self.last = Encoded(part.tokens[-n:], part.lengths[-1:], None if part.mask is None else part.mask[-n:])

    def drop_last(self) -> None:
        """Remove the last document (it moves to the other split)."""
        self.tokens -= int(self.last.lengths[0])
        self.docs -= 1
        sizes = [self.tokens * self.itemsize, self.tokens, (self.docs + 1) * 8]
        for f, size in zip(self.files, sizes):
            f.flush()
            f.truncate(size)
            f.seek(0, os.SEEK_END)

    def become(self, split: str) -> None:
        """Rename the partial files to another split's (every document hashed to that split's other)."""
        old = self.paths
        self.close()
        for path, name in zip(old, [f"{split}.bin", *[f"{split}.{k}" for k in SFT_FILES]]):
            os.replace(path, self.out / f".{name}.partial")
        self._open(split, "ab")

    def close(self) -> None:
        for f in self.files:
            f.close()

    def finish(self) -> None:
        """fsync the partial files and rename them into place."""
        for path, name in zip(self.paths, self.names):
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(path, self.out / name)


def _bpe_sample(sources: list[str], fields: tuple[str, ...], fmt: str, chat_template: str,
                val_fraction: float) -> list[str]:
    """The texts the BPE learns from: the first BPE_SAMPLE_BYTES / len(sources) of each source's
    training documents (rendered conversations, sft), in order: bounded and deterministic."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    renderer = None
    if fmt == "sft":  # rendering needs only the special tokens' text
        blank = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token=EOS, bos_token=EOS)
        renderer = Renderer(blank, chat_template)
    budget = BPE_SAMPLE_BYTES // max(1, len(sources))
    texts, taken = [], [0] * len(sources)
    for chunk in chunks(sources, fields):
        if taken[chunk.source] >= budget:
            continue
        for name, record in records(chunk, fields):
            if _is_val(name, val_fraction):
                continue
            if renderer is not None:
                where = _where(chunk, name)
                record = "".join(t for t, _ in renderer.segments(conversation(record, where), where))
            texts.append(record)
            taken[chunk.source] += len(record)
            if taken[chunk.source] >= budget:
                break
    return texts


def _workers(workers: int, total_bytes: int) -> int:
    if workers > 0:
        return workers
    return 1 if total_bytes < SMALL_CORPUS_BYTES else len(os.sched_getaffinity(0))


def prepare(sources: list[str], out_dir: str | Path, tokenizer: str = "", vocab_size: int = 4096,
            val_fraction: float = 0.02, text_key: str = "text", *, fmt: str = "text", chat_template: str = "",
            split_digits: bool = False, workers: int = 0, overwrite: bool = False) -> dict:
    """Tokenise `sources` into out_dir/{train,val}.bin (sft: and .mask, .idx) and meta.json.

    Streams: chunks of documents are tokenised by `workers` processes (0: one per core; one for a
    small corpus) and appended in input order to partial files, renamed into place at the end and
    meta.json written last (the done marker), so the output is the same for any number of workers
    and an interrupted or failed prepare leaves nothing that looks prepared (and what was prepared
    in out_dir before stays whole until the new data replaces it). An out_dir that already holds
    prepared data is refused unless `overwrite`."""
    out = Path(out_dir)
    held = [name for name in PREPARED if (out / name).exists()]
    if held and not overwrite:
        raise UserError(f"prepare: {str(out)!r} already holds prepared data ({', '.join(held)}); give "
                        f"another {OUT_KEY}, or --overwrite to replace it")
    check_writable(out, OUT_KEY)
    check_source_files(sources)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    if fmt == "sft" and tok is not None:
        Renderer(tok, chat_template)  # the template is there
    # Taken before the sources are read: a file edited meanwhile then differs from the record.
    if split_digits and tok is not None:
        raise UserError("data.split_digits (--split-digits) applies to the BPE prepare trains; the tokenizer "
                        f"{tokenizer!r} splits numbers its own way: drop split_digits, or give no tokenizer")
    fingerprint = input_fingerprint(sources, tokenizer, vocab_size, val_fraction, text_key, fmt, chat_template,
                                    split_digits=split_digits)
    made = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    partial_tok = out / ".tokenizer.partial"
    writers: list[SplitWriter] = []
    try:
        fields = SFT_FIELDS if fmt == "sft" else (text_key,)
        if tok is not None:
            tok_dir = Path(tokenizer).resolve()
        else:
            # Too few documents for a hashed split: they are all the sample (as they will all train).
            sample = (_bpe_sample(sources, fields, fmt, chat_template, val_fraction)
                      or _bpe_sample(sources, fields, fmt, chat_template, 0.0))
            if not sample:
                raise no_documents_error(sources)
            tok = train_tokenizer(sample, vocab_size, partial_tok, chat_template, split_digits)
            tok_dir = (out / "tokenizer").resolve()
            if len(tok) < vocab_size:
                print(f"note: the BPE trained on {len(sample)} document(s) has {len(tok)} tokens, fewer than "
                      f"the {vocab_size} asked for (data.vocab_size, --vocab-size): the corpus has no more "
                      f"merges to learn; a model built from this data gets vocab_size {len(tok)}")
        backend = getattr(tok, "backend_tokenizer", None)
        encoder_args = (str(partial_tok if not tokenizer else tok_dir), backend.to_str() if backend else "",
                        tok.eos_token_id, len(tok), fmt, text_key, chat_template, val_fraction)
        writers[:] = [SplitWriter(out, "train", fmt == "sft"), SplitWriter(out, "val", fmt == "sft")]
        train, val = writers
        total = input_bytes(sources)
        n_workers = _workers(workers, total)
        ranges: list = [None] * len(sources)  # each source's train range (tokens; sft: examples)
        started = time.monotonic()
        with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, mininterval=2,
                  disable=not sys.stderr.isatty()) as bar:
            for source, nbytes, parts in encoded_chunks(sources, fields, encoder_args, n_workers):
                if ranges[source] is None:
                    ranges[source] = [_position(train, fmt)] * 2
                train.write(parts["train"])
                val.write(parts["val"])
                ranges[source][1] = _position(train, fmt)
                bar.update(nbytes)
                bar.set_postfix_str(f"{(train.tokens + val.tokens) / (time.monotonic() - started):,.0f} tokens/s",
                                    refresh=False)
        if not train.docs + val.docs:
            raise no_documents_error(sources)
        _balance(out, writers)
        train, val = writers
        ranges = [[min(r[0], _position(train, fmt)), min(r[1], _position(train, fmt))] if r else [0, 0]
                  for r in ranges]
        for w in writers:
            w.close()
        seconds = time.monotonic() - started
        meta = {"format": fmt, "vocab_size": len(tok), "dtype": np.dtype(token_dtype(len(tok))).name,
                "tokenizer": "", "eos_token_id": tok.eos_token_id, "sources": sources,
                "source_ranges": ranges, "max_token_id": max(train.max_id, val.max_id), "scan": {}}
        (out / "meta.json").unlink(missing_ok=True)  # from here on, out_dir does not look prepared
        for w in writers:
            w.finish()
        if not tokenizer:
            shutil.rmtree(out / "tokenizer", ignore_errors=True)
            os.replace(partial_tok, out / "tokenizer")
        # A tokenizer inside out_dir is recorded relative to it, so the data directory can move.
        meta["tokenizer"] = str(tok_dir.relative_to(out.resolve()) if tok_dir.is_relative_to(out.resolve())
                                else tok_dir)
        for split, w in (("train", train), ("val", val)):
            st = (out / f"{split}.bin").stat()
            meta[f"{split}_tokens"], meta[f"{split}_documents"] = w.tokens, w.docs
            meta["scan"][split] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "max_token_id": w.max_id}
        if fmt == "sft":
            for split in ("train", "val"):
                meta[f"{split}_targets"] = int(np.count_nonzero(np.memmap(out / f"{split}.mask", np.uint8, "r")))
        meta["fingerprint"] = fingerprint
        write_atomic(out / "meta.json", json.dumps(meta, indent=2))
    except BaseException:
        for w in writers:
            w.close()
            for p in w.paths:
                p.unlink(missing_ok=True)
        shutil.rmtree(partial_tok, ignore_errors=True)
        for p in made:  # deepest first: what this call created, if nothing else is in it
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    print(f"prepare: {train.docs + val.docs:,} documents, {train.tokens + val.tokens:,} tokens in {seconds:.1f} s "
          f"({total / 2**20 / max(seconds, 1e-9):.1f} MiB/s, {(train.tokens + val.tokens) / max(seconds, 1e-9):,.0f} "
          f"tokens/s, {n_workers} worker{'s' * (n_workers > 1)})", file=sys.stderr)
    return meta


def token_dtype(vocab: int):
    """The smallest unsigned type that holds every id of a vocabulary (see DTYPES)."""
    return np.uint16 if vocab <= 2**16 else np.uint32


def _position(writer: SplitWriter, fmt: str) -> int:
    """Where the train split stands: in tokens (text), in examples (sft)."""
    return writer.docs if fmt == "sft" else writer.tokens


def _balance(out: Path, writers: list[SplitWriter]) -> None:
    """Too few documents for a hashed split: the last one is held out (copied when it is the only one)."""
    train, val = writers
    if not train.docs:  # every document hashed to val: they train instead
        train.close()
        val.become("train")  # over the empty train files
        writers[:] = train, val = [val, SplitWriter(out, "val", val.sft)]
    if val.docs:
        return
    last = train.last
    if train.docs > 1:
        train.drop_last()
    val.write(last)


def _inputs_changed(data_dir: Path, diffs: list[str]) -> str:
    if diffs == [NO_RECORD]:
        return (f"data.dir {str(data_dir)!r} was {NO_RECORD} (an older prepare), so data.sources cannot "
                f"be checked against it; prepare it again with data.reprepare=true, point data.dir "
                f"elsewhere, or set data.sources=[] to use it as it is")
    shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    return (f"data.dir {str(data_dir)!r} was prepared from other inputs ({shown}); prepare it again "
            f"with data.reprepare=true, or point data.dir elsewhere")


def ensure_prepared(d: DataConfig, tokenizer: str = "") -> dict:
    """Prepare once: the first rank to take the lock tokenises, the others wait and then read.

    With sources, a data.dir prepared from other inputs (files, tokenizer, vocab_size, format and
    split settings) stops the run, or is prepared again (data.reprepare). Without, data.dir is used
    as it is. A prepare that fails leaves no data.dir it made (nor its lock file).
    """
    data_dir, sources = Path(d.dir), list(d.sources)
    _check_is_dir(data_dir)

    meta_path = data_dir / "meta.json"

    def problem() -> str:
        """Why the prepared data.dir cannot be used as it is ("" when it can): damaged (meta.json,
        the .bin files, its own tokenizer) or, with sources, prepared from other inputs."""
        try:
            if sources:
                current = input_fingerprint(sources, tokenizer, d.vocab_size, d.val_fraction, d.text_key,
                                            d.format, d.chat_template, split_digits=d.split_digits, hashed=False)
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
        if not (sources and d.reprepare):
            raise UserError(why)
    elif not sources:
        raise UserError(f"data.dir: {str(data_dir)!r} has no meta.json and data.sources is empty; "
                        f"run `ds-train prepare` or set data.sources")
    # Checked before the lock file is made: a missing source, a bad tokenizer or data.dir.
    _check_can_prepare(data_dir)
    check_source_files(sources)
    if tokenizer:
        load_tokenizer(tokenizer)
    made = [p for p in (data_dir.absolute(), *data_dir.absolute().parents) if not p.exists()]
    try:
        with file_lock(data_dir / ".prepare.lock"):
            if not meta_path.is_file() or problem():  # another rank may have prepared it meanwhile
                prepare(sources, data_dir, tokenizer, d.vocab_size, d.val_fraction, d.text_key, fmt=d.format,
                        chat_template=d.chat_template, split_digits=d.split_digits, workers=d.workers,
                        overwrite=True)
    except BaseException:
        if made:  # a bad record met while streaming: leave no data.dir holding a lock file
            (data_dir / ".prepare.lock").unlink(missing_ok=True)
            for p in made:
                with contextlib.suppress(OSError):
                    p.rmdir()
        raise
    return load_meta(data_dir)


def _check_can_prepare(data_dir: Path) -> None:
    """data.dir is, or can be made as, a writable directory: its nearest existing ancestor is
    checked, and a data.dir that cannot be made is named as such."""
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
    "format": ("text or sft", lambda v: v in FORMATS),
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
    if meta.get("format", "text") == "sft":  # the targets and the example offsets agree with it too
        for split in SPLITS:
            docs = meta.get(f"{split}_documents")
            for name, want in ((f"{split}.mask", meta[f"{split}_tokens"]),
                               (f"{split}.idx", None if not _whole(docs) else (docs + 1) * 8)):
                path = data_dir / name
                size = path.stat().st_size if path.is_file() else None
                if size is None or (want is not None and size != want):
                    said = "is missing" if size is None else f"is {size} bytes, not {want}"
                    raise UserError(f"data.dir {str(data_dir)!r}: {name} {said} as meta.json records; "
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
    """Packed fixed-length windows over a .bin memmap, sharded by rank, in a seeded order.

    With `weights` (a mixture), each source's token range (`ranges`, from meta.json) has its own
    windows and its own seeded epochs, and the global sample order draws from the sources in
    proportion to the weights: a fixed, seeded cycle of MIX_SLOTS slots in which source i holds
    round(w_i / sum(w) * MIX_SLOTS) of them. Sample g is still a pure function of (seed, g)."""

    MIX_SLOTS = 1000

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int, ranges: list | None = None,
                 weights: list | None = None, names: list | None = None):
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples <= 0:
            raise UserError(f"{path}: {len(self.tokens)} tokens is fewer than train.seq_len + 1 "
                            f"= {seq_len + 1}; use a shorter seq_len or more data")
        self._perms: dict = {}
        self.mix = None
        if weights:
            self._mixture(path, ranges, weights, names or [str(i) for i in range(len(weights))])

    def _mixture(self, path: Path, ranges: list, weights: list, names: list) -> None:
        starts = np.array([r[0] for r in ranges], dtype=np.int64)
        counts = np.array([max(0, (r[1] - r[0] - 1) // self.seq_len) for r in ranges], dtype=np.int64)
        for name, n, r in zip(names, counts, ranges):
            if n <= 0:
                raise UserError(f"data.weights: source {name!r} has {r[1] - r[0]} training tokens in {path}, fewer "
                                f"than train.seq_len + 1 = {self.seq_len + 1}; give it a weight only with more "
                                f"data, or drop it from data.sources")
        share = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * self.MIX_SLOTS
        slots = np.maximum(1, np.floor(share).astype(np.int64))
        for i in np.argsort(-(share - np.floor(share)), kind="stable")[:max(0, self.MIX_SLOTS - int(slots.sum()))]:
            slots[i] += 1  # largest remainders
        order = np.random.default_rng([self.seed, 2**31]).permutation(np.repeat(np.arange(len(slots)), slots))
        rank = np.zeros(len(order), dtype=np.int64)
        seen = np.zeros(len(slots), dtype=np.int64)
        for j, src in enumerate(order):
            rank[j], seen[src] = seen[src], seen[src] + 1
        self.mix = (starts, counts, slots, order, rank)
        self.num_samples = int(counts.sum())  # an "epoch" of the mixture, for reporting

    def _order(self, key: int, epoch: int, n: int) -> np.ndarray:
        cached = self._perms.get(key)
        if cached is None or cached[0] != epoch:
            seed = [self.seed, epoch] if key < 0 else [self.seed, epoch, key]
            cached = self._perms[key] = (epoch, np.random.default_rng(seed).permutation(n))
        return cached[1]

    def start(self, sample: int, shuffle: bool = True) -> int:
        """Global sample index -> the token offset its window starts at."""
        if self.mix is None or not shuffle:
            epoch, i = divmod(sample, self.num_samples)
            idx = self._order(-1, epoch, self.num_samples)[i] if shuffle else i
            return int(idx) * self.seq_len
        starts, counts, slots, order, rank = self.mix
        cycle, slot = divmod(sample, self.MIX_SLOTS)
        src = int(order[slot])
        epoch, i = divmod(cycle * int(slots[src]) + int(rank[slot]), int(counts[src]))
        return int(starts[src]) + int(self._order(src, epoch, int(counts[src]))[i]) * self.seq_len

    def window(self, sample: int, shuffle: bool = True) -> np.ndarray:
        """Global sample index -> seq_len + 1 tokens (inputs and shifted targets)."""
        start = self.start(sample, shuffle)
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def samples(self, indices, shuffle: bool = True) -> np.ndarray:
        return np.stack([self.window(s, shuffle) for s in indices])

    def batch(self, first_sample: int, size: int, shuffle: bool = True) -> np.ndarray:
        return self.samples(range(first_sample, first_sample + size), shuffle)


IGNORE = -100  # a position with no target (prompt, padding, an example's last token)


@dataclass(frozen=True)
class Batch:
    """Sequences of instruction data: inputs, aligned targets (IGNORE where no loss) and positions
    (restarting at each packed example; None: one example per sequence, positions from 0)."""
    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray | None

    @property
    def n_targets(self) -> int:
        return int(np.count_nonzero(self.targets != IGNORE))


class SftData:
    """Instruction examples (data.format sft) as sequences of seq_len tokens: several whole examples
    per sequence (`pack`: best fit in a seeded order of the examples, fixed for the run), else one
    each, padded. Sequences are drawn in a seeded order per epoch like TokenData's windows, so the
    data position is the number of samples consumed. An example longer than seq_len is dropped or
    truncated (`overlong`); one left without a target token is dropped."""

    def __init__(self, data_dir: Path, split: str, dtype: str, seq_len: int, seed: int, pack: bool,
                 overlong: str, pad_id: int, shuffle_pack: bool = True):
        self.tokens = np.memmap(data_dir / f"{split}.bin", dtype=np.dtype(dtype), mode="r")
        self.mask = np.memmap(data_dir / f"{split}.mask", dtype=np.uint8, mode="r")
        self.offsets = np.fromfile(data_dir / f"{split}.idx", dtype=np.int64)
        self.seq_len, self.seed, self.pack, self.pad_id, self.policy = seq_len, seed, pack, pad_id, overlong
        lengths = np.diff(self.offsets)
        self.examples = len(lengths)
        self.overlong = int(np.count_nonzero(lengths > seq_len))
        self.lengths = np.minimum(lengths, seq_len) if overlong == "truncate" else lengths
        keep = self.lengths <= seq_len
        # Targets a sequence can learn: a masked token with a token before it in the same example.
        targets = np.zeros(self.examples, dtype=np.int64)
        if len(self.mask):
            starts = self.offsets[:-1][lengths > 0]
            targets[lengths > 0] = np.add.reduceat(self.mask.astype(np.int64), starts) - self.mask[starts]
            long = np.flatnonzero(lengths > self.lengths)
            for i in long:  # truncated: count what is left
                o = self.offsets[i]
                targets[i] = int(self.mask[o + 1:o + self.lengths[i]].sum())
        self.no_targets = int(np.count_nonzero(keep & (targets == 0)))
        kept = np.flatnonzero(keep & (targets > 0))
        if not len(kept):
            raise UserError(f"{data_dir / f'{split}.bin'}: none of its {self.examples} examples fits train.seq_len="
                            f"{seq_len} with a target token left; raise train.seq_len or set "
                            f"data.overlong=truncate")
        if shuffle_pack:
            kept = kept[np.random.default_rng([seed, 2**32]).permutation(len(kept))]
        self.order, self.bins = self._pack(kept) if pack else (kept, np.arange(len(kept) + 1))
        self.num_samples = len(self.bins) - 1
        self.fill = float(self.lengths[kept].sum()) / (self.num_samples * seq_len)
        self._perm_epoch, self._perm = -1, None

    def _pack(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Best fit, in `order`: each example goes into the open sequence with the least room that
        still holds it. Returns the examples grouped by sequence, and each sequence's bounds."""
        room_of: dict[int, list[int]] = {}  # free tokens -> sequences with that much room
        rooms: list[int] = []  # the distinct free-token counts, sorted
        seq_of = np.empty(len(order), dtype=np.int64)
        count = 0
        for j, n in enumerate(self.lengths[order].tolist()):
            k = bisect.bisect_left(rooms, n)
            if k < len(rooms):
                room = rooms[k]
                seq = room_of[room].pop()
                if not room_of[room]:
                    del room_of[room], rooms[k]
            else:
                room, seq, count = self.seq_len, count, count + 1
            seq_of[j] = seq
            left = room - n
            if left not in room_of:
                room_of[left] = []
                bisect.insort(rooms, left)
            room_of[left].append(seq)
        grouped = np.argsort(seq_of, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(seq_of, minlength=count))])
        return order[grouped], bounds

    def window(self, sample: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        epoch, i = divmod(sample, self.num_samples)
        if shuffle:
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                self._perm_epoch = epoch
            i = int(self._perm[i])
        L = self.seq_len
        inputs = np.full(L, self.pad_id, dtype=np.int64)
        targets = np.full(L, IGNORE, dtype=np.int64)
        positions = np.zeros(L, dtype=np.int64)
        at = 0
        for e in self.order[self.bins[i]:self.bins[i + 1]]:
            o, n = int(self.offsets[e]), int(self.lengths[e])
            inputs[at:at + n] = self.tokens[o:o + n]
            nxt = np.where(self.mask[o + 1:o + n] > 0, self.tokens[o + 1:o + n].astype(np.int64), IGNORE)
            targets[at:at + n - 1] = nxt
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(L - at)  # padding: one more "example", with no targets
        return inputs, targets, positions

    def samples(self, indices, shuffle: bool = True) -> Batch:
        inputs, targets, positions = (np.stack(col) for col in zip(*(self.window(s, shuffle) for s in indices)))
        return Batch(inputs, targets, positions if self.pack else None)

    def batch(self, first_sample: int, size: int, shuffle: bool = True) -> Batch:
        return self.samples(range(first_sample, first_sample + size), shuffle)

    def summary(self) -> str:
        how = "packed into" if self.pack else "padded to"
        line = (f"{self.examples:,} examples {how} {self.num_samples:,} sequences of {self.seq_len} "
                f"({self.fill:.0%} non-pad tokens)")
        if self.overlong:
            line += (f"; {self.overlong:,} longer than train.seq_len="
                     f"{self.seq_len} {'truncated' if self.policy == 'truncate' else 'dropped'} (data.overlong)")
        if self.no_targets:
            line += f"; {self.no_targets:,} without a target token within train.seq_len dropped"
        return line


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
        out.append(data.samples([s % data.num_samples for s in range(first, first + micro)], shuffle=False))
    return out
