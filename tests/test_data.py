"""ds_train.data: prepare / ensure_prepared / load_meta, and the seeded, rank-sharded sample stream."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, expect_error, tiny_config, tree_listing, write_config
from ds_train.data.datasets import TokenData, eval_micro_batches, rank_micro_batches
from ds_train.data.meta import check_vocab, load_meta
from ds_train.data.prepare import ensure_prepared, prepare
from ds_train.data.tokenizer import load_tokenizer, train_tokenizer
from ds_train.config import DataConfig
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


def data_config(data_dir, sources, **data) -> DataConfig:
    """The data section of a run config (ensure_prepared's input); vocab 300, half held out."""
    return DataConfig(**{"dir": str(data_dir), "sources": [str(s) for s in sources], "vocab_size": 300,
                         "val_fraction": 0.5, **data})


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
    with pytest.raises(UserError, match="holds no documents"):
        prepare([str(tmp_path / "src")], tmp_path / "out", vocab_size=300)


# --- ensure_prepared / load_meta -----------------------------------------------------------------

def test_ensure_prepared_prepares_once(sources, tmp_path):
    data_dir = tmp_path / "data"
    d = data_config(data_dir, [sources / "doc0.txt", sources / "doc1.txt", sources / "doc2.txt"])
    meta = ensure_prepared(d)
    assert (data_dir / "meta.json").is_file()
    old = 1_000_000_000  # back-date files rewritten in place so a rewrite would show whatever the clock
    for name in ["meta.json", "tokenizer/tokenizer.json"]:  # resolution; the .bins' mtimes are on record
        os.utime(data_dir / name, ns=(old, old))
    files = ["train.bin", "val.bin", "meta.json", "tokenizer/tokenizer.json"]
    stats = {name: ((data_dir / name).stat().st_ino, (data_dir / name).stat().st_mtime_ns) for name in files}
    again = ensure_prepared(d)
    assert again == meta
    for name in files:  # a replaced file has a new inode
        assert ((data_dir / name).stat().st_ino, (data_dir / name).stat().st_mtime_ns) == stats[name], name


def test_ensure_prepared_without_sources_or_data(tmp_path):
    with pytest.raises(UserError, match="data.sources is empty"):
        ensure_prepared(data_config(tmp_path, []))


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


# --- the record of prepare's inputs --------------------------------------------------------------

CORPUS = {f"doc{i}.txt": f"class C{i}:\n    value = {i}  # item {i}\n" * (4 + i) for i in range(5)}


@pytest.fixture
def corpus(tmp_path) -> Path:
    src = tmp_path / "corpus"
    src.mkdir()
    for name, text in CORPUS.items():
        (src / name).write_text(text)
    return src


def ensure(data_dir, sources, tokenizer="", vocab_size=300, reprepare=False, **data) -> dict:
    return ensure_prepared(data_config(data_dir, sources, vocab_size=vocab_size, reprepare=reprepare, **data),
                           str(tokenizer or ""))


def listing(root: Path) -> dict[str, tuple[int, str]]:
    """name -> (size, sha256) of every file under root: what an error must leave as it was."""
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_refused(call, data_dir: Path, *parts: str) -> str:
    """call() raises a one-line UserError holding every part and changes nothing in data_dir."""
    before = listing(data_dir)
    with pytest.raises(UserError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message
    for part in parts:
        assert part in message
    assert listing(data_dir) == before
    return message


def test_a_grown_source_file_stops_the_run_and_names_it(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus])
    size = (corpus / "doc1.txt").stat().st_size
    with open(corpus / "doc1.txt", "a") as fh:
        fh.write("more = 1\n")
    message = assert_refused(lambda: ensure(data_dir, [corpus]), data_dir,
                      f"data.dir {str(data_dir)!r} was prepared from other inputs",
                      f"data.sources[0] {str(corpus)!r}: doc1.txt size {size} -> {size + 9}",
                      "data.reprepare=true", "point data.dir elsewhere")
    assert "and " not in message.split("(")[1]  # one difference, no "and N more"


def test_a_touched_or_copied_source_with_the_same_content_is_unchanged(corpus, tmp_path):
    data_dir = tmp_path / "data"
    meta = ensure(data_dir, [corpus])
    os.utime(corpus / "doc1.txt", ns=(1_000_000_000, 1_000_000_000))
    (corpus / "doc2.txt").write_text(CORPUS["doc2.txt"])  # rewritten as it was
    assert ensure(data_dir, [corpus]) == meta
    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy, copy_function=shutil.copy)  # new mtimes, same names and bytes
    assert ensure(data_dir, [copy]) == meta
    (corpus / "image.png").write_bytes(b"\x89PNG")  # not a text file: prepare never reads it
    assert ensure(data_dir, [corpus]) == meta


def test_same_size_other_content_is_a_change(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus])
    (corpus / "doc3.txt").write_text(CORPUS["doc3.txt"].replace("value", "VALUE"))
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, "doc3.txt content changed (same size)",
            "data.reprepare=true")


def test_added_files_and_sources_are_changes(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus])
    (corpus / "sub").mkdir()
    (corpus / "sub" / "new.txt").write_text("x = 1\n")
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, f"data.sources[0] {str(corpus)!r}: sub/new.txt added")
    (corpus / "sub" / "new.txt").unlink()
    extra = tmp_path / "extra.txt"
    extra.write_text("y = 2\n")
    assert_refused(lambda: ensure(data_dir, [corpus, extra]), data_dir, f"data.sources[1] {str(extra)!r} added")
    (corpus / "doc0.txt").unlink()
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, "doc0.txt removed")


def test_many_differences_are_counted_not_listed(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus])
    for name in CORPUS:
        with open(corpus / name, "a") as fh:
            fh.write("z = 0\n")
    message = assert_refused(lambda: ensure(data_dir, [corpus], vocab_size=320), data_dir, "; and 3 more)")
    assert message.count(" size ") == 3


