"""ds_train.data.fingerprint: the fingerprint of prepare's inputs and how it tells what changed (reading the
sources, and their errors, are exercised through prepare in test_data.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ds_train.data.fingerprint import fingerprint_differences, input_fingerprint


def test_fingerprint_hashes_only_files_whose_size_matches_and_mtime_does_not(tmp_path):
    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(f"{name} text\n")
    recorded = input_fingerprint([str(tmp_path)], "", 300, 0.5, "text")
    assert recorded["sources"][0]["files"]["a.txt"]["sha256"] == hashlib.sha256(b"a text\n").hexdigest()
    hashed = []

    def sha256(path: Path) -> str:
        hashed.append(path.name)
        return hashlib.sha256(path.read_bytes()).hexdigest()

    def differences() -> list[str]:
        return fingerprint_differences(recorded, input_fingerprint([str(tmp_path)], "", 300, 0.5, "text",
                                                                   hashed=False), sha256)

    assert differences() == [] and hashed == []
    os.utime(tmp_path / "a.txt", ns=(1, 1))
    (tmp_path / "b.txt").write_text("b much longer text\n")
    assert differences() == ["data.sources[0] " + repr(str(tmp_path)) + ": b.txt size 7 -> 19"]
    assert hashed == ["a.txt"]  # b.txt: the size alone says it changed; c.txt: untouched
    assert fingerprint_differences(None, recorded) == ["prepared without a record of its inputs"]


def test_fingerprint_of_stdlib_and_datasets_directory_sources(tmp_path):
    """A `datasets` directory is one source unit whose every file is fingerprinted; format and chat
    template are settings whose change is named."""
    import datasets

    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    recorded = input_fingerprint([str(tmp_path / "ds"), "python-stdlib"], "", 300, 0.5, "text")
    files = recorded["sources"][0]["files"]
    assert {"ds/dataset_info.json", "ds/state.json"} <= set(files) and any(f.endswith(".arrow") for f in files)
    assert recorded["sources"][1]["files"] and recorded["sources"][1]["python"]
    current = input_fingerprint([str(tmp_path / "ds"), "python-stdlib"], "", 300, 0.5, "text", "sft", "{{ x }}",
                                hashed=False)
    assert fingerprint_differences(recorded, current) == ["data.format 'text' -> 'sft'", "data.chat_template changed"]
    recorded["sources"][1]["python"] = "2.7.18"
    del recorded["format"]  # a record from before data.format: it was text
    assert fingerprint_differences(recorded, current)[0].startswith("data.sources[1] 'python-stdlib': "
                                                                     "Python 2.7.18 -> ")
