"""ds_train.plan.experts: expert parallelism (parallel.expert, DeepSpeed AutoEP) as the layout sees it: the
models it takes, the sizes that divide their experts and the data ranks, what is not combined with it yet
(one line each, nothing written), and the ds_config section it renders. Runs under it: test_parity.py."""

from __future__ import annotations

import re

import pytest
from transformers import AutoConfig

from conftest import ROOT
from ds_train.config import ParallelConfig
from ds_train.config.file import build_config
from ds_train.dsconfig import read_ds_template
from ds_train.engine import render_ds_config
from ds_train.errors import UserError
from ds_train.plan.batch import plan_batch
from ds_train.plan.experts import check_router_loss, autoep_preset, check_expert_model, expert_section, num_experts
from ds_train.plan.parallel import ParallelDims, check_layout, plan_dims

MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128}


def moe_config(**changes):
    return AutoConfig.for_model(**{**MOE, **changes})


def run_config(**sections):
    raw = {"model": {"config": dict(MOE)}, "train": {"global_batch_size": 8, "micro_batch_size": 2}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw)


def test_the_models_autoep_takes_have_a_preset_and_their_experts_counted():
    assert autoep_preset(moe_config()) == "qwen3_moe" and num_experts(moe_config()) == 4
    assert autoep_preset(AutoConfig.for_model("qwen2_moe", num_experts=8)) == "qwen3_moe"  # the same layout
    mixtral = AutoConfig.for_model("mixtral", num_local_experts=8)
    assert (autoep_preset(mixtral), num_experts(mixtral)) == ("mixtral", 8)
    assert autoep_preset(AutoConfig.for_model("llama")) is None and num_experts(AutoConfig.for_model("llama")) is None


def test_experts_are_cut_from_the_data_ranks_and_change_neither_the_world_nor_the_batch():
    dims = plan_dims(ParallelConfig(expert=2), 4)
    assert dims == ParallelDims(4, 1, 1, 2) and dims.world == 4 and dims.derivation() == ""
    assert dims.record() == {"data": 4, "sequence": 1, "tensor": 1, "expert": 2}
    assert ParallelDims.from_record(dims.record(), 4) == dims
    assert ParallelDims(4).record() == {"data": 4, "sequence": 1, "tensor": 1}  # without experts: as before
    assert dims.describe() == ("parallel: data 4 x sequence 1 x tensor 1 = world 4 (experts split over 2 of the "
                               "data ranks)")
    cfg = run_config(parallel={"expert": 2})
    layout = check_layout(cfg, read_ds_template(ROOT / "ds_configs" / "zero2.json"), 2, moe_config())
    assert (layout.dims.expert, layout.batch.grad_accum_steps, layout.batch.micro_batch_size) == (2, 2, 2)


@pytest.mark.parametrize("expert, world, model, needle", [
    (2, 3, {}, "parallel.expert=2 does not divide the 3 data-parallel rank(s) (AutoEP cuts its expert groups from "
               "them); choose 1 or 3, or launch a multiple of 2 data-parallel ranks"),
    (3, 3, {}, "parallel.expert=3 does not divide the model's 4 experts per layer; choose 1, 2 or 4"),
    (2, 2, {"model_type": "llama"}, "parallel.expert=2: model type 'llama' has no experts (a dense model: no "
                                    "mixture-of-experts layers to split over ranks); set parallel.expert=1"),
    (2, 2, {"model_type": "llama", "num_local_experts": 4}, "parallel.expert=2: model type 'llama' has no DeepSpeed "
                                    "AutoEP preset, so its experts cannot be split; AutoEP takes deepseek_v2,"),
])
def test_sizes_the_model_or_the_ranks_cannot_take_are_one_line(expert, world, model, needle):
    hf = AutoConfig.for_model(**model, hidden_size=64) if model else moe_config()
    cfg = run_config(parallel={"expert": expert}, train={"global_batch_size": 6 * world, "micro_batch_size": 1})
    with pytest.raises(UserError) as e:
        check_layout(cfg, read_ds_template(ROOT / "ds_configs" / "zero2.json"), world, hf)
    assert needle in str(e.value), str(e.value)
    check_expert_model(1, hf)  # parallel.expert=1: any model