def test_a_changed_tokenizer_is_a_change(corpus, tmp_path):
    tok_a, tok_b = tmp_path / "tok_a", tmp_path / "tok_b"
    train_tokenizer(list(CORPUS.values()), 300, tok_a)
    train_tokenizer(RECORDS, 290, tok_b)
    data_dir = tmp_path / "data"
    meta = ensure(data_dir, [corpus], tokenizer=tok_a)
    assert_refused(lambda: ensure(data_dir, [corpus], tokenizer=tok_b), data_dir,
            f"tokenizer {str(tok_a.resolve())!r} -> {str(tok_b.resolve())!r}", "data.reprepare=true")
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir,
            f"tokenizer: {str(tok_a.resolve())!r} -> a BPE trained on the sources")
    copy = tmp_path / "tok_copy"
    shutil.copytree(tok_a, copy, copy_function=shutil.copy)
    assert ensure(data_dir, [corpus], tokenizer=copy) == meta  # the same files elsewhere: the same
    (tok_a / "tokenizer.json").write_text((tok_b / "tokenizer.json").read_text())
    assert_refused(lambda: ensure(data_dir, [corpus], tokenizer=tok_a), data_dir,
            f"tokenizer {str(tok_a.resolve())!r} changed")
    other = tmp_path / "data2"
    ensure(other, [corpus])
    assert_refused(lambda: ensure(other, [corpus], tokenizer=tok_b), other,
            f"tokenizer: {str((other / 'tokenizer').resolve())!r} (the BPE trained on the sources) -> "
            f"{str(tok_b.resolve())!r}, a different tokenizer")


def test_a_tokenizer_is_compared_by_what_it_is_not_where_it_came_from(corpus, tmp_path):
    """A model directory holding the tokenizer the data was prepared with (a copy saved elsewhere
    with save_pretrained, as a run's hf_model/ holds it) is the same tokenizer; another one is not."""
    data_dir = tmp_path / "data"
    meta = ensure(data_dir, [corpus])  # the BPE prepare trains into data_dir/tokenizer
    model_dir = tmp_path / "model"
    load_tokenizer(data_dir / "tokenizer").save_pretrained(str(model_dir))
    (model_dir / "config.json").write_text("{}")
    assert ensure(data_dir, [corpus], tokenizer=model_dir) == meta
    tok_a = tmp_path / "tok_a"
    train_tokenizer(list(CORPUS.values()), 300, tok_a)
    other = tmp_path / "data_a"
    meta_a = ensure(other, [corpus], tokenizer=tok_a)
    resaved = tmp_path / "resaved"
    load_tokenizer(tok_a).save_pretrained(str(resaved))
    (resaved / "extra_notes.json").write_text("{}")
    assert ensure(other, [corpus], tokenizer=resaved) == meta_a
    tok_b = tmp_path / "tok_b"
    train_tokenizer(RECORDS, 290, tok_b)
    assert_refused(lambda: ensure(data_dir, [corpus], tokenizer=tok_b), data_dir,
                   str((data_dir / "tokenizer").resolve()), str(tok_b.resolve()), "a different tokenizer")
    assert_refused(lambda: ensure(other, [corpus], tokenizer=tok_b), other,
                   str(tok_a.resolve()), str(tok_b.resolve()), "a different tokenizer")


def test_a_changed_vocab_size_of_the_trained_bpe_is_a_change(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus], vocab_size=300)
    assert_refused(lambda: ensure(data_dir, [corpus], vocab_size=320), data_dir, "data.vocab_size 300 -> 320")
    assert_refused(lambda: ensure(data_dir, [corpus], val_fraction=0.25, text_key="body"), data_dir,
            "data.val_fraction 0.5 -> 0.25", "data.text_key 'text' -> 'body'")


def test_split_digits_makes_every_digit_a_token_and_is_part_of_the_record(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus], split_digits=True)
    tok = load_tokenizer(data_dir / "tokenizer")
    pieces = tok.convert_ids_to_tokens(tok("x = 12345 + 67\n", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1234567"), pieces
    assert tok.decode(tok("x = 12345 + 67\n")["input_ids"]) == "x = 12345 + 67\n"
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, "data.split_digits True -> False")
    other = tmp_path / "data2"
    ensure(other, [corpus])  # recorded only when true: a record from before split_digits reads the same
    assert "split_digits" not in json.loads((other / "meta.json").read_text())["fingerprint"]["tokenizer"]
    assert_refused(lambda: ensure(other, [corpus], split_digits=True), other, "data.split_digits False -> True")
    with pytest.raises(UserError, match=r"^data.split_digits \(--split-digits\) applies to the BPE prepare trains"):
        prepare([str(corpus)], tmp_path / "data3", str(data_dir / "tokenizer"), split_digits=True)
    assert not (tmp_path / "data3").exists()


def test_reprepare_prepares_again_for_the_new_inputs(corpus, tmp_path):
    data_dir = tmp_path / "data"
    old = ensure(data_dir, [corpus])
    (corpus / "doc9.txt").write_text("def g(y):\n    return y - 1\n" * 20)
    new = ensure(data_dir, [corpus], vocab_size=320, reprepare=True)
    fresh = prepare([str(corpus)], tmp_path / "fresh", vocab_size=320, val_fraction=0.5)
    for key in ("train_tokens", "val_tokens", "train_documents", "val_documents", "vocab_size"):
        assert new[key] == fresh[key], key
    assert new["train_tokens"] + new["val_tokens"] > old["train_tokens"] + old["val_tokens"]
    assert "doc9.txt" in new["fingerprint"]["sources"][0]["files"]
    assert {k: v for k, v in new["fingerprint"]["tokenizer"].items() if k != "content"} == {"trained": True,
                                                                                            "vocab_size": 320}
    assert (data_dir / "train.bin").stat().st_size == new["train_tokens"] * 2
    mtime = (data_dir / "meta.json").stat().st_mtime_ns
    assert ensure(data_dir, [corpus], vocab_size=320, reprepare=True) == new  # the same inputs: kept
    assert ensure(data_dir, [corpus], vocab_size=320) == new
    assert (data_dir / "meta.json").stat().st_mtime_ns == mtime


def test_a_meta_without_a_record_of_its_inputs(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus])
    meta = json.loads((data_dir / "meta.json").read_text())
    del meta["fingerprint"]
    (data_dir / "meta.json").write_text(json.dumps(meta))
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, "was prepared without a record of its inputs",
            "data.reprepare=true", "data.sources=[]")
    assert ensure(data_dir, [])["train_tokens"] == meta["train_tokens"]
    assert "fingerprint" in ensure(data_dir, [corpus], reprepare=True)


