"""ds_train.config.file: every value type-checked at every depth (list elements, mapping keys and
values, Literal choices), naming the full dotted key with its index and the expected type; YAML
loaded with a bound on alias expansion."""

from __future__ import annotations

import pytest

from conftest import ROOT, TINY_MODEL, expect_error, tree_listing
from ds_train.config.file import build_config, load_config, read_yaml
from ds_train.errors import UserError

ARCH = {"model": {"config": {"model_type": "llama", "hidden_size": 64}}}
ZERO0 = str(ROOT / "ds_configs" / "zero0.json")


def problem(raw: dict, *overrides: str) -> str:
    with pytest.raises(UserError) as e:
        if overrides:
            load_config(None, [*overrides]) if not raw else build_config(raw)
        else:
            build_config({**ARCH, **raw})
    return str(e.value)


@pytest.mark.parametrize("raw, needle", [
    ({"data": {"sources": ["a.txt", 3]}}, "data.sources[1]: 3 must be a string"),
    ({"optim": {"betas": ["x", 0.95]}}, "optim.betas[0]: 'x' must be a number"),
    ({"optim": {"betas": [0.9, None]}}, "optim.betas[1]: None must be a number"),
    ({"train": {"debug_nonfinite_steps": [1, "two"]}}, "train.debug_nonfinite_steps[1]: 'two' must be an integer"),
    ({"train": {"debug_nonfinite_steps": [True]}}, "train.debug_nonfinite_steps[0]: True must be an integer"),
    ({"ript": {"tasks": ["add", ["rev"]]}}, "ript.tasks[1]: ['rev'] must be a string or a mapping"),
    ({"launch": {"env": [{"NCCL_DEBUG": 1}]}}, "launch.env[0]: {'NCCL_DEBUG': 1} must be a string"),
    ({"data": {"weights": [1, "2"], "sources": ["a", "b"]}}, "data.weights[1]: '2' must be a number"),
    ({"data": {"pack": 1}}, "data.pack: 1 is not one of auto, true, false"),
    ({"data": {"pack": 0}}, "data.pack: 0 is not one of auto, true, false"),
    ({"benchmarks": {"tasks": ["t"], "every": "ten"}}, "benchmarks.every: 'ten' must be an integer or null"),
    ({"benchmarks": {"tasks": ["t"], "every": 2.5}}, "benchmarks.every: 2.5 must be an integer or null"),
])
def test_a_value_of_the_wrong_type_inside_a_list_names_the_key_and_index(raw, needle):
    said = problem(raw)
    assert said == f"config: {needle}", said


def test_model_config_keys_must_be_strings_and_its_values_checked_at_every_depth():
    said = problem({"model": {"config": {"model_type": "llama", 7: 64}}})
    assert said.startswith("config: ") and "model.config: key 7 must be a string" in said, said
    said = problem({"model": {"config": {"model_type": "llama", "rope_scaling": {1: "x"}}}})
    assert "model.config.rope_scaling: key 1 must be a string" in said, said


def test_a_wrong_element_given_as_an_override_names_the_override_and_the_element():
    with pytest.raises(UserError) as e:
        load_config(None, ["model.config.model_type=llama", "optim.betas=[0.9, oops]"])
    assert str(e.value) == "override optim.betas=[0.9, oops]: optim.betas[1]: 'oops' must be a number"


def test_every_problem_at_every_depth_is_reported_at_once():
    said = problem({"data": {"sources": [1, "b", 2.5]}, "optim": {"betas": ["a", "b"]}})
    for needle in ("data.sources[0]: 1 must be a string", "data.sources[2]: 2.5 must be a string",
                   "optim.betas[0]: 'a' must be a number", "optim.betas[1]: 'b' must be a number"):
        assert needle in said, said


def test_text_that_is_not_utf8_is_refused_at_any_depth():
    """A command-line argument that is not UTF-8 arrives with surrogate escapes; writing it into
    config.yaml would fail after the run directory was made."""
    said = problem({"output_dir": "runs/\udcff"})
    assert "output_dir: 'runs/\\udcff' is not valid UTF-8 text" in said, said
    said = problem({"data": {"sources": ["ok.txt", "b\udce9d.txt"]}})
    assert "data.sources[1]: 'b\\udce9d.txt' is not valid UTF-8 text" in said, said
    said = problem({"model": {"config": {"model_type": "llama", "name": "\udcff"}}})
    assert "model.config.name:" in said and "not valid UTF-8" in said, said


def test_a_wrong_element_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {TINY_MODEL}}}\n"
                   f"data: {{dir: {tmp_path / 'data'}, sources: [{tmp_path / 'a.txt'}, 3]}}\n")
    before = tree_listing(tmp_path)
    expect_error(["train", "--config", str(cfg), "--ds-config", ZERO0], f"{cfg}: data.sources[1]: 3 must be a string")
    expect_error(["train", "--config", str(cfg), "--ds-config", ZERO0, f"data.sources=[{tmp_path}]",
                  "optim.betas=[0.9, x]"], "override optim.betas=[0.9, x]: optim.betas[1]: 'x' must be a number")
    assert tree_listing(tmp_path) == before


# --- bounded YAML --------------------------------------------------------------------------------

def billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nmodel: {{config: {{model_type: llama, x: *a{levels}}}}}\n"


@pytest.mark.timeout(60)  # a loader that expands the aliases spins for hours: the test fails here
def test_a_yaml_file_whose_aliases_expand_exponentially_is_refused_without_spinning(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs())
    with pytest.raises(UserError) as e:
        read_yaml(path)
    said = str(e.value)
    assert said.startswith(f"{path}: ") and "aliases" in said and "\n" not in said, said


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("data: {sources: &s [a, *s]}\n")
    with pytest.raises(UserError, match=rf"^{path}: .*alias \*s .*inside its own anchor"):
        read_yaml(path)


def test_yaml_nested_past_any_sensible_depth_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError, match=rf"^{path}: .*nested"):
        read_yaml(path)


def test_a_config_with_a_few_anchors_and_merge_keys_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &base {micro_batch_size: 2, seq_len: 64}\n"
                    "train: {<<: *base, max_steps: 5}\nsrc: &src [a.txt, b.txt]\ndata: {sources: *src}\n")
    raw = read_yaml(path)
    assert raw["train"] == {"micro_batch_size": 2, "seq_len": 64, "max_steps": 5}
    assert raw["data"]["sources"] == ["a.txt", "b.txt"]


def test_a_yaml_bomb_given_to_train_is_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(12))
    before = tree_listing(tmp_path)
    expect_error(["train", "--config", str(path), "--ds-config", ZERO0], f"{path}: ", "aliases", timeout=60)
    assert tree_listing(tmp_path) == before
