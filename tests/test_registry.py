"""ds_train/config/registry.py: the names of the advantage estimators, loss aggregations, KL
estimators and preference losses, which the config reads without importing torch and the
algorithms attach their functions to. A new estimator and a new loss aggregation, registered in a
scratch module, are accepted by the config, listed by --help-config, and trained with."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_MODEL, node_launch, ript_config, run_cmd
from ds_train.config.file import build_config, describe
from ds_train.config.registry import (ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, PREFERENCE_LOSSES, Entry,
                                      Registry)
from ds_train.errors import UserError

ARCH = {"model": {"config": dict(TINY_MODEL)}}
MARK = 0.25  # the scratch estimator's advantage for every rollout: exact in the log

# A user's module: one registered function for each; nothing else in ds_train changes.
SCRATCH = f'''
import torch

from ds_train.ript.algorithms import register_advantage, register_loss_agg


@register_advantage("marked", help="{MARK} for every rollout (a test's estimator: its mark shows in the log)")
def marked(rewards, batch_std=None):
    return torch.full_like(rewards, {MARK})


@register_loss_agg("token-sum", help="the sum over valid tokens, not normalised")
def token_sum(per_token, mask, norms, scale=1.0):
    return (per_token * mask).sum() * scale
'''

# A user's entry point: import the registrations, then ds_train's command line (each rank runs it).
ENTRY = '''
import my_algorithms  # noqa: F401  (registers "marked" and "token-sum")
from ds_train.__main__ import cli

cli()
'''


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The scratch module imported (its registrations undone after the test)."""
    for registry in (ADVANTAGES, LOSS_AGGREGATIONS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    path = tmp_path / "my_algorithms.py"
    path.write_text(SCRATCH)
    spec = importlib.util.spec_from_file_location("my_algorithms", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return path


def test_the_config_knows_every_built_in_name_without_importing_torch():
    """The config's checks and --help-config see every built-in name in a process that imports no
    torch; importing the algorithms attaches a function to each, and to no other name."""
    probe = ("import sys\n"
             "from ds_train.config.file import build_config, describe\n"
             "from ds_train.config.registry import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, PREFERENCE_LOSSES\n"
             f"arch = {ARCH!r}\n"
             "for a in ADVANTAGES:\n"
             "    for m in LOSS_AGGREGATIONS:\n"
             "        for k in KL_ESTIMATORS:\n"
             "            build_config({**arch, 'ript': {'advantage': a, 'loss_agg_mode': m, 'kl_estimator': k,\n"
             "                                            'kl_coef': 0.1}})\n"
             "for loss in PREFERENCE_LOSSES:\n"
             "    build_config({**arch, 'data': {'format': 'preference'}, 'dpo': {'loss': loss}})\n"
             "assert 'grpo, group mean and std' in describe()\n"
             "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    import ds_train.ript.algorithms  # noqa: F401
    import ds_train.train.preference  # noqa: F401

    for registry, names in ((ADVANTAGES, ["rloo", "grpo"]), (KL_ESTIMATORS, ["k1", "k3"]),
                            (LOSS_AGGREGATIONS, ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
                            (PREFERENCE_LOSSES, ["sigmoid", "ipo", "sigmoid_norm"])):
        assert list(registry) == names
        assert all(callable(registry[n]) for n in names)  # a declared name without a function would raise


def test_what_was_a_special_case_by_name_is_a_property_of_the_entry():
    assert ADVANTAGES.where(scaled=True) == ("grpo",)  # takes ript.scale_rewards (and its batch std)
    assert PREFERENCE_LOSSES.where(normalised=True) == ("ipo", "sigmoid_norm")
    assert PREFERENCE_LOSSES.where(smoothed=False) == ("ipo",)
    with pytest.raises(UserError, match="ript.scale_rewards: none scales grpo's advantages, and ript.advantage is "
                                        "rloo"):
        build_config({**ARCH, "ript": {"scale_rewards": "none"}})


def test_a_registration_that_contradicts_a_declaration_is_refused():
    registry = Registry("thing")
    registry.declare("a", "the first")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="thing 'a' is registered twice"):
        registry.register("a")(max)
    with pytest.raises(ValueError, match="thing 'a' is declared in ds_train/config/registry.py"):
        registry.register("a", help="again")(len)
    registry.declare("b", "the second")
    with pytest.raises(KeyError, match="thing 'b': no function registered"):
        registry["b"]
    with pytest.raises(ValueError, match="unknown thing 'c'; one of a, b"):
        registry["c"]
    assert registry.entry("a") == Entry("a", "the first") and registry["a"] is len


def test_a_scratch_module_s_estimator_and_aggregation_are_names_the_config_takes_and_the_update_calls(scratch):
    import torch

    from ds_train.ript.algorithms import Norms, advantages, aggregate

    cfg = build_config({**ARCH, "ript": {"advantage": "marked", "loss_agg_mode": "token-sum"}})
    assert (cfg.ript.advantage, cfg.ript.loss_agg_mode) == ("marked", "token-sum")
    text = describe()
    assert f"scaled as scale_rewards says; marked, {MARK} for every rollout (a test's estimator" in text
    assert "token-sum, the sum over valid tokens, not normalised." in text
    with pytest.raises(UserError, match="^config: ript.advantage: 'markd' is not one of rloo, grpo, marked$"):
        build_config({**ARCH, "ript": {"advantage": "markd"}})
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert advantages("marked", rewards, "group", None).tolist() == [[MARK] * 4]
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = (per_token != 0).float()
    assert float(aggregate(per_token, mask, "token-sum", Norms(4, 2, 8), scale=3.0)) == 30.0


def test_without_the_scratch_module_the_name_is_refused():
    with pytest.raises(UserError, match="^config: ript.advantage: 'marked' is not one of rloo, grpo$"):
        build_config({**ARCH, "ript": {"advantage": "marked"}})


@pytest.mark.slow
def test_a_ript_run_trains_with_an_estimator_and_an_aggregation_from_a_scratch_module(tiny_policy, tmp_path):
    """2 processes, each starting from a user's entry point that imports the scratch module before
    ds_train's command line: the config takes the new names, and the update uses both functions.
    One optimizer step per iteration starts at the rollout policy (ratio 1), so every valid token's
    loss is -MARK: policy/advantage is MARK exactly, and policy/loss (token-sum) is -MARK x
    policy/tokens. rloo's advantages would not be MARK, and token-mean's loss would be -MARK."""
    (tmp_path / "my_algorithms.py").write_text(SCRATCH)
    (tmp_path / "entry.py").write_text(ENTRY)
    config = ript_config(tmp_path, tiny_policy, advantage="marked", loss_agg_mode="token-sum")
    res = run_cmd([*node_launch(), str(tmp_path / "entry.py"), "ript", "--config", str(config), "--ds-config",
                   str(ROOT / "ds_configs" / "zero2.json")], timeout=240,
                  env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}:{tmp_path}"})  # this checkout's ds_train
    assert res.returncode == 0, res.out[-4000:]
    run_dir = tmp_path / "run"
    assert "marked, token-sum, clip 0.2/0.28, no KL" in (run_dir / "logs" / "train.log").read_text()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if "policy/loss" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["policy/ratio"] == 1.0 and m["policy/tokens"] > 0
        assert m["policy/advantage"] == MARK
        assert m["policy/loss"] == -MARK * m["policy/tokens"]