# --- the .bin files against meta.json ------------------------------------------------------------

@pytest.fixture
def data_dir(prepared, tmp_path) -> Path:
    """A private copy of the prepared data, to damage."""
    out = tmp_path / "data"
    shutil.copytree(prepared[0], out)
    return out


def test_a_truncated_bin_names_the_file_and_the_sizes(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    tokens = meta["train_tokens"]
    with open(data_dir / "train.bin", "rb+") as fh:
        fh.truncate(tokens * 2 - 1)
    assert_refused(lambda: load_meta(data_dir), data_dir,
            f"data.dir {str(data_dir)!r}: train.bin is {tokens * 2 - 1} bytes, not {tokens} uint16 tokens "
            f"({tokens * 2} bytes) as meta.json records (truncated or overwritten); prepare it again")


def test_a_bin_whose_size_disagrees_with_the_token_count(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    with open(data_dir / "val.bin", "ab") as fh:
        fh.write(b"\x01\x00")  # one whole token more
    assert_refused(lambda: load_meta(data_dir), data_dir,
            f"val.bin is {meta['val_tokens'] * 2 + 2} bytes, not {meta['val_tokens']} uint16 tokens")


@pytest.mark.parametrize("change, expected", [
    ({"dtype": "int8"}, "meta.json: 'dtype' is 'int8', not uint16 or uint32"),
    ({"vocab_size": 70_000}, "meta.json dtype uint16 cannot hold vocab_size 70000"),
])
def test_a_meta_dtype_that_cannot_hold_the_vocabulary(data_dir, change, expected):
    meta = json.loads((data_dir / "meta.json").read_text())
    (data_dir / "meta.json").write_text(json.dumps({**meta, **change}))
    assert_refused(lambda: load_meta(data_dir), data_dir, expected, "prepare it again")


def test_a_token_id_beyond_the_vocab_names_the_file_and_the_id(data_dir):
    tokens = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    tokens[len(tokens) // 2] = 65_000  # the same size: only the scan can tell
    tokens.tofile(data_dir / "val.bin")
    os.utime(data_dir / "val.bin", ns=(2_000_000_000, 2_000_000_000))
    meta = load_meta(data_dir)
    assert meta["scan"]["val"]["max_token_id"] == meta["max_token_id"] == 65_000
    assert_refused(lambda: check_vocab(meta, 32_000, data_dir), data_dir,
            f"data.dir {str(data_dir)!r}: val.bin holds token id 65000 >= the model's vocab_size 32000 (a GPU "
            f"run would stop with a device-side assert); prepare the data with the model's tokenizer or raise "
            f"model.config.vocab_size")
    check_vocab(meta, 65_001, data_dir)
    check_vocab(meta, None, data_dir)


def test_the_scan_is_recorded_once_per_file_version(data_dir):
    meta_path = data_dir / "meta.json"

    def state() -> tuple[int, int, bytes]:
        st = meta_path.stat()
        return st.st_ino, st.st_mtime_ns, meta_path.read_bytes()

    prepared_state = state()
    first = load_meta(data_dir)  # prepare recorded the scan: nothing to write
    assert state() == prepared_state
    raw = json.loads(meta_path.read_text())
    del raw["scan"]  # as an older prepare wrote it
    meta_path.write_text(json.dumps(raw))
    assert load_meta(data_dir) == first  # scanned and recorded
    recorded = state()
    assert "scan" in json.loads(recorded[2])
    assert load_meta(data_dir) == first
    assert state() == recorded  # not scanned or written again
    tokens = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    tokens[0] = first["max_token_id"] + 1  # a rewritten train.bin: rescanned
    tokens.tofile(data_dir / "train.bin")
    os.utime(data_dir / "train.bin", ns=(3_000_000_000, 3_000_000_000))
    again = load_meta(data_dir)
    assert again["max_token_id"] == again["scan"]["train"]["max_token_id"] == first["max_token_id"] + 1
    assert json.loads(meta_path.read_text())["scan"]["train"]["mtime_ns"] == 3_000_000_000


def test_a_read_only_data_dir_is_scanned_without_recording(data_dir, monkeypatch):
    """A data dir this user cannot write (os.access says so; root would write through a chmod, so
    the answer is given here) is scanned on each load and left as it is."""
    import ds_train.data.meta as data_module

    raw = json.loads((data_dir / "meta.json").read_text())
    del raw["scan"]
    (data_dir / "meta.json").write_text(json.dumps(raw))
    before = listing(data_dir)
    real_access = os.access
    monkeypatch.setattr(data_module.os, "access",
                        lambda path, mode: False if Path(path) == data_dir else real_access(path, mode))
    assert load_meta(data_dir)["max_token_id"] == raw["max_token_id"]
    assert listing(data_dir) == before


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
    whole = sample_ids(rank_micro_batches(d, step, global_batch, micro, data_rank=0, data_parallel=1))
    r0 = sample_ids(rank_micro_batches(d, step, global_batch, micro, data_rank=0, data_parallel=2))
    r1 = sample_ids(rank_micro_batches(d, step, global_batch, micro, data_rank=1, data_parallel=2))
    assert len(whole) == global_batch and len(r0) == len(r1) == global_batch // 2
    assert not set(r0) & set(r1)
    assert r0 + r1 == whole
    r = [sample_ids(rank_micro_batches(d, step, global_batch, 1, data_rank=k, data_parallel=4)) for k in range(4)]
    assert sum(r, []) == whole  # micro 1 x accum 2 x world 4: the same global batch again


def test_micro_batch_shapes(bin_path):
    batches = rank_micro_batches(data(bin_path), 3, global_batch=16, micro=2, data_rank=1, data_parallel=2)
    assert len(batches) == 4  # 16 / 2 ranks / micro 2 = 4 accumulation steps
    assert all(b.shape == (2, SEQ + 1) and b.dtype == np.int64 for b in batches)


def test_same_seed_and_step_give_the_same_batch(bin_path):
    a = rank_micro_batches(data(bin_path, seed=7), 11, 8, 2, data_rank=1, data_parallel=2)
    fresh = data(bin_path, seed=7)  # a resumed process: new object, no warm permutation cache
    rank_micro_batches(fresh, 70, 8, 2, data_rank=0, data_parallel=2)  # visit another epoch first
    b = rank_micro_batches(fresh, 11, 8, 2, data_rank=1, data_parallel=2)
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
    a = eval_micro_batches(d1, batches=3, micro=2, data_rank=1, data_parallel=2)
    b = eval_micro_batches(d2, batches=3, micro=2, data_rank=1, data_parallel=2)
    assert len(a) == 3 and all(x.shape == (2, SEQ + 1) for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # seed plays no part
    r0 = sample_ids(eval_micro_batches(d1, 3, 2, data_rank=0, data_parallel=2))
    r1 = sample_ids(eval_micro_batches(d1, 3, 2, data_rank=1, data_parallel=2))
    assert not set(r0) & set(r1)
    assert sorted(r0 + r1) == list(range(12))


def test_eval_wraps_around_a_small_val_set(tmp_path):
    path = tmp_path / "val.bin"
    np.arange(3 * SEQ + 1, dtype=np.uint16).tofile(path)  # 3 windows
    d = TokenData(path, "uint16", SEQ, 0)
    ids = sample_ids(eval_micro_batches(d, batches=2, micro=2, data_rank=0, data_parallel=1))
    assert ids == [0, 1, 2, 0]


def test_too_few_tokens_is_a_user_error(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(SEQ, dtype=np.uint16).tofile(path)
    with pytest.raises(UserError, match="fewer than train.seq_len"):
        TokenData(path, "uint16", SEQ, 0)


def _prepare_in_child(args):
    from ds_train.data.prepare import ensure_prepared

    data_dir, src = args
    return ensure_prepared(data_config(data_dir, [src], val_fraction=0.3))["train_tokens"]


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


# --- bad input: one line naming the file and the fix, nothing written -----------------------------

ELF = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4  # what a compiled program starts like


def test_a_binary_file_in_a_source_directory_names_it_and_the_fix(corpus, tmp_path):
    (corpus / "a.out.d").mkdir()
    (corpus / "a.out.d" / "prog").write_bytes(ELF)  # no suffix: read, as README or Makefile would be
    with pytest.raises(UserError) as e:
        prepare([str(corpus)], tmp_path / "out", vocab_size=300)
    assert str(e.value) == (f"data.sources: '{corpus / 'a.out.d' / 'prog'}' is not UTF-8 text (a NUL byte at "
                            f"offset 7: a binary file?); remove it from '{corpus}', or list only its text files "
                            f"in data.sources")
    assert not (tmp_path / "out").exists()


def test_a_binary_file_named_as_a_source_names_it_and_the_fix(tmp_path):
    path = tmp_path / "random.txt"
    path.write_bytes(b"text, then \xff\xfe\xfa")
    with pytest.raises(UserError) as e:
        prepare([str(path)], tmp_path / "out", vocab_size=300)
    assert str(e.value) == (f"data.sources: '{path}' is not UTF-8 text (byte 0xff at offset 11 is not UTF-8: "
                            f"a binary file?); convert it to UTF-8 or remove it from data.sources")
    assert not (tmp_path / "out").exists()


def test_a_source_directory_skips_hidden_files_and_reads_a_named_file_whatever_its_suffix(corpus, tmp_path):
    (corpus / ".git" / "objects").mkdir(parents=True)
    (corpus / ".git" / "objects" / "ab12").write_bytes(ELF)
    (corpus / ".DS_Store").write_bytes(ELF)
    (corpus / "image.png").write_bytes(ELF)  # not a text suffix: not read
    (tmp_path / "notes.data").write_text("a,b\n1,2\n" * 40)
    meta = prepare([str(corpus), str(tmp_path / "notes.data")], tmp_path / "out", vocab_size=300)
    assert meta["train_documents"] + meta["val_documents"] == len(CORPUS) + 1
    assert sorted(meta["fingerprint"]["sources"][0]["files"]) == sorted(CORPUS)


def test_a_small_corpus_notes_the_smaller_vocabulary_on_stdout(corpus, tmp_path, capsys):
    meta = prepare([str(corpus)], tmp_path / "out", vocab_size=4096, val_fraction=0.5)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"note: the BPE trained on {meta['train_documents']} document(s) has {meta['vocab_size']} "
                   f"tokens, fewer than the 4096 asked for (data.vocab_size, --vocab-size): the corpus has no "
                   f"more merges to learn; a model built from this data gets vocab_size {meta['vocab_size']}"]


@pytest.mark.parametrize("make, expected", [
    (lambda src: None, "data.sources[0]: '{src}' does not exist; correct the path or remove it from data.sources"),
    (lambda src: src.mkdir(), "data.sources[0]: '{src}' holds no documents (a directory source reads files named "
                              "*.arrow, *.c, *.csv, *.h, *.json, *.jsonl, *.jsonl.gz, *.md, *.parquet, *.py, *.rst, "
                              "*.toml, *.txt, *.yaml, *.yml or without a suffix; hidden files and directories are "
                              "skipped); remove it from data.sources or add files"),
    (lambda src: src.write_text("  \n"), "data.sources: ['{src}'] hold no text documents (every file or record "
                                         "is empty); add text to them or name other sources"),
])
def test_missing_or_empty_sources_are_refused_before_data_dir_is_made(make, expected, tmp_path):
    src = tmp_path / "src"
    make(src)
    with pytest.raises(UserError) as e:
        ensure(tmp_path / "data", [src])
    assert str(e.value) == expected.format(src=src)
    assert not (tmp_path / "data").exists()  # no empty data.dir holding a .prepare.lock


def test_a_data_dir_that_is_a_file(corpus, tmp_path):
    (tmp_path / "data").write_text("x")
    for call in (lambda: ensure(tmp_path / "data", [corpus]), lambda: load_meta(tmp_path / "data")):
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value) == (f"data.dir: '{tmp_path / 'data'}' is a file, not a directory; point data.dir at "
                                f"the directory that holds (or will hold) train.bin, val.bin and meta.json")
    with pytest.raises(UserError) as e:
        ensure(tmp_path / "data" / "sub", [corpus])
    assert str(e.value) == (f"data.dir: '{tmp_path / 'data' / 'sub'}' cannot be created: '{tmp_path / 'data'}' "
                            f"cannot be a directory: '{tmp_path / 'data'}' is a file; choose another data.dir")
    assert (tmp_path / "data").read_text() == "x"


def test_a_read_only_data_dir_that_must_be_prepared_again_is_one_line(corpus, tmp_path):
    data_dir = tmp_path / "data"
    ensure(data_dir, [corpus])
    cfg = write_config(tmp_path / "c.yaml", tiny_config(data_dir, tmp_path / "run", data={
        "sources": [str(corpus)], "vocab_size": 320, "reprepare": True}))
    before = tree_listing(tmp_path)
    readonly = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount --bind {data_dir} {data_dir} && mount -o remount,ro,bind {data_dir} && exec "$0" "$@"']
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")],
                 f"data.dir: '{data_dir}' is on a read-only file system ('{data_dir}'); choose a writable data.dir",
                 wrap=readonly)
    assert tree_listing(tmp_path) == before


def test_a_damaged_tokenizer_of_the_data_dir_names_the_file_and_reprepare_repairs_it(corpus, tmp_path):
    data_dir = tmp_path / "data"
    meta = ensure(data_dir, [corpus])
    (data_dir / "tokenizer" / "tokenizer.json").write_text("garbage")
    expected = (f"tokenizer: '{data_dir / 'tokenizer' / 'tokenizer.json'}' is not valid JSON (line 1, column 1: "
                f"Expecting value); it is the tokenizer `ds-train prepare` trained into '{data_dir}': prepare "
                f"that directory again (data.reprepare=true with data.sources, or `ds-train prepare --overwrite`)")
    for call in (lambda: ensure(data_dir, [corpus]), lambda: ensure(data_dir, []),
                 lambda: load_tokenizer(data_dir / "tokenizer")):
        assert assert_refused(call, data_dir) == expected
    again = ensure(data_dir, [corpus], reprepare=True)
    assert len(load_tokenizer(again["tokenizer"])) == meta["vocab_size"]
    assert again["train_tokens"] == meta["train_tokens"]


def test_a_model_tokenizer_that_cannot_load_names_it_and_the_fix_in_full(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")  # JSON, but not a tokenizer
    with pytest.raises(UserError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == (f"tokenizer: cannot load '{tmp_path}' (KeyError: 'added_tokens'); re-export or "
                            f"re-download the model directory")
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(UserError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == (f"tokenizer: '{tmp_path / 'tokenizer_config.json'}' is not a JSON object; re-export "
                            f"or re-download the model directory")


@pytest.mark.parametrize("field, value, valid", [
    ("train_tokens", "many", "a token count (an integer >= 0)"),
    ("val_tokens", -1, "a token count (an integer >= 0)"),
    ("vocab_size", 4.5, "a positive integer"),
    ("tokenizer", None, "a directory name"),
    ("scan", [], "a mapping"),
])
def test_meta_json_fields_of_the_wrong_type_name_the_field_and_the_fix(data_dir, field, value, valid):
    meta = json.loads((data_dir / "meta.json").read_text())
    (data_dir / "meta.json").write_text(json.dumps({**meta, field: value}))
    message = assert_refused(lambda: load_meta(data_dir), data_dir)
    assert message == (f"{data_dir / 'meta.json'}: {field!r} is {value!r}, not {valid}; prepare it again "
                       f"(data.reprepare=true with data.sources, or `ds-train prepare --overwrite`)")


def test_reprepare_repairs_a_damaged_meta_json(corpus, tmp_path):
    data_dir = tmp_path / "data"
    meta = ensure(data_dir, [corpus])
    (data_dir / "meta.json").write_text(json.dumps({**meta, "train_tokens": "many"}))
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, "'train_tokens' is 'many'")
    assert ensure(data_dir, [corpus], reprepare=True)["train_tokens"] == meta["train_tokens"]
    (data_dir / "meta.json").write_text(json.dumps({**meta, "fingerprint": {"version": 1}}))
    assert_refused(lambda: ensure(data_dir, [corpus]), data_dir, "meta.json's record of its inputs is damaged",
            "data.reprepare=true")


def test_prepare_refuses_a_directory_holding_prepared_data_unless_overwrite(corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare([str(corpus)], out, vocab_size=300)
    (corpus / "doc0.txt").write_text("other text " * 50)
    message = assert_refused(lambda: prepare([str(corpus)], out, vocab_size=300), out)
    assert message == (f"prepare: '{out}' already holds prepared data (meta.json, train.bin, val.bin, tokenizer); "
                       f"give another --out (data.dir), or --overwrite to replace it")
    again = prepare([str(corpus)], out, vocab_size=300, overwrite=True)
    assert again["fingerprint"] != first["fingerprint"]


def test_a_bad_record_late_in_a_source_leaves_no_data_dir(tmp_path):
    """Every document is read before data.dir (or its lock file) is made."""
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i} " * 20}) + "\n" for i in range(50)) + "{oops\n")
    with pytest.raises(UserError, match=f"^{path}:51: expected a JSON object with a string 'text' field"):
        ensure(tmp_path / "data", [path])
    assert not (tmp_path / "data").exists()


def test_a_tokenizer_that_cannot_load_leaves_no_data_dir(corpus, tmp_path):
    with pytest.raises(UserError) as e:
        ensure(tmp_path / "data", [corpus], tokenizer=tmp_path / "nope")
    assert str(e.value) == (f"tokenizer: '{tmp_path / 'nope'}' is not a directory; point data.tokenizer (or "
                            f"model.path) at a tokenizer directory")
    assert not (tmp_path / "data").exists()


# --- sources at scale: formats, workers, mixtures -------------------------------------------------

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(60)]


def _docs_of(out: Path) -> list[str]:
    """Every document prepared into `out` (train and val), decoded, sorted."""
    meta = load_meta(out)
    tok = load_tokenizer(meta["tokenizer"])
    docs = []
    for split in ("train", "val"):
        docs += [tok.decode(d) for d in split_docs(out / f"{split}.bin", meta["dtype"], meta["eos_token_id"])]
    return sorted(docs)


def test_parquet_jsonl_gz_a_datasets_directory_and_csv_prepare_the_same_documents(prepared, tmp_path):
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": t, "n": i} for i, t in enumerate(DOCS)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "docs.parquet", row_group_size=16)
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "docs.csv"))
    tokenizer = load_meta(prepared[0])["tokenizer"]
    seen = {}
    for name in ("docs.parquet", "docs.jsonl.gz", "saved", "docs.csv"):
        meta = prepare([str(tmp_path / name)], tmp_path / f"out-{name}", tokenizer, val_fraction=0.2)
        assert meta["train_documents"] + meta["val_documents"] == len(DOCS)
        seen[name] = _docs_of(tmp_path / f"out-{name}")
    assert all(docs == sorted(DOCS) for docs in seen.values())


@pytest.mark.parametrize("make, said", [
    (lambda p: __import__("pyarrow.parquet").parquet.write_table(
        __import__("pyarrow").table({"body": ["a", "b"]}), p / "t.parquet"),
     "{p}/t.parquet: no column 'text' (columns: body); set data.text_key to the text column"),
    (lambda p: __import__("pyarrow.parquet").parquet.write_table(
        __import__("pyarrow").table({"text": ["a", None, "c"]}), p / "t.parquet"),
     "{p}/t.parquet row 1: expected a string in the 'text' field (set data.text_key)"),
    (lambda p: (p / "t.jsonl.gz").write_bytes(b"not gzip at all"),
     "{p}/t.jsonl.gz: cannot be read after line 0 (Not a gzipped file (b'no')); replace the file or remove it "
     "from data.sources"),
    (lambda p: (p / "t.parquet").write_bytes(b"PAR1 but not really"),
     "{p}/t.parquet: cannot be read as parquet (ArrowInvalid:"),
])
def test_a_bad_table_or_archive_names_the_file_row_and_field_and_leaves_nothing(make, said, tmp_path):
    make(tmp_path)
    source = next(p for p in tmp_path.iterdir())
    with pytest.raises(UserError) as e:
        ensure(tmp_path / "data", [source])
    assert str(e.value).startswith(said.format(p=tmp_path))
    assert not (tmp_path / "data").exists()


CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def _conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i} plus {i % 5}?"},
                    {"role": "assistant", "content": f"It is {i + i % 5}." + " Indeed." * (i % 4)}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "Twice?"}, {"role": "assistant", "content": f"{2 * (i + i % 5)}."}]
        out.append({"messages": messages} if i % 2 else {"prompt": messages[0]["content"],
                                                          "completion": messages[1]["content"]})
    return out


