"""Mixture-of-experts routers (ds_train/model/routers.py): tokens per expert counted from the routers'
own choices in training forwards only, the load metrics, and where they show: the console keys, the
monitor, the plots and the doctor. Exact across ranks: tests/test_parity.py (AutoEP against the
one-process reference)."""

from __future__ import annotations

import json

import pytest

from ds_train.model.routers import Router, RouterCounts, find_routers, load_metrics

MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 6,
       "num_experts_per_tok": 2, "max_position_embeddings": 64, "vocab_size": 50}


def tiny(**overrides):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**MOE, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config)


def expected_counts(model, ids) -> list[list[int]]:
    """Each layer's top-k choices recomputed from its router's logits (the model's own recorder)."""
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    k, e = model.config.num_experts_per_tok, model.config.num_experts
    return [torch.bincount(layer.topk(k, dim=-1).indices.reshape(-1), minlength=e).tolist() for layer in logits]


def test_training_forwards_count_each_token_at_its_experts_once_and_nothing_else_counts():
    import torch

    model = tiny()
    counts = RouterCounts(model)
    assert counts.routers == [Router(f"model.layers.{i}.mlp.gate", 6, 2, False) for i in range(2)]
    ids = torch.randint(0, 50, (3, 10))
    want = expected_counts(model, ids)  # a forward outside training: not counted
    model.train()
    model(input_ids=ids).logits.sum().backward()
    model.gradient_checkpointing_enable()  # the recompute in backward routes again: not counted
    model(input_ids=ids).logits.sum().backward()
    got = counts.take()
    assert got == [[2 * n for n in row] for row in want]
    assert all(sum(row) == 2 * 3 * 10 * 2 for row in got)  # two forwards x tokens x top 2
    assert counts.take() == [[0] * 6, [0] * 6]  # taken: a fresh start
    counts.close()
    model(input_ids=ids)
    assert counts.take() == [[0] * 6, [0] * 6]


@pytest.mark.parametrize("model_type, experts", [("granitemoe", {"num_local_experts": 6}),
                                                 ("mixtral", {"num_local_experts": 6})])
def test_routers_that_return_the_chosen_experts_first_or_last_are_counted(model_type, experts):
    """GraniteMoE's router returns (indices, weights, logits), Mixtral's (logits, scores, indices): the
    counts come from the integer tensor wherever it is, every token at its 2 experts (once failed:
    bincount of GraniteMoE's float logits, a crash at the first step)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
                                               vocab_size=50, **experts)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    counts = RouterCounts(model)
    assert len(counts.routers) == 2 and all(r.experts == 6 and r.top_k == 2 for r in counts.routers)
    model(input_ids=torch.randint(0, 50, (3, 10)))
    got = counts.take()
    assert all(sum(row) == 3 * 10 * 2 for row in got) and any(max(row) < 3 * 10 for row in got), got


def test_a_dense_model_has_no_routers():
    import transformers

    config = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, vocab_size=50)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert find_routers(model) == [] and not RouterCounts(model)


def test_load_metrics_say_the_busiest_expert_against_the_mean_and_a_uniform_router():
    routers = [Router("a", 4, 2, False), Router("b", 4, 2, False)]
    m = load_metrics([[10, 10, 10, 10], [20, 10, 10, 0]], routers)  # 20 tokens, 2 experts each
    assert m["moe/layer_load_max_mean"] == [1.0, 2.0] and m["moe/load_max_mean"] == 2.0
    assert m["moe/layer_top_share"] == [0.5, 1.0]  # layer b's expert 0 was chosen by every token
    assert m["moe/uniform_share"] == 0.5 and m["moe/tokens_per_expert"] == [[10, 10, 10, 10], [20, 10, 10, 0]]
    assert load_metrics([[0, 0]], [Router("c", 2, 1, False)])["moe/load_max_mean"] == 0.0


def records(steps: int, share: float, experts: int = 8) -> list[dict]:
    row = [round(share * 100)] + [round((1 - share) * 100 / (experts - 1))] * (experts - 1)
    return [{"step": s, "train/loss": 5.0, "moe/load_max_mean": max(row) / (sum(row) / experts),
             "moe/layer_load_max_mean": [1.1, max(row) / (sum(row) / experts)], "moe/aux_loss": 1.0 + s / 100,
             "moe/layer_top_share": [0.2, share], "moe/uniform_share": 1 / experts,
             "moe/tokens_per_expert": [[12] * experts, row]} for s in range(1, steps + 1)]


def write_run(tmp_path, recs) -> str:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "env.json").write_text(json.dumps({"command": "train"}))
    (run / "config.yaml").write_text("train:\n  max_steps: 10\n")
    return str(run)


@pytest.mark.parametrize("share, steps, collapsed", [(0.9, 5, True), (0.9, 4, False), (0.3, 10, False)])
def test_the_doctor_names_a_router_collapsed_on_its_last_logged_steps(tmp_path, share, steps, collapsed):
    from ds_train.observe.doctor import diagnose

    recs = records(steps, share)
    found = {f.cls: f for f in diagnose(write_run(tmp_path, recs))}
    assert ("router_collapse" in found) == collapsed
    if collapsed:
        assert found["router_collapse"].evidence == [
            f"metrics.jsonl: steps 1-{steps}: MoE layer 1's expert 0 was chosen by 90%-90% of its tokens "
            f"(a uniform router: 12%)"]
        assert "output_router_logits=true" in " ".join(found["router_collapse"].fixes)


def test_plots_monitor_and_console_show_the_expert_load_of_an_moe_run_only(tmp_path):
    from ds_train.checkpoint.rundir import TRAIN
    from ds_train.observe.plots import figures

    recs = records(6, 0.5)
    figs = figures([("moe", recs)])
    assert set(figs) == {"loss", "lr", "throughput", "memory", "experts"}
    top, bottom = figs["experts"].axes
    assert [line.get_label() for line in top.get_lines()] == ["layer 0", "layer 1"]
    assert list(top.get_lines()[1].get_ydata()) == [r["moe/layer_load_max_mean"][1] for r in recs]
    assert list(bottom.get_lines()[0].get_ydata()) == [r["moe/aux_loss"] for r in recs]
    assert "experts" not in figures([("dense", [{k: v for k, v in r.items() if not k.startswith("moe/")}
                                                for r in recs])])
    assert {"moe/load_max_mean", "moe/aux_loss"} <= set(TRAIN.console_keys)
    assert ("expert load max/mean", "moe/load_max_mean") in TRAIN.curves
