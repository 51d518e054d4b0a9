"""scripts/extensions_dir.sh: where test.sh and quickstart.sh let DeepSpeed JIT-build its CPU ops."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT


def test_the_extensions_dir_is_per_version_and_install_and_a_stale_build_lock_goes(tmp_path):
    def run():
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
        return subprocess.run(["bash", str(ROOT / "scripts" / "extensions_dir.sh")], capture_output=True, text=True,
                              env=env, timeout=60)

    res = run()
    assert res.returncode == 0, res.stderr
    import deepspeed  # the install whose op sources torch's build files name

    where = hashlib.sha256(os.path.realpath(Path(deepspeed.__file__).parent).encode()).hexdigest()[:8]
    key = (f"py{sys.version_info[0]}.{sys.version_info[1]}-torch{importlib.metadata.version('torch')}"
           f"-deepspeed{importlib.metadata.version('deepspeed')}-{where}")
    out = tmp_path / "ds_train" / "torch_extensions" / key
    assert res.stdout == f"{out}\n" and out.is_dir() and res.stderr == ""
    stale, building = out / "cpu_adam" / "lock", out / "deepspeed_shm_comm" / "lock"
    for lock in (stale, building):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - 16 * 60  # a build here takes minutes; a lock this old was left by a killed one
    os.utime(stale, (old, old))
    res = run()
    assert res.returncode == 0 and res.stdout == f"{out}\n", res.stderr
    assert not stale.exists() and building.exists()  # a build under way keeps its lock
    assert res.stderr == f"extensions: removed a stale build lock {stale}\n"


def test_the_shipped_word_problems_are_what_scripts_word_problems_writes_and_their_answers_are_right(tmp_path):
    """recipes/rl_sft.yaml and rl_demo.yaml read them: 300 solved conversations and 4,000 problems
    whose answer is the sum or difference the sentence tells."""
    import json
    import re

    subprocess.run([sys.executable, str(ROOT / "scripts" / "word_problems.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("word_problems_sft.jsonl", "word_problems.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "recipes" / "data" / name).read_bytes(), name
    rows = [json.loads(line) for line in (tmp_path / "word_problems.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (tmp_path / "word_problems_sft.jsonl").read_text().splitlines()]
    assert len(rows) == 4000 and len(sft) == 300
    pairs = [(r["prompt"], r["answer"]) for r in rows] + [(c["messages"][0]["content"], int(c["messages"][1]["content"]))
                                                          for c in sft]
    for prompt, answer in pairs:
        a, b = map(int, re.findall(r"\d+", prompt))
        minus = re.search(r"gives|took|lost", prompt)
        assert answer == (a - b if minus else a + b) and answer >= 0, prompt


def test_the_shipped_products_are_what_scripts_tool_problems_writes_and_their_calls_and_answers_are_right(tmp_path):
    """recipes/tool_sft.yaml and tool_demo.yaml read them: 300 conversations whose call multiplies the question's
    two numbers, whose tool result is the calculator's and whose answer is that result; 500 answered at once with
    the calculator offered, 100 with no tool; 4,000 problems whose answer is the product of the question's two
    numbers."""
    import json
    import re

    from ds_train.ript.environments import tool_schema
    from ds_train.ript.tools import calculator

    subprocess.run([sys.executable, str(ROOT / "scripts" / "tool_problems.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("products_sft.jsonl", "products.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "recipes" / "data" / name).read_bytes(), name
    rows = [json.loads(line) for line in (tmp_path / "products.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (tmp_path / "products_sft.jsonl").read_text().splitlines()]
    calls = [c for c in sft if len(c["messages"]) == 4]
    offered = [c for c in sft if len(c["messages"]) == 2 and "tools" in c]
    assert len(rows) == 4000 and (len(calls), len(offered), len(sft)) == (300, 500, 900)
    schema = [tool_schema(calculator, "calculator")]  # as ds-train ript renders the task's tools
    assert all(c["tools"] == schema for c in calls + offered)
    for prompt, answer in [(r["prompt"], r["answer"]) for r in rows] + [
            (c["messages"][0]["content"], c["messages"][-1]["content"]) for c in sft]:
        a, b = map(int, re.findall(r"\d+", prompt))
        assert answer in (a * b, f"The answer is {a * b}.") and {len(str(a)), len(str(b))} == {3, 2}, prompt
    for c in calls:
        a, b = map(int, re.findall(r"\d+", c["messages"][0]["content"]))
        expression = c["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
        assert sorted(map(int, expression.split(" * "))) == sorted((a, b))
        assert c["messages"][2] == {"role": "tool", "content": str(a * b)}


def test_the_shipped_all_calls_demonstrations_are_what_scripts_tool_sft_calls_writes_and_each_calls_the_tool(tmp_path):
    """recipes/tool_sft_calls.yaml reads them: 900 conversations, every one offered the calculator, calling it with
    the question's two numbers, given the calculator's result, answering with that result; none answered at once;
    the first start's 300 calls among them (the same demonstrator)."""
    import json
    import re

    from ds_train.ript.environments import tool_schema
    from ds_train.ript.tools import calculator

    subprocess.run([sys.executable, str(ROOT / "scripts" / "tool_sft_calls.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    shipped = ROOT / "recipes" / "data" / "products_sft_calls.jsonl"
    assert (tmp_path / "products_sft_calls.jsonl").read_bytes() == shipped.read_bytes()
    sft = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert len(sft) == 900 and all(c["tools"] == [tool_schema(calculator, "calculator")] for c in sft)
    for c in sft:
        user, call, result, last = c["messages"]
        a, b = map(int, re.findall(r"\d+", user["content"]))
        assert {len(str(a)), len(str(b))} == {3, 2} and (user["role"], call["role"], result["role"], last["role"]) == (
            "user", "assistant", "tool", "assistant")
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert call["content"] == "" and sorted(map(int, expression.split(" * "))) == sorted((a, b))
        assert result["content"] == calculator(expression) == str(a * b)
        assert last["content"] == f"The answer is {a * b}."
    first = [json.loads(line) for line in (ROOT / "recipes" / "data" / "products_sft.jsonl").read_text().splitlines()]
    calls = [c for c in first if len(c["messages"]) == 4]
    assert len(calls) == 300 and all(c in sft for c in calls)


def test_the_shipped_preference_pairs_are_what_their_script_writes_and_each_kind_prefers_as_it_says(tmp_path):
    """recipes/dpo.yaml and bench/dpo.py read them: 2,000 pairs of four kinds, no side the same as
    the other; a faithful greeting names the prompt's person, the rejected one someone else."""
    import json
    import re

    subprocess.run([sys.executable, str(ROOT / "scripts" / "preference_pairs.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    shipped = ROOT / "recipes" / "data" / "preference_pairs.jsonl"
    assert (tmp_path / "preference_pairs.jsonl").read_bytes() == shipped.read_bytes()
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert len(rows) == 2000 and all(r["chosen"] != r["rejected"] for r in rows)
    greetings = [r for r in rows if r["prompt"].startswith("Write a greeting for ")]
    assert 300 < len(greetings) < 700
    for r in greetings:
        name = re.match(r"Write a greeting for (\w+)", r["prompt"]).group(1)
        assert r["chosen"].endswith(f", {name}!") and not r["rejected"].endswith(f", {name}!")


def test_requirements_vllm_is_what_its_command_writes_from_the_recorded_index():
    """scripts/vllm_hashes.py reads PyPI; tests/fixtures/vllm_index.txt holds the wheels it read for the target
    (`python3 scripts/vllm_hashes.py --record tests/fixtures/vllm_index.txt`), so the choice of each file and the
    file's every byte are checked offline: a hand-edited pin or header fails here."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_hashes.py"), "--check",
                          "--index", str(ROOT / "tests" / "fixtures" / "vllm_index.txt")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_shipped_python_lines_are_what_their_script_writes_from_the_corpus_held_out_files(tmp_path):
    """recipes/lm_eval/python_lines.yaml reads them: 240 questions, each a held-out file's line (the quickstart
    corpus's val split) after the lines before it there, among three other distinct lines of that file."""
    import json
    import sysconfig

    from ds_train.config import DataConfig
    from ds_train.data.encode import _is_val

    subprocess.run([sys.executable, str(ROOT / "scripts" / "python_lines.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    shipped = ROOT / "recipes" / "data" / "python_lines.jsonl"
    assert (tmp_path / "python_lines.jsonl").read_bytes() == shipped.read_bytes()
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert len(rows) == 240 and len({r["source"] for r in rows}) >= 5
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for r in rows:
        assert _is_val(r["source"], DataConfig().val_fraction), r["source"]
        lines = (stdlib / r["source"]).read_text(encoding="utf-8", errors="replace").splitlines()
        gold = r["choices"][r["gold"]]
        assert lines[r["line"] - 1] == gold and r["context"].endswith("\n")
        assert ("\n".join(lines[:r["line"] - 1]) + "\n").endswith(r["context"]), r
        assert len(set(r["choices"])) == 4 and all(c in lines for c in r["choices"]), r
    assert {r["gold"] for r in rows} == {0, 1, 2, 3}