@pytest.mark.parametrize("bad, said", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "{f}:3: no assistant turn (roles: user)"),
    ({"messages": [{"role": "human", "content": "hi"}]}, "{f}:3: messages[0].role is 'human', not one of"),
    ({"question": "hi"}, "{f}:3: no 'messages' field"),
])
def test_bad_sft_records_name_the_file_the_line_and_the_field(bad, said, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*_conversations(2), bad, *_conversations(3)]))
    with pytest.raises(UserError) as e:
        ensure(tmp_path / "data", [path], format="sft", chat_template=CHAT_TEMPLATE)
    assert str(e.value).startswith(said.format(f=path))
    assert not (tmp_path / "data").exists()


def test_sft_in_a_parquet_without_the_conversation_columns_is_refused_by_name(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "chat.parquet")
    with pytest.raises(UserError) as e:
        ensure(tmp_path / "data", [tmp_path / "chat.parquet"], format="sft", chat_template=CHAT_TEMPLATE)
    assert str(e.value) == (f"{tmp_path / 'chat.parquet'}: no a 'messages' column, or 'prompt' and 'completion' "
                            f"(columns: text); data.format sft reads conversations from those")


def _tree(out: Path) -> dict[str, bytes]:
    meta = json.loads((out / "meta.json").read_text())
    for key in ("fingerprint", "scan"):
        meta.pop(key)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "meta.json"}
    return files | {"meta": json.dumps(meta, sort_keys=True).encode(),
                    "tokenizer": (out / "tokenizer" / "tokenizer.json").read_bytes()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_and_two_workers_write_identical_data_text_and_sft(tmp_path, monkeypatch):
    """Many small chunks, so both workers tokenise and their results interleave."""
    import ds_train.data.sources

    monkeypatch.setattr(ds_train.data.sources, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(ds_train.data.sources, "CHUNK_ROWS", 16)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS * 3))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(90)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": t} for t in DOCS]), tmp_path / "more.parquet")
    text = [str(tmp_path / "docs.jsonl"), str(tmp_path / "more.parquet")]
    for fmt, sources, extra in (("text", text, {}), ("sft", [str(tmp_path / "chat.jsonl")],
                                                     {"chat_template": CHAT_TEMPLATE})):
        trees = [_tree(Path(prepare(sources, tmp_path / f"{fmt}{w}", vocab_size=300, val_fraction=0.1, fmt=fmt,
                                    workers=w, **extra) and tmp_path / f"{fmt}{w}")) for w in (1, 2)]
        assert trees[0] == trees[1], fmt
        assert not [p for p in (tmp_path / f"{fmt}2").iterdir() if ".partial" in p.name]
    assert json.loads(trees[0]["meta"])["format"] == "sft"


