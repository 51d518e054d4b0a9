"""Data-driven RL tasks (ds_train/ript/datatask.py) and the verifiers (ds_train/ript/verifiers.py):
each verifier by hand, a JSONL dataset rendered with a chat template and split by hash, and bad
input as one line naming the file, the row and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_train.errors import UserError
from ds_train.ript.datatask import DatasetTask, default_stops, entry_options, is_dataset_entry
from ds_train.ript.verifiers import build_verifier, last_boxed, last_number

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_each_verifier_by_hand():
    exact = build_verifier("exact")
    assert exact(" 42\n", "42") == 1.0 and exact("42 apples", "42") == 0.0 and exact("b", ["a", "b"]) == 1.0
    numeric = build_verifier("numeric", tolerance=1e-6)
    assert last_number("so 3 + 4 = 7.") == 7.0 and last_number("#### 1,234") == 1234.0 and last_number("no") is None
    assert numeric("First 3, then 12.", 12) == 1.0 and numeric("12.0000001", "12") == 1.0
    assert numeric("12.1", "12") == 0.0 and numeric("The answer is 0.5", "1/2") == 1.0 and numeric("", 3) == 0.0
    regex = build_verifier("regex", pattern=r"answer: (\w+)")
    assert regex("the answer: blue.", "blue") == 1.0 and regex("blue", "blue") == 0.0
    boxed = build_verifier("boxed")
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert boxed(r"\boxed{ 3 }", "3") == 1.0 and boxed(r"\boxed{3.0}", 3) == 1.0 and boxed("3", "3") == 0.0
    custom = build_verifier("test_datatask:half_credit")
    assert custom("anything", "x", {}) == 0.5


def half_credit(completion, answer, record):
    return 0.5


def test_unknown_verifiers_and_bad_options_are_one_line():
    with pytest.raises(UserError, match=r"ript.tasks\[1\].verifier: 'fuzzy' is not a verifier; use one of exact, "
                                        r"numeric, regex, boxed or module:function"):
        entry_options({"data": "a.jsonl", "verifier": "fuzzy"}, "ript.tasks[1]")
    with pytest.raises(UserError, match="ript.tasks\\[0\\].verifier: regex needs a pattern"):
        entry_options({"data": "a.jsonl", "verifier": "regex"}, "ript.tasks[0]")
    with pytest.raises(UserError, match="cannot load 'no_such_module:f'"):
        entry_options({"data": "a.jsonl", "verifier": "no_such_module:f"}, "ript.tasks[0]")
    with pytest.raises(UserError) as e:
        entry_options({"data": "a.jsonl", "verifer": "exact", "heldout_fraction": 1.5}, "ript.tasks[2]")
    assert str(e.value) == ("ript.tasks[2].verifer: unknown key (did you mean 'verifier'?); ript.tasks[2]."
                            "heldout_fraction: 1.5 must be a number between 0 and 1")
    assert entry_options("data/gsm.jsonl", "ript.tasks[0]")["name"] == "gsm"
    assert is_dataset_entry("data/x.parquet") and is_dataset_entry({"data": "x"}) and not is_dataset_entry("add")
    assert not is_dataset_entry("my_pkg.tasks:Grid")


@pytest.fixture()
def tokenizer(tiny_policy):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_policy)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def task_of(path, tokenizer, template=TEMPLATE, **options) -> DatasetTask:
    opts = entry_options({"data": [str(path)], **options}, "ript.tasks[0]")
    return DatasetTask(opts, tokenizer, template, 12, 128, "ript.tasks[0]")


def test_a_jsonl_dataset_is_rendered_with_the_template_split_by_hash_and_verified(tokenizer, tmp_path):
    records = [{"prompt": f"max {n:04d} =", "answer": max(f"{n:04d}")} for n in range(0, 4000, 37)]
    task = task_of(write_jsonl(tmp_path / "max.jsonl", records), tokenizer, stop=["\n"], name="maxdata")
    train, held = task.contexts("train", 1000, 1), task.contexts("heldout", 1000, 1)
    assert len(train) + len(held) == len(records) and 0 < len(held) < len(train) / 3
    assert not {p.ids for p in train} & {p.ids for p in held}
    assert task.contexts("train", 5, 1) == task.contexts("train", 5, 1) != task.contexts("train", 5, 2)
    first = train[0]
    assert first.ids[0] == tokenizer.bos_token_id and task.reset(first).endswith(first.record["prompt"])
    assert first.where.startswith(str(tmp_path / "max.jsonl") + ":")
    right = f" {first.answer}\n more text"
    assert task.step(first, 0, right).success and task.step(first, 0, right).reward == 1.0  # cut at the stop
    assert not task.step(first, 0, " x\n").success and task.step(first, 0, " x\n").reward == 0.0
    # the same split on every seed and rank: a hash of the prompt
    again = task_of(tmp_path / "max.jsonl", tokenizer, stop=["\n"])
    assert {p.ids for p in again.contexts("heldout", 1000, 9)} == {p.ids for p in held}


def test_parquet_and_datasets_directories_are_read_as_jsonl_is(tokenizer, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"question": [f"q{i} =" for i in range(60)], "answer": [str(i) for i in range(60)]}
    pq.write_table(pa.table(rows), tmp_path / "qa.parquet")
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "qa_dir"))
    write_jsonl(tmp_path / "qa.jsonl", [{"question": q, "answer": a} for q, a in zip(rows["question"], rows["answer"])])
    splits = []
    for source in ("qa.parquet", "qa_dir", "qa.jsonl"):
        task = task_of(tmp_path / source, tokenizer, prompt_key="question")
        splits.append({s: sorted((p.ids, p.answer) for p in task.splits[s]) for s in ("train", "heldout")})
    assert splits[0] == splits[1] == splits[2] and len(splits[0]["train"]) + len(splits[0]["heldout"]) == 60


def test_the_default_stop_is_the_templates_end_of_turn_and_eos(tokenizer, tmp_path):
    from ds_train.data.chat import Renderer

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert default_stops(tokenizer, Renderer(tokenizer, CHATML)) == ("<|im_end|>", tokenizer.eos_token)
    assert default_stops(tokenizer, Renderer(tokenizer, TEMPLATE)) == (tokenizer.eos_token,)
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "answer": "7", "id": i} for i in range(40)])
    task = task_of(path, tokenizer, CHATML, system="Be brief.", verifier="numeric")
    prompt = task.contexts("train", 1, 0)[0]
    assert task.reset(prompt).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq")
    assert task.reset(prompt).endswith("<|im_start|>assistant\n")
    assert task.step(prompt, 0, "it is 7<|im_end|>").success and not task.step(prompt, 0, "8<|im_end|> 7").success


def test_bad_dataset_input_names_the_file_the_row_and_the_field(tokenizer, tmp_path):
    good = [{"prompt": f"p{i}", "answer": str(i)} for i in range(30)]
    path = write_jsonl(tmp_path / "a.jsonl", [*good[:3], {"prompt": "p"}, *good[3:]])
    with pytest.raises(UserError) as e:
        task_of(path, tokenizer)
    assert str(e.value) == (f"{path}:4: no 'answer' field (ript.tasks[0]: answer_key); add it or set the key to "
                            f"the field that holds it")
    path = write_jsonl(tmp_path / "b.jsonl", [*good[:2], "not json", *good[2:]])
    with pytest.raises(UserError, match=f"{path}:3: not a JSON object"):
        task_of(path, tokenizer)
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(UserError, match=f"{path}:1: 'prompt' must be a string or a list of messages"):
        task_of(path, tokenizer)
    path = write_jsonl(tmp_path / "d.jsonl", good[:2])
    with pytest.raises(UserError, match=f"ript.tasks\\[0\\] \\(d\\): {path}: no heldout prompts \\(2 record\\(s\\), "
                                        f"heldout_fraction 0.1\\); add records or change heldout_fraction"):
        task_of(path, tokenizer)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "digits " * 100, "answer": "1"}])
    with pytest.raises(UserError, match=f"{path}:1: the prompt is \\d+ tokens, and with max_new_tokens 12 exceeds "
                                        f"the model's 128 positions"):
        task_of(path, tokenizer)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="notes.txt: a text file; a data-driven task reads records"):
        task_of(tmp_path / "notes.txt", tokenizer)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), tmp_path / "f.parquet")
    with pytest.raises(UserError, match="f.parquet: no column 'prompt'"):
        task_of(tmp_path / "f.parquet", tokenizer)
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(30)], "answer": [None] + ["1"] * 29}),
                   tmp_path / "g.parquet")
    with pytest.raises(UserError, match=f"{tmp_path / 'g.parquet'} row 0: no 'answer' field"):
        task_of(tmp_path / "g.parquet", tokenizer, prompt_key="question")
    # an answer no built-in verifier can compare (a mapping, a bool): refused by file and line
    path = write_jsonl(tmp_path / "i.jsonl", [*good[:3], {"prompt": "p", "answer": {"value": 3}}, *good[3:]])
    with pytest.raises(UserError) as e:
        task_of(path, tokenizer)
    assert str(e.value) == (f"{path}:4: 'answer' must be a string, a number or a list of them (the exact verifier "
                            f"compares it with the completion's text); got {{'value': 3}}")
    path = write_jsonl(tmp_path / "j.jsonl", [*good, {"prompt": "p", "answer": ["1", True]}])
    with pytest.raises(UserError, match=f"{path}:31: 'answer' must be a string, a number or a list of them"):
        task_of(path, tokenizer)
    # the key the user wrote, not data.sources: a missing file, a binary one, a damaged table
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError) as e:
        task_of(missing, tokenizer)
    assert str(e.value) == (f"ript.tasks[0].data[0]: {str(missing)!r} does not exist; correct the path or remove "
                            f"it from ript.tasks[0].data")
    (tmp_path / "h.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="cannot be read as parquet .*; replace it or remove it from "
                                        "ript.tasks\\[0\\].data$"):
        task_of(tmp_path / "h.parquet", tokenizer)


def test_a_dataset_is_split_over_the_data_parallel_ranks_and_counted_as_one_task(tokenizer, tmp_path):
    """One dataset on 3 ranks: 3 parts with disjoint prompts that together are the task's, each its
    share of a cap; their counts add up under the task's name."""
    from ds_train.ript.datatask import split_for_ranks
    from ds_train.ript.sampler import Tally
    from ds_train.ript.sharding import shard_tasks

    path = write_jsonl(tmp_path / "sums.jsonl", [{"prompt": f"add {i}+1 =", "answer": str(i + 1)} for i in range(90)])
    task = task_of(path, tokenizer)
    parts = split_for_ranks(task, 3)
    assert [p.name for p in parts] == ["sums#0", "sums#1", "sums#2"] and split_for_ranks(task, 1) == [task]
    for split in ("train", "heldout"):
        got = [p.contexts(split, 1000, 5) for p in parts]
        flat = [c.ids for g in got for c in g]
        assert sorted(flat) == sorted(c.ids for c in task.contexts(split, 1000, 5)) and len(set(flat)) == len(flat)
    assert [len(p.contexts("train", 10, 5)) for p in parts] == [4, 4, 4]  # ceil(10 / 3) each
    assert shard_tasks({p.name: 1.0 for p in parts}, 3) == [["sums#0"], ["sums#1"], ["sums#2"]]
    tally = Tally([p.name for p in parts] + ["add"])
    tally.add("sums#0", successes=1, rollouts=4, accepted=1, checked=1)
    tally.add("sums#2", successes=3, rollouts=4, accepted=1, checked=1)
    m = tally.metrics()
    assert m["task/sums/success_rate"] == 0.5 and m["task/sums/accepted"] == 2 and "task/sums#0/success_rate" not in m
