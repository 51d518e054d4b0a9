"""`prepare`: tokenise data.sources into data.dir (train.bin / val.bin, sft: their target masks and
example offsets, meta.json last), streaming, on every core; `ensure_prepared`: once per data.dir,
under a lock, and again when its inputs changed and data.reprepare is set.

Sample order, sharding and reading the prepared files are ds_train.data.datasets'.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ds_train.config import DataConfig
from ds_train.data.chat import Renderer
from ds_train.data.encode import SplitWriter, bpe_sample, encoded_chunks
from ds_train.data.fingerprint import NO_RECORD, fingerprint_differences, input_fingerprint
from ds_train.data.meta import META, PREPARED, check_is_dir, read_meta, read_meta_json, load_meta, token_dtype
from ds_train.data.sources import check_source_files, format_fields, input_bytes, no_documents_error
from ds_train.data.tokenizer import content_id, load_tokenizer, tokenizer_content_id, train_tokenizer
from ds_train.errors import UserError
from ds_train.fs import check_writable, file_lock, write_atomic

OUT_KEY = "--out (data.dir)"
SMALL_CORPUS_BYTES = 8 << 20  # below this, workers=0 (all cores) tokenises in this process


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
    tok = _check_request(sources, out, tokenizer, fmt, chat_template, split_digits, overwrite)
    # Taken before the sources are read: a file edited meanwhile then differs from the record.
    fingerprint = input_fingerprint(sources, tokenizer, vocab_size, val_fraction, text_key, fmt, chat_template,
                                    split_digits=split_digits)
    made = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    partial_tok = out / ".tokenizer.partial"
    writers: list[SplitWriter] = []
    try:
        fields = format_fields(fmt, text_key)
        if tok is not None:
            tok_dir = Path(tokenizer).resolve()
        else:
            tok = _train_bpe(sources, fields, fmt, chat_template, val_fraction, vocab_size, split_digits, partial_tok)
            tok_dir = (out / "tokenizer").resolve()
        backend = getattr(tok, "backend_tokenizer", None)
        encoder_args = (str(partial_tok if not tokenizer else tok_dir), backend.to_str() if backend else "",
                        tok.eos_token_id, len(tok), fmt, text_key, chat_template, val_fraction)
        group = 2 if fmt == "preference" else 1  # a pair: its chosen and rejected examples, kept together
        writers[:] = [SplitWriter(out, split, fmt != "text", group) for split in ("train", "val")]
        total = input_bytes(sources)
        n_workers = _workers(workers, total)
        started = time.monotonic()
        ranges = _encode(sources, fields, encoder_args, n_workers, writers, fmt, total, started)
        _check_some_documents(writers, sources)
        _balance(out, writers)
        train, val = writers
        ranges = [[min(r[0], _position(train, fmt)), min(r[1], _position(train, fmt))] if r else [0, 0]
                  for r in ranges]
        for w in writers:
            w.close()
        seconds = time.monotonic() - started
        fingerprint["tokenizer"]["content"] = content_id(tok)  # what it is (fingerprint_differences)
        meta = {"format": fmt, "vocab_size": len(tok), "dtype": np.dtype(token_dtype(len(tok))).name,
                "tokenizer": "", "eos_token_id": tok.eos_token_id, "sources": sources,
                "source_ranges": ranges, "max_token_id": max(train.max_id, val.max_id), "scan": {}}
        _put_in_place(out, writers, tokenizer, partial_tok)
        _describe_outputs(meta, out, writers, tok_dir, fmt)
        meta["fingerprint"] = fingerprint
        write_atomic(out / META, json.dumps(meta, indent=2))
    except BaseException:
        _remove_partial(writers, partial_tok, made)
        raise
    _say_prepared(train, val, fmt, total, seconds, n_workers)
    return meta


def _check_request(sources: list[str], out: Path, tokenizer: str, fmt: str, chat_template: str,
                   split_digits: bool, overwrite: bool):
    """What prepare is asked, checked before anything is written: out_dir, the sources, the tokenizer
    (loaded, None when prepare trains a BPE) and its chat template."""
    held = [name for name in PREPARED if (out / name).exists()]
    if held and not overwrite:
        raise UserError(f"prepare: {str(out)!r} already holds prepared data ({', '.join(held)}); give "
                        f"another {OUT_KEY}, or --overwrite to replace it")
    check_writable(out, OUT_KEY)
    check_source_files(sources)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    if fmt != "text" and tok is not None:
        Renderer(tok, chat_template)  # the template is there
    if split_digits and tok is not None:
        raise UserError("data.split_digits (--split-digits) applies to the BPE prepare trains; the tokenizer "
                        f"{tokenizer!r} splits numbers its own way: drop split_digits, or give no tokenizer")
    return tok


def _train_bpe(sources: list[str], fields, fmt: str, chat_template: str, val_fraction: float, vocab_size: int,
               split_digits: bool, partial_tok: Path):
    """The byte-level BPE prepare trains on a sample of the training documents, saved to `partial_tok`."""
    # Too few documents for a hashed split: they are all the sample (as they will all train).
    sample = (bpe_sample(sources, fields, fmt, chat_template, val_fraction)
              or bpe_sample(sources, fields, fmt, chat_template, 0.0))
    if not sample:
        raise no_documents_error(sources)
    tok = train_tokenizer(sample, vocab_size, partial_tok, chat_template, split_digits)
    if len(tok) < vocab_size:
        print(f"note: the BPE trained on {len(sample)} document(s) has {len(tok)} tokens, fewer than "
              f"the {vocab_size} asked for (data.vocab_size, --vocab-size): the corpus has no more "
              f"merges to learn; a model built from this data gets vocab_size {len(tok)}")
    return tok


def _encode(sources: list[str], fields, encoder_args: tuple, n_workers: int, writers: list[SplitWriter], fmt: str,
            total: int, started: float) -> list:
    """Every source tokenised into the partial train and val files, in input order; each source's
    train range (tokens; sft: examples), None for a source with no training document."""
    train, val = writers
    ranges: list = [None] * len(sources)
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
    return ranges


def _check_some_documents(writers: list[SplitWriter], sources: list[str]) -> None:
    train, val = writers
    if not train.docs + val.docs:
        if train.identical[0]:
            raise UserError(f"data.sources: all {train.identical[0]:,} preference pairs have the same chosen and "
                            f"rejected (the first at {train.identical[1]}): nothing to prefer; check which "
                            f"fields hold the two completions")
        raise no_documents_error(sources)


def _put_in_place(out: Path, writers: list[SplitWriter], tokenizer: str, partial_tok: Path) -> None:
    """The partial files renamed into place (the trained BPE too), the old meta.json gone first."""
    (out / META).unlink(missing_ok=True)  # from here on, out_dir does not look prepared
    for w in writers:
        w.finish()
    if not tokenizer:
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        os.replace(partial_tok, out / "tokenizer")


def _describe_outputs(meta: dict, out: Path, writers: list[SplitWriter], tok_dir: Path, fmt: str) -> None:
    """meta.json's record of the files in place: the tokenizer's path, each split's counts and scan,
    the preference pairs left out, the sft and preference targets."""
    train, val = writers
    # A tokenizer inside out_dir is recorded relative to it, so the data directory can move.
    meta["tokenizer"] = str(tok_dir.relative_to(out.resolve()) if tok_dir.is_relative_to(out.resolve())
                            else tok_dir)
    for split, w in (("train", train), ("val", val)):
        st = (out / f"{split}.bin").stat()
        meta[f"{split}_tokens"], meta[f"{split}_documents"] = w.tokens, w.docs
        meta["scan"][split] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "max_token_id": w.max_id}
    if fmt == "preference":
        identical = train.identical
        meta["identical_pairs"] = identical[0]
        if identical[0]:
            print(f"prepare: {identical[0]:,} pair(s) whose chosen and rejected are the same left out (nothing "
                  f"to prefer), the first at {identical[1]}", file=sys.stderr)
    if fmt != "text":
        for split in ("train", "val"):
            meta[f"{split}_targets"] = int(np.count_nonzero(np.memmap(out / f"{split}.mask", np.uint8, "r")))


def _remove_partial(writers: list[SplitWriter], partial_tok: Path, made: list[Path]) -> None:
    """After a failure: the partial files, the partial BPE and the directories this call made."""
    for w in writers:
        w.close()
        for p in w.paths:
            p.unlink(missing_ok=True)
    shutil.rmtree(partial_tok, ignore_errors=True)
    for p in made:  # deepest first: what this call created, if nothing else is in it
        with contextlib.suppress(OSError):
            p.rmdir()


def _say_prepared(train: SplitWriter, val: SplitWriter, fmt: str, total: int, seconds: float,
                  n_workers: int) -> None:
    docs = train.docs + val.docs
    what = f"{docs // 2:,} preference pairs ({docs:,} sequences)" if fmt == "preference" else f"{docs:,} documents"
    print(f"prepare: {what}, {train.tokens + val.tokens:,} tokens in {seconds:.1f} s "
          f"({total / 2**20 / max(seconds, 1e-9):.1f} MiB/s, {(train.tokens + val.tokens) / max(seconds, 1e-9):,.0f} "
          f"tokens/s, {n_workers} worker{'s' * (n_workers > 1)})", file=sys.stderr)


def _position(writer: SplitWriter, fmt: str) -> int:
    """Where the train split stands: in tokens (text), in examples (sft, preference)."""
    return writer.tokens if fmt == "text" else writer.docs


def _balance(out: Path, writers: list[SplitWriter]) -> None:
    """Too few documents for a hashed split: the last one is held out (copied when it is the only one)."""
    train, val = writers
    if not train.docs:  # every document hashed to val: they train instead
        train.close()
        val.become("train")  # over the empty train files
        val.identical = train.identical
        writers[:] = train, val = [val, SplitWriter(out, "val", val.sft, val.group)]
    if val.docs:
        return
    last = train.last
    if train.docs > train.group:
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
    check_is_dir(data_dir)

    meta_path = data_dir / META

    def problem() -> str:
        """Why the prepared data.dir cannot be used as it is ("" when it can): damaged (meta.json,
        the .bin files, its own tokenizer) or, with sources, prepared from other inputs."""
        try:
            if sources:
                current = input_fingerprint(sources, tokenizer, d.vocab_size, d.val_fraction, d.text_key,
                                            d.format, d.chat_template, split_digits=d.split_digits, hashed=False)
                meta = read_meta_json(data_dir)
                recorded = meta.get("fingerprint")
                if (isinstance(recorded, dict) and isinstance(recorded.get("tokenizer"), dict)
                        and recorded["tokenizer"].get("trained") and isinstance(meta.get("tokenizer"), str)):
                    # the BPE prepare trained lies in data.dir: what it is can be read there
                    recorded = {**recorded, "tokenizer": {**recorded["tokenizer"],
                                                          "path": str((data_dir / meta["tokenizer"]).resolve())}}
                diffs = fingerprint_differences(recorded, current, content=tokenizer_content_id)
                if diffs:
                    return _inputs_changed(data_dir, diffs)
            own = data_dir / read_meta(data_dir)["tokenizer"]  # reads, never waits for the lock
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
        raise UserError(f"data.dir: {str(data_dir)!r} has no {META} and data.sources is empty; "
                        f"run `ds-train prepare` or set data.sources")
    # Checked before the lock file is made: a missing source, a bad tokenizer or data.dir.
    _check_can_prepare(data_dir)
    check_source_files(sources)
    if tokenizer:
        load_tokenizer(tokenizer)
    made = [p for p in (data_dir.absolute(), *data_dir.absolute().parents) if not p.exists()]
    gc.enable()  # a corpus streamed during a rank's start-up: the collector back on (ds_train.__main__.cli)
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