def test_an_interrupted_prepare_leaves_nothing_that_looks_prepared_and_the_old_data_whole(corpus, tmp_path,
                                                                                         monkeypatch):
    import ds_train.data.encode

    out = tmp_path / "out"
    prepare([str(corpus)], out, vocab_size=300)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    calls = []

    def interrupted(self, part):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(ds_train.data.encode.SplitWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], out, vocab_size=300, overwrite=True)
    assert calls and {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not [p for p in out.iterdir() if "partial" in p.name]


def test_the_bpe_learns_from_a_bounded_sample_of_each_source(tmp_path, monkeypatch):
    import ds_train.data.encode

    monkeypatch.setattr(ds_train.data.encode, "BPE_SAMPLE_BYTES", 2000)
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {t}"}) + "\n" for t in DOCS))
    sample = ds_train.data.encode.bpe_sample([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], ("text",), "text",
                                       "", 0.0)
    for name in ("a", "b"):  # each source's first ~1000 characters, then one document more at most
        taken = [t for t in sample if t.startswith(name)]
        assert taken and 1000 <= sum(map(len, taken)) < 1000 + max(map(len, DOCS)) + 2


def test_a_mixture_draws_each_source_by_its_weight_and_never_across_sources(tmp_path):
    for name, n in (("big", 50), ("small", 10)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} " + t}) + "\n"
                                                        for t in DOCS[:n]))
    sources = [str(tmp_path / "big.jsonl"), str(tmp_path / "small.jsonl")]
    meta = prepare(sources, tmp_path / "out", vocab_size=300, val_fraction=0.1)
    (a0, a1), (b0, b1) = meta["source_ranges"]
    assert a0 == 0 and a1 == b0 and b1 == meta["train_tokens"]
    data = TokenData(tmp_path / "out" / "train.bin", meta["dtype"], 16, 3, meta["source_ranges"], [1, 3], sources)
    starts = [data.start(g) for g in range(4000)]
    from_small = sum(b0 <= s for s in starts)
    assert from_small == 3000  # 750 of each 1000-slot cycle, exactly
    assert all(s + 17 <= a1 if s < b0 else s + 17 <= b1 for s in starts)  # windows stay inside a source
    again = TokenData(tmp_path / "out" / "train.bin", meta["dtype"], 16, 3, meta["source_ranges"], [1, 3], sources)
    assert [again.start(g) for g in range(3990, 4000)] == starts[3990:]  # a pure function of (seed, g)
    small = [s for s in starts if s >= b0][:data.mix[1][1]]  # the small source's first epoch: each window once
    assert len(set(small)) == len(small) == data.mix[1][1]
    with pytest.raises(UserError, match="^data.weights: source 'x' has"):
        TokenData(tmp_path / "out" / "train.bin", meta["dtype"], 16, 3, [[0, 10], [10, 20]], [1, 1], ["x", "y"])


