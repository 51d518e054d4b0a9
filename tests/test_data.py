"""ds_train.data: prepare / ensure_prepared / load_meta, and the seeded, rank-sharded sample stream."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ds_train.data import (TokenData, ensure_prepared, eval_micro_batches, load_meta, load_tokenizer,
                           prepare, rank_micro_batches)
from ds_train.errors import UserError

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (3 + i) for i in range(5)]
RECORDS = [f"record {i}: the quick brown fox jumps over the lazy dog {i}" for i in range(5)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for i, text in enumerate(TEXTS):
        (src / f"doc{i}.txt").write_text(text)
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(RECORDS)]
    (src / "records.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    return src


@pytest.fixture(scope="module")
def prepared(sources, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("prepared")
    return out, prepare([str(sources)], out, vocab_size=300, val_fraction=0.5)


def split_docs(path: Path, dtype: str, eos: int) -> list[list[int]]:
    tokens = np.fromfile(path, dtype=dtype).tolist()
    assert tokens[-1] == eos  # every document ends with EOS
    docs, cur = [], []
    for t in tokens:
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs


# --- prepare -------------------------------------------------------------------------------------

def test_prepare_writes_bins_and_meta(prepared):
    out, meta = prepared
    assert {"train.bin", "val.bin", "meta.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "tokenizer"  # relative: the data dir can move
    for split in ("train", "val"):
        size = (out / f"{split}.bin").stat().st_size
        assert size == meta[f"{split}_tokens"] * np.dtype(np.uint16).itemsize
        assert meta[f"{split}_documents"] >= 1
    assert meta["train_documents"] + meta["val_documents"] == len(TEXTS) + len(RECORDS)
    assert meta["vocab_size"] <= 300
    assert 0 < meta["max_token_id"] < meta["vocab_size"]
    assert not list(out.glob(".*.tmp"))


def test_prepared_tokens_decode_back_to_every_document_once(prepared):
    out, meta = prepared
    tok = load_tokenizer(load_meta(out)["tokenizer"])
    eos = meta["eos_token_id"]
    assert eos == tok.eos_token_id
    decoded = {}
    for split in ("train", "val"):
        docs = split_docs(out / f"{split}.bin", meta["dtype"], eos)
        assert len(docs) == meta[f"{split}_documents"]
        decoded[split] = [tok.decode(d) for d in docs]
    assert not set(decoded["train"]) & set(decoded["val"])
    assert sorted(decoded["train"] + decoded["val"]) == sorted(TEXTS + RECORDS)


def test_load_meta_resolves_the_tokenizer_and_it_loads(prepared):
    out, meta = prepared
    loaded = load_meta(out)
    assert Path(loaded["tokenizer"]) == out / "tokenizer"
    tok = load_tokenizer(loaded["tokenizer"])
    assert len(tok) == meta["vocab_size"]
    ids = tok("return x", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "return x"


def test_prepare_with_an_existing_tokenizer(prepared, sources, tmp_path):
    out, meta = prepared
    meta2 = prepare([str(sources / "doc0.txt"), str(sources / "doc1.txt")], tmp_path,
                    tokenizer=str(out / "tokenizer"), val_fraction=0.5)
    assert Path(meta2["tokenizer"]) == (out / "tokenizer").resolve()
    assert not (tmp_path / "tokenizer").exists()
    assert meta2["vocab_size"] == meta["vocab_size"]
    assert meta2["train_documents"] + meta2["val_documents"] == 2


def test_jsonl_line_without_the_text_key_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(UserError) as e:
        prepare([str(path)], tmp_path / "out", vocab_size=300, val_fraction=0.5)
    assert f"{path}:2" in str(e.value)
    assert "'text'" in str(e.value)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n{oops\n")
    with pytest.raises(UserError, match=f"{path}:3"):
        prepare([str(path)], tmp_path / "out", vocab_size=300, val_fraction=0.5)


def test_jsonl_custom_text_key(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"content": f"item {i} " * 5}) for i in range(4)))
    meta = prepare([str(path)], tmp_path / "out", vocab_size=300, val_fraction=0.5, text_key="content")
    assert meta["train_documents"] + meta["val_documents"] == 4


def test_jsonl_null_text_is_rejected(tmp_path):
    """Regression, fixed: before the fix, iter_documents does `str(record[text_key])`, so {"text": null} becomes the
    document "None" (and {"text": 5} becomes "5"), although the error message promises a *string*
    field. Expected: UserError naming file:line."""
    path = tmp_path / "null.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": None}) + "\n")
    with pytest.raises(UserError, match=f"{path}:2"):
        prepare([str(path)], tmp_path / "out", vocab_size=300, val_fraction=0.5)


def test_missing_source_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare([str(tmp_path / "nowhere")], tmp_path / "out", vocab_size=300)


def test_sources_without_documents_is_a_user_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(UserError, match="no text documents"):
        prepare([str(tmp_path / "src")], tmp_path / "out", vocab_size=300)


# --- ensure_prepared / load_meta -----------------------------------------------------------------

def test_ensure_prepared_prepares_once(sources, tmp_path):
    data_dir = tmp_path / "data"
    args = ([str(sources / "doc0.txt"), str(sources / "doc1.txt"), str(sources / "doc2.txt")],
            "", 300, 0.5, "text")
    meta = ensure_prepared(data_dir, *args)
    assert (data_dir / "meta.json").is_file()
    old = 1_000_000_000  # back-date every file so a rewrite would show whatever the clock resolution
    files = ["train.bin", "val.bin", "meta.json", "tokenizer/tokenizer.json"]
    for name in files:
        os.utime(data_dir / name, ns=(old, old))
    again = ensure_prepared(data_dir, *args)
    assert again == meta
    for name in files:
        assert (data_dir / name).stat().st_mtime_ns == old, name


def test_ensure_prepared_without_sources_or_data(tmp_path):
    with pytest.raises(UserError, match="data.sources is empty"):
        ensure_prepared(tmp_path, [], "", 300, 0.5, "text")


def test_load_meta_on_an_empty_dir(tmp_path):
    with pytest.raises(UserError, match="no meta.json"):
        load_meta(tmp_path)


def test_load_meta_with_a_missing_bin(prepared, tmp_path):
    out, _ = prepared
    (tmp_path / "meta.json").write_text((out / "meta.json").read_text())
    (tmp_path / "train.bin").write_bytes(b"")
    with pytest.raises(UserError, match="val.bin"):
        load_meta(tmp_path)


def test_load_meta_with_invalid_json(tmp_path):
    (tmp_path / "meta.json").write_text("{\n  \"vocab_size\": \n")
    with pytest.raises(UserError, match="invalid JSON at line"):
        load_meta(tmp_path)


def test_load_tokenizer_on_a_missing_dir(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


# --- TokenData and the sample stream -------------------------------------------------------------

SEQ = 4
N_TOKENS = 1601  # 400 windows of 4 (+1 shifted target)


@pytest.fixture
def bin_path(tmp_path) -> Path:
    path = tmp_path / "train.bin"
    np.arange(N_TOKENS, dtype=np.uint16).tofile(path)
    return path


def data(bin_path, seed=7) -> TokenData:
    return TokenData(bin_path, "uint16", SEQ, seed)


def sample_ids(batches: list[np.ndarray]) -> list[int]:
    """Window index of each row (the token values are the positions, windows start at idx*SEQ)."""
    return [int(row[0]) // SEQ for b in batches for row in b]


def test_windows_are_contiguous_with_shifted_targets(bin_path):
    d = data(bin_path)
    assert d.num_samples == 400
    for s in (0, 17, 399, 400, 1234):
        w = d.window(s)
        assert w.shape == (SEQ + 1,) and w.dtype == np.int64
        assert np.array_equal(w, np.arange(w[0], w[0] + SEQ + 1))
        assert w[0] % SEQ == 0
    assert np.array_equal(d.window(5, shuffle=False), np.arange(20, 25))


def test_an_epoch_is_a_permutation(bin_path):
    d = data(bin_path)
    for epoch in range(2):
        ids = [int(d.window(epoch * 400 + i)[0]) // SEQ for i in range(400)]
        assert sorted(ids) == list(range(400))
    first = [int(d.window(i)[0]) for i in range(400)]
    second = [int(d.window(400 + i)[0]) for i in range(400)]
    assert first != second  # reshuffled each epoch
    assert first != sorted(first)  # actually shuffled


@pytest.mark.parametrize("step", [0, 1, 5, 30])
def test_world_size_invariance_of_the_stream(bin_path, step):
    global_batch, micro = 8, 2
    d = data(bin_path)
    whole = sample_ids(rank_micro_batches(d, step, global_batch, micro, rank=0, world=1))
    r0 = sample_ids(rank_micro_batches(d, step, global_batch, micro, rank=0, world=2))
    r1 = sample_ids(rank_micro_batches(d, step, global_batch, micro, rank=1, world=2))
    assert len(whole) == global_batch and len(r0) == len(r1) == global_batch // 2
    assert not set(r0) & set(r1)
    assert r0 + r1 == whole
    r = [sample_ids(rank_micro_batches(d, step, global_batch, 1, rank=k, world=4)) for k in range(4)]
    assert sum(r, []) == whole  # micro 1 x accum 2 x world 4: the same global batch again


def test_micro_batch_shapes(bin_path):
    batches = rank_micro_batches(data(bin_path), 3, global_batch=16, micro=2, rank=1, world=2)
    assert len(batches) == 4  # 16 / 2 ranks / micro 2 = 4 accumulation steps
    assert all(b.shape == (2, SEQ + 1) and b.dtype == np.int64 for b in batches)


def test_same_seed_and_step_give_the_same_batch(bin_path):
    a = rank_micro_batches(data(bin_path, seed=7), 11, 8, 2, rank=1, world=2)
    fresh = data(bin_path, seed=7)  # a resumed process: new object, no warm permutation cache
    rank_micro_batches(fresh, 70, 8, 2, rank=0, world=2)  # visit another epoch first
    b = rank_micro_batches(fresh, 11, 8, 2, rank=1, world=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_different_seed_gives_a_different_order(bin_path):
    a = sample_ids(rank_micro_batches(data(bin_path, seed=7), 0, 8, 2, 0, 1))
    b = sample_ids(rank_micro_batches(data(bin_path, seed=8), 0, 8, 2, 0, 1))
    assert a != b


def test_steps_within_an_epoch_never_repeat_a_window(bin_path):
    d = data(bin_path)
    seen: list[int] = []
    steps_per_epoch = 400 // 8
    for step in range(steps_per_epoch):
        for rank in range(2):
            seen += sample_ids(rank_micro_batches(d, step, 8, 2, rank, 2))
    assert len(seen) == len(set(seen)) == 400


def test_eval_batches_are_deterministic_and_in_file_order(bin_path):
    d1, d2 = data(bin_path, seed=1), data(bin_path, seed=2)
    a = eval_micro_batches(d1, batches=3, micro=2, rank=1, world=2)
    b = eval_micro_batches(d2, batches=3, micro=2, rank=1, world=2)
    assert len(a) == 3 and all(x.shape == (2, SEQ + 1) for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # seed plays no part
    r0 = sample_ids(eval_micro_batches(d1, 3, 2, rank=0, world=2))
    r1 = sample_ids(eval_micro_batches(d1, 3, 2, rank=1, world=2))
    assert not set(r0) & set(r1)
    assert sorted(r0 + r1) == list(range(12))


def test_eval_wraps_around_a_small_val_set(tmp_path):
    path = tmp_path / "val.bin"
    np.arange(3 * SEQ + 1, dtype=np.uint16).tofile(path)  # 3 windows
    d = TokenData(path, "uint16", SEQ, 0)
    ids = sample_ids(eval_micro_batches(d, batches=2, micro=2, rank=0, world=1))
    assert ids == [0, 1, 2, 0]


def test_too_few_tokens_is_a_user_error(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(SEQ, dtype=np.uint16).tofile(path)
    with pytest.raises(UserError, match="fewer than train.seq_len"):
        TokenData(path, "uint16", SEQ, 0)


def _prepare_in_child(args):
    from ds_train.data import ensure_prepared

    data_dir, src = args
    return ensure_prepared(data_dir, [src], "", 300, 0.3, "text")["train_tokens"]


@pytest.mark.slow
def test_ensure_prepared_from_two_processes_at_once_prepares_once(tmp_path):
    """Ranks starting together: one tokenises under the lock, the other waits and reads."""
    import multiprocessing as mp

    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"text number {i} " * 300)
    data_dir = tmp_path / "data"
    with mp.get_context("spawn").Pool(2) as pool:
        counts = pool.map(_prepare_in_child, [(str(data_dir), str(src))] * 2)
    assert counts[0] == counts[1] > 0
    assert sorted(p.name for p in data_dir.iterdir() if not p.name.startswith(".")) == [
        "meta.json", "tokenizer", "train.bin", "val.bin"]
    assert not list(data_dir.glob(".*.tmp"))
