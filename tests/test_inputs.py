"""ds_train.inputs: the check step reads and checks every input once, before anything is written,
the model before the data (a bad key fails in a second, preparing a corpus takes minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL, expect_error, run_cmd, tiny_config, tree_listing, write_config
from ds_train.config.file import build_config, load_config
from ds_train.errors import UserError
from ds_train.inputs import check_inputs, rank_config_check, tokenizer_dir

ZERO0 = str(ROOT / "ds_configs" / "zero0.json")
ZERO2 = str(ROOT / "ds_configs" / "zero2.json")
ZERO3 = str(ROOT / "ds_configs" / "zero3.json")


def test_a_bad_model_fails_before_the_data_is_prepared(tmp_path):
    (tmp_path / "doc.txt").write_text("some text\n" * 50)
    cfg = build_config({"model": {"config": {**TINY_MODEL, "hidden_sizee": 64}},
                        "data": {"dir": str(tmp_path / "data"), "sources": [str(tmp_path / "doc.txt")]}})
    with pytest.raises(UserError, match=r"model.config.hidden_sizee: unknown key .* \(did you mean 'hidden_size'\?\)"):
        check_inputs(cfg, ZERO0)
    assert not (tmp_path / "data").exists()
    with pytest.raises(UserError, match="nope.json: DeepSpeed JSON file not found"):  # the DeepSpeed JSON first
        check_inputs(build_config({"model": {"config": TINY_MODEL}}), str(tmp_path / "nope.json"))


def test_a_model_trained_from_scratch_takes_the_data_tokenizers_vocabulary(tiny_data, tmp_path):
    cfg = build_config({"model": {"config": TINY_MODEL}, "data": {"dir": str(tiny_data)},
                        "train": {"seq_len": 64}})
    inputs = check_inputs(cfg, ZERO0)
    assert inputs.source.hf_config.vocab_size == len(inputs.source.tokenizer) == 512
    assert inputs.source.weights is None and inputs.data.train.seq_len == 64
    assert inputs.data_id()["tokenizer"] == inputs.data_id()["tokenizer"] and "train_tokens" in inputs.data_id()
    assert inputs.template["zero_optimization"]["stage"] == 0


def test_the_tokenizer_of_the_data_is_decided_in_one_place(tiny_policy):
    cfg = build_config({"model": {"path": str(tiny_policy)}, "train": {"seq_len": 64}})
    assert tokenizer_dir(cfg, tiny_policy) == str(tiny_policy)  # the model's
    assert tokenizer_dir(build_config({"data": {"tokenizer": "/t"}, "model": {"path": str(tiny_policy)}}),
                         tiny_policy) == "/t"  # data.tokenizer first
    assert tokenizer_dir(build_config({"model": {"config": TINY_MODEL}}), None) == ""  # the BPE prepare trains
    ript = check_inputs(cfg, ZERO0, data=False)  # a run without data: the model's own tokenizer
    assert Path(ript.source.tokenizer.name_or_path) == tiny_policy and ript.data is None


def test_a_model_vocabulary_smaller_than_its_tokenizer_is_refused(tmp_path):
    """The data may use only the low ids (chat tokens added on top never occur in plain text), but
    the tokenizer can produce every one (a prompt, a sample, RIPT's rollouts): model.config.vocab_size
    below the tokenizer's size is a contradiction, found before anything is written."""
    from ds_train.data.prepare import prepare
    from ds_train.data.tokenizer import train_tokenizer

    (tmp_path / "doc.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    tok = train_tokenizer([(tmp_path / "doc.txt").read_text()], 300, tmp_path / "tok")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tok.save_pretrained(str(tmp_path / "tok"))
    prepare([str(tmp_path / "doc.txt")], tmp_path / "data", str(tmp_path / "tok"), val_fraction=0.1)
    base = len(tok) - 2
    cfg = build_config({"model": {"config": {**TINY_MODEL, "vocab_size": base}},
                        "data": {"dir": str(tmp_path / "data"), "tokenizer": str(tmp_path / "tok")},
                        "train": {"seq_len": 16}})
    with pytest.raises(UserError) as e:
        check_inputs(cfg, ZERO0)
    said = str(e.value)
    assert said.startswith(f"model.config.vocab_size: {base} is smaller than the tokenizer") and \
        f"({len(tok)} tokens)" in said, said


@pytest.mark.parametrize("section, value, needle", [
    ("optimizer", "AdamWW", "optimizer.type: 'AdamWW' is not an optimizer DeepSpeed knows"),
    ("scheduler", "WarmupCosine", "scheduler.type: 'WarmupCosine' is not a DeepSpeed scheduler"),
])
def test_a_deepspeed_optimizer_or_scheduler_name_it_lacks_is_refused_at_the_check(tmp_path, section, value, needle):
    import json

    ds = json.loads(Path(ZERO0).read_text())
    ds[section] = {"type": value, "params": {}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(UserError) as e:
        check_inputs(build_config({"model": {"config": TINY_MODEL}}), str(path))
    said = str(e.value)
    assert said.startswith(f"{path}: {needle}") and ("adamw" in said or "WarmupCosineLR" in said), said


@pytest.mark.parametrize("key, value", [("eos_token_id", 10_000), ("pad_token_id", -5), ("eos_token_id", [1, 999]),
                                        ("bos_token_id", 512)])
def test_a_special_token_id_outside_the_vocabulary_is_named(tiny_data, key, value):
    cfg = build_config({"model": {"config": {**TINY_MODEL, key: value}}, "data": {"dir": str(tiny_data)},
                        "train": {"seq_len": 64}})
    with pytest.raises(UserError) as e:
        check_inputs(cfg, ZERO0)
    assert str(e.value).startswith(f"model.config.{key}: ") and "0 to 511" in str(e.value), str(e.value)


# ---- one check everywhere (issue 58): each layout a rank refuses, `ds-train launch --check` refuses ----

MOE3 = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "num_experts": 3,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 128}
# (case, the run config's sections over the tiny one, the DeepSpeed JSON, what the line names): every kind
# of layout refusal check_layout and the commands' own model checks give at world 2 (2 ranks a node)
LAYOUTS = [
    ("world", {"parallel": {"sequence": 3}}, ZERO2, "parallel.sequence=3"),
    ("batch", {"train": {"global_batch_size": 7}}, ZERO2, "global_batch_size"),
    ("dense experts", {"parallel": {"expert": 2}}, ZERO2, "parallel.expert=2"),
    ("experts", {"parallel": {"expert": 2}, "model": {"config": MOE3}}, ZERO2, "3"),
    ("heads", {"parallel": {"sequence": 2}, "model": {"config": {**TINY_MODEL, "hidden_size": 48,
                                                                 "num_attention_heads": 3, "num_key_value_heads": 3}}},
     ZERO2, "attention heads"),
    ("kv heads", {"parallel": {"tensor": 2}, "model": {"config": {**TINY_MODEL, "num_key_value_heads": 1}}},
     ZERO2, "key/value heads"),
    ("tensor zero3", {"parallel": {"tensor": 2}}, ZERO3, "ZeRO-3"),
    ("tensor lora", {"parallel": {"tensor": 2}, "model": {"lora": {"rank": 4}}}, ZERO2, "LoRA"),
    ("lora targets", {"model": {"lora": {"rank": 4, "target_modules": ["no_such_proj"]}}}, ZERO2, "no_such_proj"),
    ("ript vllm", "ript", ZERO2, "ript.vllm_tensor_parallel_size=4"),
]


def _layout_config(tmp_path: Path, sections, tiny_policy) -> Path:
    """A run config whose data is a source not yet prepared (data.dir does not exist)."""
    (tmp_path / "doc.txt").write_text("some text to prepare\n" * 200)
    data = {"dir": str(tmp_path / "data"), "sources": [str(tmp_path / "doc.txt")], "vocab_size": 300}
    if sections == "ript":  # the RL command: its rollout engine's tensor size does not divide the node's 2 ranks
        return write_config(tmp_path / "run.yaml", {
            "output_dir": str(tmp_path / "run"), "model": {"path": str(tiny_policy), "dtype": "fp32"},
            "train": {"seq_len": 64},
            "ript": {"tasks": ["add"], "rollout_engine": "vllm", "vllm_tensor_parallel_size": 4}})
    cfg = tiny_config(tmp_path / "data", tmp_path / "run", **sections)
    cfg["model"] = {**cfg["model"], **sections.get("model", {})} if "model" in sections else cfg["model"]
    if "path" in cfg["model"]:
        cfg["model"].pop("config", None)
    cfg["data"] = data
    return write_config(tmp_path / "run.yaml", cfg)


@pytest.mark.parametrize("case, sections, ds_config, needle", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_each_layout_a_rank_refuses_the_launch_preflight_refuses_alike_before_the_data_is_prepared(
        case, sections, ds_config, needle, tmp_path, tiny_policy):
    """The rank's own check step (check_inputs with its config check, or ript's) at world 2 refuses before
    data.dir is prepared; `ds-train launch --check` / `slurm` (check_command) gives the same line."""
    from ds_train.__main__ import check_command
    from ds_train.topology import DistEnv

    path = _layout_config(tmp_path, sections, tiny_policy)
    command = "ript" if sections == "ript" else "train"
    cfg = load_config(str(path), [], command=command)
    env = DistEnv(0, 0, 2, 2, 0, "127.0.0.1", 29500, "deepspeed")
    with pytest.raises(UserError) as by_rank:
        if command == "ript":
            from ds_train.ript.trainer import RiptInputs, ript_spec

            RiptInputs.check(cfg, ds_config, env, ript_spec(cfg))
        else:
            from ds_train.train.loop import train_spec

            spec = train_spec(cfg)
            check_inputs(cfg, ds_config, rank_config_check(cfg, spec, env, ds_config))
    assert needle in str(by_rank.value)
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()  # refused before the first write
    with pytest.raises(UserError) as by_preflight:
        check_command([command, "--config", str(path), "--ds-config", ds_config], 2, 2)
    assert str(by_preflight.value) == str(by_rank.value)
    with pytest.raises(UserError) as by_gpu_preflight:  # after the probe found GPUs: the same line
        check_command([command, "--config", str(path), "--ds-config", ds_config], 2, 2, "cuda")
    assert str(by_gpu_preflight.value) == str(by_rank.value)
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_and_the_launch_preflight_refuse_an_expert_size_for_a_dense_model_alike_and_write_nothing(
        tmp_path):
    """The real thing once: 2 ranks under the deepspeed launcher, and `ds-train launch --check` on a hostfile of
    2 slots (refused before any ssh); each says the one line, and data.dir, output_dir stay unwritten."""
    path = _layout_config(tmp_path, {"parallel": {"expert": 2}}, None)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    before = tree_listing(tmp_path)
    line = expect_error(["launch", "--hostfile", str(hostfile), "--check", "--", "train", "--config", str(path),
                         "--ds-config", ZERO2], "parallel.expert=2")
    from conftest import deepspeed_args

    res = run_cmd(deepspeed_args(path, "zero2.json"), timeout=240)
    assert res.returncode == 2, res.out[-3000:]
    said = [out_line for out_line in res.out.splitlines() if "error: " in out_line and "sigkill" not in out_line]
    assert said and all(s.endswith(line.removeprefix("ds-train: ")) for s in said), (line, said)
    assert tree_listing(tmp_path) == before


# ---- a package that is installed but fails to import (issue 58) ----

def _broken_peft(root: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes `import peft` fail as a GPU build without its CUDA runtime."""
    (root / "peft").mkdir(parents=True)
    (root / "peft" / "__init__.py").write_text(
        "raise OSError('libcudart.so.12: cannot open shared object file: No such file or directory')\n")
    return root


def test_a_package_that_fails_to_import_is_one_line_before_anything_is_written(tiny_data, tmp_path):
    fake = _broken_peft(tmp_path / "site")  # (importing it may write its bytecode there)
    work = tmp_path / "work"
    work.mkdir()
    path = write_config(work / "run.yaml", tiny_config(tiny_data, work / "run", model={"lora": {"rank": 4}}))
    before = tree_listing(work)
    line = expect_error(["train", "--config", str(path), "--ds-config", ZERO2], "import peft: peft ",
                        "is installed but fails to import (OSError: libcudart.so.12: cannot open shared object",
                        "pip install --force-reinstall peft==", "or set model.lora.rank=0",
                        wrap=["env", f"PYTHONPATH={fake}"])
    assert "Traceback" not in line
    assert tree_listing(work) == before


def test_the_preflight_imports_the_runs_optional_packages_on_every_host(tmp_path):
    """The probe imports what it is given (`import:<module>`) and reports each failure; check_probes names
    the host, the package, the error and the fix."""
    import json
    import os
    import subprocess
    import sys

    from ds_train.launch.packages import run_modules
    from ds_train.launch.preflight import HostProbe, check_probes
    from ds_train.launch.probe import PROBE

    fake = _broken_peft(tmp_path / "site")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), "0", "torch", "import:peft", "import:json"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(fake), "PATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(info["versions"]) == ["torch"]  # `import:` names are modules to import, not packages
    assert list(info["import_errors"]) == ["peft"]
    assert info["import_errors"]["peft"].startswith("OSError: libcudart.so.12: cannot open shared object file")
    cfg = build_config({"model": {"config": TINY_MODEL, "lora": {"rank": 4}}, "log": {"wandb": "offline"}})
    modules = run_modules(cfg, optional=True)
    assert [m[0] for m in modules] == ["peft", "wandb"]  # torch, deepspeed, transformers: the rank's own check
    assert [m[0] for m in run_modules(cfg)] == ["torch", "deepspeed", "transformers", "peft", "wandb"]
    info = {**info, "python": sys.executable, "cwd_exists": True}
    problems = check_probes([HostProbe("node1", info=info)], sys.executable, str(tmp_path), info["versions"],
                            info["python_version"], modules)
    assert len(problems) == 1 and problems[0].startswith("node1: import peft: peft ")
    assert "(OSError: libcudart.so.12" in problems[0] and problems[0].endswith("or set model.lora.rank=0")


def test_the_preflight_checks_prepared_data_from_its_metadata_alone_as_the_ranks_do(tiny_data, tmp_path):
    """A model whose vocabulary is its own (model.config.vocab_size) smaller than the ids data.dir holds: the
    rank's check step and the launch preflight (meta.json alone, nothing read or written) say the same line."""
    from ds_train.__main__ import check_command
    from ds_train.topology import DistEnv
    from ds_train.train.loop import train_spec

    path = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run",
                                                           model={"config": {**TINY_MODEL, "vocab_size": 100}}))
    cfg = load_config(str(path), [], command="train")
    env = DistEnv(0, 0, 2, 2, 0, "127.0.0.1", 29500, "deepspeed")
    before = tree_listing(Path(tiny_data))
    with pytest.raises(UserError) as by_rank:
        check_inputs(cfg, ZERO2, rank_config_check(cfg, train_spec(cfg), env, ZERO2))
    assert "holds token id" in str(by_rank.value) and ">= the model's vocab_size 100" in str(by_rank.value)
    with pytest.raises(UserError) as by_preflight:
        check_command(["train", "--config", str(path), "--ds-config", ZERO2], 2, 2)
    assert str(by_preflight.value) == str(by_rank.value)
    check_command(["train", "--config", str(path), "--ds-config", ZERO2, "model.config.vocab_size=512"], 2, 2)
    assert tree_listing(Path(tiny_data)) == before and not (tmp_path / "run").exists()