# --- sft data: packing, targets, sharding -------------------------------------------------------

@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sft")
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(120)))
    prepare([str(tmp / "chat.jsonl")], tmp / "out", vocab_size=320, val_fraction=0.1, fmt="sft",
            chat_template=CHAT_TEMPLATE)
    return tmp / "out"


def test_sft_sequences_hold_whole_examples_with_targets_on_the_assistant_tokens_only(sft_dir):
    from ds_train.data.datasets import SftData
    from ds_train.data.examples import IGNORE

    meta = load_meta(sft_dir)
    data = SftData(sft_dir, "train", meta["dtype"], 96, 0, True, "drop", meta["eos_token_id"])
    mask = np.fromfile(sft_dir / "train.mask", np.uint8)
    tokens = np.fromfile(sft_dir / "train.bin", meta["dtype"])
    offsets = np.fromfile(sft_dir / "train.idx", np.int64)
    assert meta["train_targets"] == int(mask.sum()) and len(offsets) == meta["train_documents"] + 1
    assert sorted(data.order.tolist()) == list(range(meta["train_documents"]))  # every example, once
    assert data.fill > 0.7
    for s in range(data.num_samples):
        inputs, targets, positions = data.window(s, shuffle=False)
        assert ((targets == IGNORE) | ((0 <= targets) & (targets < meta["vocab_size"]))).all()
        starts = np.flatnonzero(positions == 0)
        for a, b in zip(starts, [*starts[1:], 96]):
            e = next((e for e in data.order if np.array_equal(tokens[offsets[e]:offsets[e + 1]], inputs[a:b])), None)
            if e is None:  # the padding after the last example
                assert (targets[a:b] == IGNORE).all() and (inputs[a:b] == meta["eos_token_id"]).all()
                continue
            o = offsets[e]
            want = np.where(mask[o + 1:o + b - a] > 0, tokens[o + 1:o + b - a].astype(np.int64), IGNORE)
            assert np.array_equal(targets[a:b - 1], want) and targets[b - 1] == IGNORE


