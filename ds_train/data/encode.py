"""The encode pipeline of `prepare`: records -> token arrays per split, in worker processes, and the
split writers that append them to partial files in input order."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import zlib
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from ds_train.data.chat import Renderer, conversation, preference, record_tools
from ds_train.data.meta import SFT_FILES, token_dtype
from ds_train.data.sources import Chunk, chunks, format_fields, records
from ds_train.data.tokenizer import EOS, load_tokenizer

BPE_SAMPLE_BYTES = 64 << 20  # the BPE (no tokenizer given) learns from at most this much text


def _is_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


@dataclass(frozen=True)
class Encoded:
    """One chunk's documents of one split: their tokens (and targets, sft and preference) and each
    example's length (a preference document is two examples: chosen, then rejected)."""
    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None = None
    identical: tuple[int, str] = (0, "")  # preference pairs left out: chosen == rejected (count, the first's place)


class Encoder:
    """Records -> token arrays per split: what a worker process does with each chunk. Text: each
    document's tokens and EOS, through the tokenizer's Rust backend alone (`backend`: its JSON, as
    the main process loaded it; a worker then never imports transformers); sft: each
    conversation's tokens and its target mask (ds_train.chat, the whole Hugging Face tokenizer);
    preference: each pair's chosen and rejected sequences and their masks, a pair whose two sides
    are the same left out and counted."""

    def __init__(self, tokenizer_dir: str, backend: str, eos: int, vocab: int, fmt: str, text_key: str,
                 chat_template: str, val_fraction: float):
        self.fmt, self.val_fraction, self.eos = fmt, val_fraction, eos
        self.fields = format_fields(fmt, text_key)
        self.dtype = token_dtype(vocab)
        if fmt == "text" and backend:
            from tokenizers import Tokenizer

            fast = Tokenizer.from_str(backend)
            self._batch = lambda texts: [e.ids for e in fast.encode_batch_fast(texts, add_special_tokens=False)]
        else:
            tok = load_tokenizer(tokenizer_dir)
            self.renderer = Renderer(tok, chat_template) if fmt != "text" else None
            self._batch = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, chunk: Chunk) -> dict[str, Encoded]:
        splits: dict[str, list] = {"train": [], "val": []}
        identical: tuple[int, str] = (0, "")
        for name, record in records(chunk, self.fields):
            if self.fmt == "preference":
                where = _where(chunk, name)
                record = preference(record, where)
                if record[1] == record[2]:  # chosen == rejected: nothing to prefer
                    identical = (identical[0] + 1, identical[1] or where)
                    continue
            splits["val" if _is_val(name, self.val_fraction) else "train"].append((name, record))
        out = {split: self._encode(docs, chunk) for split, docs in splits.items()}
        out["train"] = replace(out["train"], identical=identical)  # counted once, in file order
        return out

    def _encode(self, docs: list, chunk: Chunk) -> Encoded:
        if self.fmt == "text":
            ids = self._batch([text for _, text in docs])
            lengths = np.array([len(d) + 1 for d in ids], dtype=np.int64)
            flat = list(itertools.chain.from_iterable(d + [self.eos] for d in ids))
            return Encoded(np.array(flat, dtype=self.dtype), lengths)
        if self.fmt == "preference":  # records checked by __call__: (prompt, chosen, rejected)
            pairs = [self.renderer.encode_completion(prompt, side, _where(chunk, name))
                     for name, (prompt, chosen, rejected) in docs for side in (chosen, rejected)]
        else:
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
    """Appends a split's encoded chunks to partial files (tokens; sft and preference: mask and
    offsets). `group`: examples per document (a preference pair: 2), moved whole by _balance."""

    def __init__(self, out: Path, split: str, sft: bool, group: int = 1):
        self.out, self.sft, self.group = out, sft, group
        self.tokens, self.docs, self.max_id, self.itemsize, self.last = 0, 0, -1, 1, None
        self.identical: tuple[int, str] = (0, "")
        self._open(split, "wb")
        if sft:
            np.zeros(1, np.int64).tofile(self.files[2])  # offsets: 0, then each example's end

    def _open(self, split: str, mode: str) -> None:
        self.names = [f"{split}.bin", *([f"{split}.{k}" for k in SFT_FILES] if self.sft else [])]
        self.paths = [self.out / f".{name}.partial" for name in self.names]
        self.files = [open(p, mode) for p in self.paths]

    def write(self, part: Encoded) -> None:
        if part.identical[0]:
            self.identical = (self.identical[0] + part.identical[0], self.identical[1] or part.identical[1])
        if not len(part.lengths):
            return
        part.tokens.tofile(self.files[0])
        if self.sft:
            part.mask.tofile(self.files[1])
            (self.tokens + np.cumsum(part.lengths)).tofile(self.files[2])
        self.tokens += len(part.tokens)
        self.docs += len(part.lengths)
        self.max_id, self.itemsize = max(self.max_id, int(part.tokens.max())), part.tokens.itemsize
        lengths = part.lengths[-self.group:]
        n = int(lengths.sum())
        self.last = Encoded(part.tokens[-n:], lengths, None if part.mask is None else part.mask[-n:])

    def drop_last(self) -> None:
        """Remove the last document (it moves to the other split)."""
        self.tokens -= int(self.last.lengths.sum())
        self.docs -= len(self.last.lengths)
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


def bpe_sample(sources: list[str], fields: tuple[str, ...], fmt: str, chat_template: str,
                val_fraction: float) -> list[str]:
    """The texts the BPE learns from: the first BPE_SAMPLE_BYTES / len(sources) of each source's
    training documents (rendered conversations, sft), in order: bounded and deterministic."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    renderer = None
    if fmt != "text":  # rendering needs only the special tokens' text
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
                if fmt == "preference":
                    prompt, chosen, rejected = preference(record, where)
                    record = "".join(renderer.render(prompt + side, where) for side in (chosen, rejected))
                else:
                    record = "".join(t for t, _ in renderer.segments(conversation(record, where), where,
                                                                     tools=record_tools(record, where)))
            texts.append(record)
            taken[chunk.source] += len(record)
            if taken[chunk.source] >= budget:
                break
    return texts

