"""Tokenised datasets: `prepare` text into train.bin / val.bin / meta.json, then read packed sequences.

Sample order is a pure function of (seed, global sample index): global sample g lives in epoch
g // n at position perm_epoch[g % n], so the data position is just `samples_consumed` and a resume
(at any world size) continues the exact same stream. Each rank reads a disjoint slice of every
global batch.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from ds_train.errors import UserError
from ds_train.fs import file_lock, replacing, write_atomic

STDLIB = "python-stdlib"
# A generated source `name:arg` (for instance `ript-demos:32`): the caller maps each name to a
# function of `arg` that yields (document name, text). data.py knows none of them itself.
Generators = Mapping[str, Callable[[str], Iterator[tuple[str, str]]]]
EOS = "<|endoftext|>"
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


def iter_documents(sources: list[str], text_key: str = "text",
                   generators: Generators = {}) -> Iterator[tuple[str, str]]:
    """(name, text) for each non-empty document: a text file is one document, each JSONL line one.

    Names are relative to their source (they decide the train/val split, which must not depend on
    where the corpus happens to sit on disk).
    """
    for name, text in _documents(sources, text_key, generators):
        if text.strip():
            yield name, text


def _documents(sources: list[str], text_key: str, generators: Generators) -> Iterator[tuple[str, str]]:
    for source in sources:
        if source == STDLIB:
            root = Path(sysconfig.get_paths()["stdlib"])
            for path in python_stdlib_files():
                yield str(path.relative_to(root)), path.read_text(errors="replace")
            continue
        name, _, arg = source.partition(":")
        if name in generators:
            yield from generators[name](arg)
            continue
        path = Path(source)
        if not path.exists():
            raise UserError(f"data.sources: {source!r} does not exist")
        paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for p in paths:
            rel = str(p.relative_to(path)) if path.is_dir() else p.name
            if p.suffix == ".jsonl":
                for lineno, line in enumerate(p.read_text().splitlines(), 1):
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
            elif p.suffix in TEXT_SUFFIXES or not p.suffix:
                yield rel, p.read_text(errors="replace")


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


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"tokenizer: {str(path)!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer: cannot load {str(path)!r}: {str(e).splitlines()[0]}") from None


def _is_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


def prepare(sources: list[str], out_dir: str | Path, tokenizer: str = "", vocab_size: int = 4096,
            val_fraction: float = 0.02, text_key: str = "text", generators: Generators = {}) -> dict:
    """Tokenise `sources` into out_dir/{train,val}.bin and meta.json (written last: the done marker)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = list(iter_documents(sources, text_key, generators))
    if not docs:
        raise UserError(f"data.sources: {sources} hold no text documents")
    val_docs = [t for n, t in docs if _is_val(n, val_fraction)]
    train_docs = [t for n, t in docs if not _is_val(n, val_fraction)]
    if not val_docs or not train_docs:  # too few documents for a hashed split: hold out the last one
        train_docs, val_docs = [t for _, t in docs[:-1]] or [docs[0][1]], [docs[-1][1]]
    if tokenizer:
        tok, tok_dir = load_tokenizer(tokenizer), Path(tokenizer).resolve()
    else:
        tok_dir = (out / "tokenizer").resolve()
        tok = train_tokenizer(train_docs, vocab_size, tok_dir)
    vocab = len(tok)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    eos = tok.eos_token_id
    # A tokenizer inside out_dir is recorded relative to it, so the data directory can move.
    tok_rel = tok_dir.relative_to(out.resolve()) if tok_dir.is_relative_to(out.resolve()) else tok_dir
    meta = {"vocab_size": vocab, "dtype": np.dtype(dtype).name, "tokenizer": str(tok_rel),
            "eos_token_id": eos, "sources": sources, "max_token_id": 0}
    for split, texts in (("train", train_docs), ("val", val_docs)):
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((i for doc in ids for i in (*doc, eos)), dtype=np.int64)
        with replacing(out / f"{split}.bin") as tmp:
            flat.astype(dtype).tofile(tmp)
        meta[f"{split}_tokens"] = int(flat.size)
        meta[f"{split}_documents"] = len(texts)
        meta["max_token_id"] = max(meta["max_token_id"], int(flat.max()))
    write_atomic(out / "meta.json", json.dumps(meta, indent=2))
    return meta


def ensure_prepared(data_dir: str | Path, sources: list[str], tokenizer: str, vocab_size: int,
                    val_fraction: float, text_key: str, generators: Generators = {}) -> dict:
    """Prepare once: the first rank to take the lock tokenises, the others wait and then read."""
    data_dir = Path(data_dir)
    if (data_dir / "meta.json").is_file():
        return load_meta(data_dir)
    if not sources:
        raise UserError(f"data.dir: {str(data_dir)!r} has no meta.json and data.sources is empty; "
                        f"run `ds-train prepare` or set data.sources")
    with file_lock(data_dir / ".prepare.lock"):
        if not (data_dir / "meta.json").is_file():
            prepare(sources, data_dir, tokenizer, vocab_size, val_fraction, text_key, generators)
    return load_meta(data_dir)


def load_meta(data_dir: str | Path) -> dict:
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not path.is_file():
        raise UserError(f"data.dir: {str(data_dir)!r} has no meta.json; run `ds-train prepare` first")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    for split in ("train", "val"):
        if not (data_dir / f"{split}.bin").is_file():
            raise UserError(f"data.dir: {str(data_dir / f'{split}.bin')!r} is missing; "
                            f"run `ds-train prepare` again")
    meta["tokenizer"] = str(data_dir / meta["tokenizer"])  # absolute stays absolute
    return meta


def check_vocab(meta: dict, vocab_size: int | None, data_dir: str) -> None:
    """Every token id of the prepared data must be an id of the model's embedding."""
    if vocab_size is not None and meta.get("max_token_id", 0) >= vocab_size:
        raise UserError(f"data.dir {data_dir!r}: token id {meta['max_token_id']} >= the model's "
                        f"vocab_size {vocab_size}; prepare the data with the model's tokenizer or raise "
                        f"model.config.vocab_size")


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