def test_sft_batches_shard_a_global_batch_alike_at_any_world_size(sft_dir):
    from ds_train.data.datasets import SftData

    meta = load_meta(sft_dir)
    data = SftData(sft_dir, "train", meta["dtype"], 40, 5, True, "truncate", meta["eos_token_id"])
    whole = rank_micro_batches(data, 3, 8, 8, 0, 1)[0]
    parts = [b for r in range(4) for b in rank_micro_batches(data, 3, 8, 2, r, 4)]
    for field in ("inputs", "targets", "positions"):
        assert np.array_equal(getattr(whole, field), np.concatenate([getattr(p, field) for p in parts]))
    padded = SftData(sft_dir, "train", meta["dtype"], 40, 5, False, "drop", meta["eos_token_id"])
    assert padded.batch(0, 2).positions is None and padded.num_samples < meta["train_documents"]
    assert "dropped (data.overlong)" in padded.summary() and "truncated" in data.summary()


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_packed_example_gets_the_same_logits_as_alone(sft_dir, model_type):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.data.datasets import SftData
    from ds_train.model.build import supports_packing

    meta = load_meta(sft_dir)
    small = {"llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2),
             "gpt2": dict(n_embd=64, n_layer=2, n_head=4)}[model_type]
    cfg = AutoConfig.for_model(model_type, vocab_size=meta["vocab_size"], **small)
    assert supports_packing(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    data = SftData(sft_dir, "train", meta["dtype"], 128, 0, True, "drop", meta["eos_token_id"])
    inputs, _, positions = data.window(0, shuffle=False)
    starts = np.flatnonzero(positions == 0)
    assert len(starts) >= 3  # two examples or more, and padding
    with torch.no_grad():
        packed = model(input_ids=torch.from_numpy(inputs)[None], position_ids=torch.from_numpy(positions)[None],
                       use_cache=False).logits[0]
        for a, b in zip(starts[:-1], starts[1:]):
            alone = model(input_ids=torch.from_numpy(inputs[a:b])[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[a:b], alone, atol=1e-5, rtol=1e-4)


def test_a_sequence_rank_holds_its_part_of_every_sequence_with_targets_shifted_before_the_split():
    import numpy as np

    from ds_train.data.datasets import sequence_shard
    from ds_train.data.examples import Batch

    windows = np.arange(2 * 9).reshape(2, 9)  # two windows of seq_len 8 + 1
    assert sequence_shard(windows, 0, 1) is windows
    parts = [sequence_shard(windows, r, 4) for r in range(4)]
    assert [p.inputs.tolist() for p in parts[:2]] == [[[0, 1], [9, 10]], [[2, 3], [11, 12]]]
    assert parts[1].targets.tolist() == [[3, 4], [12, 13]]  # the last target of a part: the next part's first input
    assert parts[3].positions.tolist() == [[6, 7], [6, 7]]  # the sequence's own positions, not the part's
    assert np.concatenate([p.inputs for p in parts], 1).tolist() == windows[:, :-1].tolist()
    assert np.concatenate([p.targets for p in parts], 1).tolist() == windows[:, 1:].tolist()
    assert sum(p.n_targets for p in parts) == 16
    sft = Batch(np.arange(8).reshape(1, 8), np.array([[-100, -100, 5, 6, -100, 8, 9, -100]]),
                np.array([[0, 1, 2, 3, 0, 1, 2, 3]]))
    halves = [sequence_shard(sft, r, 2) for r in range(2)]
    assert [h.n_targets for h in halves] == [2, 2] and halves[1].positions.tolist() == [[0, 1, 2, 3]]
    assert all(h.inputs.flags["C_CONTIGUOUS"] for h in halves)


def test_a_file_name_that_is_not_utf8_is_one_line_naming_it_with_escapes(tmp_path):
    """The OS gives file names as bytes: a corpus directory holding b'caf\\xe9.txt' (Latin-1) is refused
    in one line naming the key and the name with escapes (before: a UnicodeEncodeError traceback in
    prepare); `ds-train prepare` says it and exits 2."""
    import os

    from conftest import expect_error
    from ds_train.data.sources import check_source_files

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("hello")
    with open(os.path.join(os.fsencode(corpus), b"caf\xe9.txt"), "wb") as f:
        f.write(b"hello again")
    with pytest.raises(UserError) as e:
        check_source_files([str(corpus)])
    assert str(e.value).startswith(f"data.sources[0]: {str(corpus)!r} holds a file whose name is not UTF-8 "
                                   f"('caf\\xe9.txt'); rename it")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\n"
                   f"data: {{dir: {tmp_path / 'data'}, sources: [{corpus}]}}\n")
    expect_error(["prepare", "--config", str(cfg)], "holds a file whose name is not UTF-8 ('caf\\xe9.txt')")
    assert not (tmp_path / "data").exists()
