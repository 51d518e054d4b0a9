"""ds_train.plan.parallel: the parallel dimensions as one object (pure), and the batch plan that counts
data-parallel ranks. Layouts the CLI refuses are in test_cli.py; runs in every layout, in
test_parity.py."""

from __future__ import annotations

import pytest

from ds_train.config import ParallelConfig
from ds_train.errors import UserError
from ds_train.plan.batch import plan_batch
from ds_train.plan.memory import tp_plan
from ds_train.plan.parallel import ParallelDims, check_heads, check_parallel, check_tensor_model, plan_dims


class Heads:
    """A model config as check_heads reads it."""

    def __init__(self, heads, kv=None):
        self.num_attention_heads, self.num_key_value_heads = heads, kv


def test_the_default_layout_is_all_data_parallel_and_changes_nothing():
    dims = plan_dims(ParallelConfig(), 4)
    assert dims == ParallelDims(4, 1, 1) and dims.world == 4 and dims.derivation() == ""
    assert [dims.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert dims.token_groups() == [[0, 1, 2, 3]]  # one group: the world (no subgroup is made)
    assert dims.record() == {"data": 4, "sequence": 1, "tensor": 1}
    assert plan_batch(32, 2, dims.data, 128, dims.derivation()).describe(4) == (
        "batch: global 32 seqs = micro 2 x accum 4 x world 4; seq_len 128; 4,096 tokens/step")


def test_ranks_are_laid_out_as_deepspeed_lays_out_its_groups():
    """Tensor innermost (AutoTP's groups are consecutive ranks), then sequence (Ulysses' likewise),
    then data: the sequence and tensor ranks of one data-parallel group read the same batch."""
    dims = ParallelDims(2, 2, 2)
    assert [dims.coords(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                  (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.token_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # tensor ranks compute the same tokens
    assert ParallelDims(2, 2, 1).token_groups() == [[0, 1, 2, 3]]  # sequence ranks hold different tokens
    assert dims.describe() == "parallel: data 2 x sequence 2 x tensor 2 = world 8"
    assert ParallelDims.from_record(dims.record(), 8) == dims
    assert ParallelDims.from_record(None, 8) == ParallelDims(8)  # a marker written before layouts were


def test_a_layout_that_does_not_divide_the_world_names_the_numbers_and_the_choices():
    with pytest.raises(UserError) as e:
        plan_dims(ParallelConfig(sequence=3), 4)
    assert str(e.value) == ("parallel.sequence=3 x parallel.tensor=1 = 3 does not divide the world size 4; choose "
                            "sizes whose product is 1, 2 or 4, or launch a multiple of 3 ranks")
    with pytest.raises(UserError, match=r"= 4 does not divide the world size 6; choose sizes whose product is "
                                        r"1, 2, 3 or 6"):
        plan_dims(ParallelConfig(sequence=2, tensor=2), 6)
    assert plan_dims(ParallelConfig(sequence=2, tensor=2), 8) == ParallelDims(2, 2, 2)


def test_a_layout_that_does_not_divide_the_heads_names_the_numbers_and_the_choices():
    with pytest.raises(UserError) as e:
        check_heads(ParallelDims(1, 3, 1), Heads(4))
    assert str(e.value) == "parallel.sequence=3 does not divide the model's 4 attention heads; choose 1, 2 or 4"
    with pytest.raises(UserError) as e:  # AutoTP splits the key/value heads too
        check_heads(ParallelDims(1, 1, 4), Heads(8, kv=2))
    assert str(e.value) == "parallel.tensor=4 does not divide the model's 2 key/value heads; choose 1 or 2"
    check_heads(ParallelDims(1, 4, 1), Heads(8, kv=2))  # Ulysses replicates key/value heads: fine
    with pytest.raises(UserError, match="parallel.sequence=2 does not divide .*; parallel.tensor=2 does not divide"):
        check_heads(ParallelDims(1, 2, 2), Heads(9, kv=3))  # every problem in one line
    check_heads(ParallelDims(4), Heads(3))  # all data-parallel: nothing is split


def test_autotp_shards_the_model_types_with_a_tensor_parallel_plan_and_what_it_splits_must_divide():
    """The plan DeepSpeed's AutoTP follows: the config's base_model_tp_plan and the causal-LM class's
    (lm_head, vocabulary-split then gathered). A model type without one, a size that does not divide
    what it splits: one line each, naming the numbers and the choices."""
    from transformers import AutoConfig

    llama = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                 intermediate_size=176, vocab_size=512)
    plan = tp_plan(llama)
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    for model_type in ("llama", "qwen2", "mistral"):
        check_tensor_model(ParallelDims(1, 1, 2), AutoConfig.for_model(model_type, intermediate_size=176,
                                                                       vocab_size=512))
    with pytest.raises(UserError) as e:
        check_tensor_model(ParallelDims(1, 1, 2), AutoConfig.for_model("gpt2"))
    assert str(e.value).startswith("parallel.tensor=2: model type 'gpt2' has no Hugging Face tensor-parallel plan, "
                                   "so AutoTP cannot shard it; tensor parallelism trains the model types whose")
    assert "use parallel.tensor=1 and ZeRO-3" in str(e.value)
    with pytest.raises(UserError) as e:
        check_tensor_model(ParallelDims(1, 1, 2), AutoConfig.for_model("llama", intermediate_size=175,
                                                                       vocab_size=32001))
    assert str(e.value) == ("parallel.tensor=2 does not divide the model's intermediate_size 175 (AutoTP splits it); "
                            "choose 1, 5, 7, 25 or 35; parallel.tensor=2 does not divide the model's vocab_size 32001 "
                            "(AutoTP splits it); choose 1 or 3"), str(e.value)
    with pytest.raises(UserError) as e:  # a style DeepSpeed rejects inside deepspeed.initialize: refused before
        check_tensor_model(ParallelDims(1, 1, 2), AutoConfig.for_model("phi3", intermediate_size=176,
                                                                       vocab_size=512))
    assert str(e.value).startswith("parallel.tensor=2: phi3's Hugging Face tensor-parallel plan uses "
                                   "'rowwise_split_input', which DeepSpeed's AutoTP does not take (it takes colwise, ")
    assert str(e.value).endswith("; for this model use parallel.tensor=1 and ZeRO-3 (ds_configs/zero3.json)")
    check_tensor_model(ParallelDims(2), AutoConfig.for_model("gpt2"))  # no tensor parallelism: anything goes


def test_tensor_parallelism_with_zero3_bf16_zero0_or_sequence_parallelism_is_one_line():
    def tp(sequence=1, dtype="auto"):
        return sp_config(parallel={"sequence": sequence, "tensor": 2}, model={"dtype": dtype})

    check_parallel(tp(), {"zero_optimization": {"stage": 2}})
    check_parallel(tp(), {"zero_optimization": {"stage": 1}})
    with pytest.raises(UserError) as e:
        check_parallel(tp(), {"zero_optimization": {"stage": 3}})
    assert str(e.value).startswith("parallel.tensor=2 with ZeRO-3: ds_train trains AutoTP with ZeRO 0-2")
    assert "use ds_configs/zero1.json or zero2.json, or parallel.tensor=1 to shard everything with ZeRO-3" in str(e.value)
    for template in ({}, {"zero_optimization": {"stage": 0}}):  # DeepSpeed's default stage is 0
        check_parallel(tp(dtype="fp32"), template)
        for dtype, shown in (("bf16", "bf16"), ("auto", "auto (bf16 on a GPU)")):
            with pytest.raises(UserError) as e:
                check_parallel(tp(dtype=dtype), template)
            assert str(e.value).startswith(f"parallel.tensor=2 with ZeRO-0 and model.dtype={shown}: DeepSpeed 0.19.8's "
                                           f"ZeRO-0 bf16/fp16 optimizer measures the gradient norm"), str(e.value)
            assert str(e.value).endswith("set model.dtype=fp32, or use ds_configs/zero1.json or zero2.json")
    with pytest.raises(UserError) as e:
        check_parallel(tp(sequence=2), {"zero_optimization": {"stage": 3}})
    assert "\n" not in str(e.value) and "; parallel.tensor=2 with parallel.sequence=2: DeepSpeed 0.19.8's AutoTP " \
        "replaces the Ulysses process groups with its own" in str(e.value)


def sp_config(**sections):
    from ds_train.config.file import build_config

    raw = {"output_dir": "/tmp/unused", "parallel": {"sequence": 2}, "train": {"seq_len": 64},
           "model": {"config": {"model_type": "llama"}}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return build_config(raw, source="test")


def test_what_ulysses_cannot_take_is_one_line_before_anything_is_written():
    from ds_train.plan.parallel import check_sequence

    check_sequence(sp_config(), {"zero_optimization": {"stage": 2}})
    check_sequence(sp_config(), {})  # ZeRO-0 is shown to keep the math (test_parity.py)
    check_sequence(sp_config(parallel={"sequence": 1}, train={"seq_len": 63}), {})  # no SP: nothing to check
    with pytest.raises(UserError) as e:
        check_sequence(sp_config(train={"seq_len": 100}, parallel={"sequence": 8}, model={"attn_implementation": "eager"},
                                 data={"format": "sft", "pack": True}),
                       {"zero_optimization": {"stage": 3, "reduce_scatter": False}})
    said = str(e.value)
    assert "\n" not in said and said.startswith("train.seq_len=100 is not divisible by parallel.sequence=8 (each "
                                                "sequence rank holds seq_len / 8 positions); choose 96 or 104; ")
    for needle in ("model.attn_implementation='eager' cannot run under parallel.sequence=8; use sdpa",
                   "zero_optimization.reduce_scatter=false with parallel.sequence=8", "remove the key",
                   "data.pack=true with parallel.sequence=8 and model.attn_implementation='eager'",
                   "use sdpa or flash_attention_2, or set data.pack=false"):
        assert needle in said.replace("8 (it needs the whole seq_len x seq_len mask on every rank)", "8"), needle
    check_sequence(sp_config(data={"format": "sft", "pack": True}), {})  # sdpa keeps packed examples apart
    with pytest.raises(UserError) as e:
        check_sequence(sp_config(data={"format": "sft", "pack": True}, model={"attn_implementation": "flex_attention"}),
                       {})
    assert "model.attn_implementation='flex_attention': its Ulysses attention is causal over the whole" in str(e.value)


def test_a_sliding_window_that_ulysses_would_drop_is_refused():
    from transformers import AutoConfig

    from ds_train.plan.parallel import check_window

    dims = ParallelDims(1, 2, 1)
    mistral = AutoConfig.for_model("mistral", sliding_window=32)
    with pytest.raises(UserError) as e:
        check_window(dims, mistral, "sdpa", 64)
    assert str(e.value) == ("the model attends within a sliding window of 32 tokens, which model.attn_implementation="
                            "'sdpa' loses under parallel.sequence=2 (Ulysses drops its mask); use flash_attention_2, "
                            "train.seq_len <= 32, or parallel.sequence=1")
    check_window(dims, mistral, "sdpa", 32)  # the window holds the whole sequence: no window at all
    check_window(dims, mistral, "flash_attention_2", 64)
    check_window(ParallelDims(2), mistral, "sdpa", 64)
    check_window(dims, AutoConfig.for_model("llama"), "sdpa", 64)


def test_gradients_are_divided_by_the_data_ranks_and_under_zero3_by_data_x_sequence():
    dims = ParallelDims(2, 4, 1)
    assert [dims.gradient_ranks(stage) for stage in range(4)] == [2, 2, 2, 8]
    assert ParallelDims(4).gradient_ranks(3) == 4


def test_the_batch_plan_counts_data_parallel_ranks():
    dims = plan_dims(ParallelConfig(sequence=2), 4)
    plan = plan_batch(16, 2, dims.data, 64, dims.derivation())
    assert (plan.data_parallel_size, plan.grad_accum_steps, plan.sequences_per_rank) == (2, 4, 8)
    assert "x data-parallel 2 (world 4)" in plan.describe(4)
    with pytest.raises(UserError) as e:
        plan_batch(10, 4, dims.data, 64, dims.derivation())
    assert str(e.value).startswith("train.global_batch_size=10 is not a multiple of train.micro_batch_size=4 x "
                                   "data-parallel size 2 (world size 4 / (parallel.sequence 2 x parallel.tensor 1)) "
                                   "= 8; use train.global_batch_size=8 or 16")


def test_a_deepspeed_outside_the_proven_range_is_named_with_the_workarounds_the_run_relies_on():
    import tomllib

    from conftest import ROOT
    from ds_train.plan.parallel import DEEPSPEED_PROVEN, deepspeed_range_note

    declared = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                if d.startswith("deepspeed")]
    low, high = DEEPSPEED_PROVEN
    assert declared == [f"deepspeed>={low},<{high}"]  # pyproject declares the range the code checks
    plain, sp, tp = sp_config(parallel={"sequence": 1}), sp_config(), sp_config(parallel={"sequence": 1, "tensor": 2})
    assert deepspeed_range_note(sp, "0.19.8") is None and deepspeed_range_note(sp, "0.19.9") is None
    assert deepspeed_range_note(plain, "0.21.0") is None  # no workaround of the range in use
    note = deepspeed_range_note(sp, "0.20.0")
    assert note.startswith("DeepSpeed 0.20.0 is outside the range") and "loss divisor under Ulysses" in note
    assert "AutoTP" not in note and "AutoTP process groups" in deepspeed_range_note(tp, "0.18.2")