def test_a_router_loss_is_refused_where_the_loss_would_leave_it_out_or_a_rank_sees_part_of_a_sequence():
    template = read_ds_template(ROOT / "ds_configs" / "zero2.json")
    moe = moe_config(output_router_logits=True)
    check_layout(run_config(), template, 2, moe)  # pretraining and SFT train it (tests/test_parity.py)
    for changes, where in (({"data": {"format": "preference"}}, "data.format=preference: the DPO loss does not add it"),
                           ({"parallel": {"sequence": 2}}, "parallel.sequence=2: each rank routes part of a sequence")):
        with pytest.raises(UserError, match=re.escape(f"model.config.output_router_logits=true with {where}")):
            check_router_loss(run_config(**changes), moe)
    check_router_loss(run_config(data={"format": "preference"}), moe_config(output_router_logits=False))


def test_what_experts_are_not_combined_with_yet_is_refused_in_one_line_each():
    cfg = run_config(parallel={"expert": 2, "sequence": 2, "tensor": 2}, checkpoint={"export_final": True},
                     model={"lora": {"rank": 4}})
    with pytest.raises(UserError) as e:
        check_layout(cfg, read_ds_template(ROOT / "ds_configs" / "zero2.json"), None)
    said = str(e.value)
    for needle in ("parallel.expert=2 with parallel.sequence=2: ds_train does not combine expert parallelism with "
                   "sequence parallelism yet; choose one", "parallel.expert=2 with parallel.tensor=2",
                   "parallel.expert=2 with LoRA (model.lora.rank=4)"):
        assert needle in said, said
    assert "export_final" not in said  # an expert-parallel checkpoint exports (tests/test_checkpoint.py)
    # DPO trains under expert parallelism (tests/test_preference.py)
    check_layout(run_config(parallel={"expert": 2}, data={"format": "preference"}),
                 read_ds_template(ROOT / "ds_configs" / "zero2.json"), None)


def test_the_run_renders_the_expert_parallel_section_and_a_template_must_agree():
    cfg = run_config(parallel={"expert": 2})
    section = expert_section(cfg, moe_config())
    assert section == {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
    assert expert_section(run_config(), moe_config()) is None
    plan = plan_batch(8, 2, 2, 64)

    def render(template, c=cfg, experts=section):
        return render_ds_config(template, c, plan, dtype="fp32", hidden_size=64, lr=1e-3, total_steps=10,
                                on_gpu=False, experts=experts, source="t.json")

    zero2 = read_ds_template(ROOT / "ds_configs" / "zero2.json")
    assert render(zero2)["expert_parallel"] == section
    assert "expert_parallel" not in render(zero2, run_config(), None)
    assert render({**zero2, "expert_parallel": {"autoep_size": "auto", "use_grouped_mm": False}})[
        "expert_parallel"] == {**section, "use_grouped_mm": False}  # its other keys are the template's
    with pytest.raises(UserError, match=r"t.json: expert_parallel.autoep_size=4 contradicts parallel.expert=2"):
        render({**zero2, "expert_parallel": {"autoep_size": 4}})
    with pytest.raises(UserError, match=r"t.json: expert_parallel.enabled=true, but parallel.expert=1; set "
                                        r"parallel.expert instead"):
        render({**zero2, "expert_parallel": {"enabled": True}}, run_config(), None)
    with pytest.raises(UserError, match=r"t.json: expert_parallel.combine_implementation: not a key DeepSpeed's "
                                        r"AutoEP reads \(did you mean 'combine_impl'\?\); it would be ignored"):
        render({**zero2, "expert_parallel": {"combine_implementation": "weighted_sum"}})
    with pytest.raises(UserError, match=r"t.json: expert_parallel: combine_impl must be one of .*got 'bogus'"):
        render({**zero2, "expert_parallel": {"combine_impl": "bogus"}})  # DeepSpeed's own check, before any write

