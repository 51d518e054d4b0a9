"""ds_train.observe.metrics (peak FLOP/s, MFU, loggers) and the pure helpers of ds_train.model.build."""

from __future__ import annotations

import json
import math
import time

import pytest

from ds_train.checkpoint.rundir import TRAIN, RunPaths
from ds_train.model.build import flops_per_token, lookup_params, resolve_dtype
from ds_train.observe.metrics import JsonlLogger, NullLogger, build_logger, mfu, peak_flops


# --- peak FLOP/s and MFU -------------------------------------------------------------------------

@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A10G", 70.0),
    ("NVIDIA A10", 125.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA L4", 121.0),
    ("Tesla V100-SXM2-32GB", 125.0),
    ("AMD Instinct MI300X", 1307.0),
    ("nvidia h100 pcie", 756.0),  # case-insensitive; PCIe part, not SXM
])
def test_peak_flops_lookup(name, tflops):
    assert peak_flops(name, 0.0) == pytest.approx(tflops * 1e12)


def test_h100_is_989_tflops():
    assert peak_flops("NVIDIA H100 80GB HBM3", 0.0) == pytest.approx(989e12)


def test_override_wins_over_the_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", 500.0) == pytest.approx(500e12)
    assert peak_flops("cpu", 2.5) == pytest.approx(2.5e12)


@pytest.mark.parametrize("name", ["cpu", "x86_64", "Intel(R) Xeon(R) Platinum 8480+",
                                  "AMD EPYC 7763 64-Core Processor", "NVIDIA GeForce RTX 3090", ""])
def test_unknown_devices_have_no_peak(name):
    assert peak_flops(name, 0.0) is None


def test_mfu_arithmetic():
    # 1000 tokens/s x 6e9 FLOPs/token = 6e12 FLOP/s achieved, out of 60e12 -> 10 %.
    assert mfu(1000.0, 6e9, 60e12) == pytest.approx(0.1)
    assert mfu(2000.0, 6e9, 60e12) == pytest.approx(0.2)
    assert mfu(0.0, 6e9, 60e12) == 0.0


def test_mfu_without_a_peak_is_none():
    assert mfu(1000.0, 6e9, None) is None
    assert mfu(1000.0, 6e9, 0.0) is None


def test_mfu_end_to_end_on_h100():
    fpt = flops_per_token(n_params=125_000_000, n_layers=12, hidden=768, seq_len=1024)
    value = mfu(100_000.0, fpt, peak_flops("NVIDIA H100 80GB HBM3", 0.0))
    assert value == pytest.approx(100_000 * fpt / 989e12)
    assert 0 < value < 1


# --- loggers -------------------------------------------------------------------------------------

def test_jsonl_logger_writes_one_object_per_call(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log({"train/loss": 2.5, "optim/lr": 1e-3, "perf/tokens_per_s": 1234.5, "world_size": 2}, step=1)
    logger.log({"train/loss": 2.25, "eval/loss": 2.4, "optim/lr": 9e-4}, step=2)
    lines = path.read_text().splitlines()  # flushed per line: readable before close
    logger.close()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first["step"] == 1
    assert first["train/loss"] == first["loss"] == 2.5
    assert first["optim/lr"] == first["lr"] == 1e-3
    assert first["perf/tokens_per_s"] == first["tokens_per_s"] == 1234.5
    assert first["world_size"] == 2
    assert abs(second.pop("time") - time.time()) < 60  # when it was written (the monitor's ETA)
    assert second == {"step": 2, "train/loss": 2.25, "loss": 2.25, "eval/loss": 2.4,
                      "optim/lr": 9e-4, "lr": 9e-4}


def test_jsonl_logger_keeps_non_finite_values_as_valid_json(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log({"train/loss": math.nan, "optim/grad_norm": math.inf}, step=3)
    logger.close()
    text = path.read_text()
    record = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert record["loss"] == "nan" and record["optim/grad_norm"] == "inf"


def test_jsonl_logger_appends_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        logger = JsonlLogger(path)
        logger.log({"train/loss": 1.0}, step=step)
        logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_non_main_rank_gets_a_logger_that_writes_nothing(tmp_path, capsys):
    # wandb never touched
    logger = build_logger(False, RunPaths(tmp_path), "online", "proj", {"seed": 1}, TRAIN.console_keys)
    assert isinstance(logger, NullLogger)
    logger.log({"train/loss": 1.0, "optim/lr": 1e-3}, step=1)
    logger.close()
    assert list(tmp_path.iterdir()) == []
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_main_rank_logger_writes_jsonl_and_console(tmp_path, capsys):
    logger = build_logger(True, RunPaths(tmp_path), "off", "proj", {"seed": 1}, TRAIN.console_keys)
    logger.log({"train/loss": 1.5, "perf/tokens_per_s": 100.0}, step=4)
    logger.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["step"] == 4 and record["loss"] == 1.5 and record["tokens_per_s"] == 100.0
    out = capsys.readouterr().out
    assert "step 4" in out and "train/loss 1.5" in out
    assert not (tmp_path / "wandb_id.txt").exists()


# --- ds_train.model.build pure helpers -----------------------------------------------------------------

def test_flops_per_token_is_6n_plus_attention():
    assert flops_per_token(n_params=1_000_000, n_layers=4, hidden=128, seq_len=256) == (
        6 * 1_000_000 + 12 * 4 * 128 * 256)


def test_an_untied_input_embedding_does_no_matmul():
    from transformers import LlamaConfig

    untied = LlamaConfig(vocab_size=32000, hidden_size=2048, tie_word_embeddings=False)
    tied = LlamaConfig(vocab_size=32000, hidden_size=2048, tie_word_embeddings=True)
    assert lookup_params(untied) == 32000 * 2048 and lookup_params(tied) == 0
    assert flops_per_token(10**9, 22, 2048, 2048, lookup_params(untied)) == (
        flops_per_token(10**9, 22, 2048, 2048) - 6 * 32000 * 2048)


def test_flops_per_token_known_value():
    # GPT-2 small-ish: 6 * 124M + 12 * 12 * 768 * 1024
    assert flops_per_token(124_000_000, 12, 768, 1024) == 744_000_000 + 113_246_208


def test_flops_per_token_attention_term_grows_with_seq_len():
    short = flops_per_token(10_000, 2, 64, 128)
    long = flops_per_token(10_000, 2, 64, 256)
    assert long - short == 12 * 2 * 64 * 128


@pytest.mark.parametrize("choice, device, bf16_ok, expected", [
    ("auto", "cuda", True, "bf16"),
    ("auto", "cuda", False, "fp32"),
    ("auto", "cpu", True, "fp32"),
    ("auto", "cpu", False, "fp32"),
    ("fp16", "cuda", True, "fp16"),
    ("bf16", "cpu", False, "bf16"),  # an explicit choice is kept as given
    ("fp32", "cuda", True, "fp32"),
])
def test_resolve_dtype(choice, device, bf16_ok, expected):
    assert resolve_dtype(choice, device, bf16_ok) == expected


def test_interval_is_every_n_and_the_last_step():
    from ds_train.observe.metrics import Interval

    assert [s for s in range(1, 11) if s in Interval(4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if s in Interval(0, 10)] == [10]


def test_an_empty_log_writes_nothing(tmp_path):
    logger = build_logger(True, RunPaths(tmp_path), "off", "p", {}, TRAIN.console_keys)
    logger.log({}, 1)  # a step where no component reported
    logger.log({"train/loss": 2.0}, 2)
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2]


def test_rewind_keeps_records_up_to_the_step_and_drops_a_line_cut_short(tmp_path):
    from ds_train.observe.metrics import rewind_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    assert rewind_jsonl(path, 2) == 1  # the damaged line is counted, not a traceback
    assert path.read_text() == '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
    assert rewind_jsonl(path, -1) == 0 and path.read_text() == ""  # a fresh run starts afresh
    assert rewind_jsonl(tmp_path / "absent.jsonl", 3) == 0


def test_a_metrics_write_that_fails_is_one_line_naming_the_file():
    from pathlib import Path

    from ds_train.errors import UserError
    from ds_train.observe.metrics import JsonlLogger

    logger = JsonlLogger(Path("/dev/full"))  # every write: ENOSPC
    with pytest.raises(UserError, match=r"/dev/full: writing step 3's metrics failed \(No space left on device\); "
                                        r"free space and launch again"):
        logger.log({"train/loss": 1.0}, 3)
    logger.close()


def read_events(log_dir) -> dict[str, list[tuple[int, float]]]:
    """The scalars as TensorBoard itself reads them (its event accumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_sink_writes_events_that_tensorboard_reads_and_a_resume_redoes_its_steps(tmp_path):
    from ds_train.observe.metrics import TensorBoardLogger

    first = TensorBoardLogger(tmp_path / "tb")
    for step in (1, 2, 3):
        first.log({"train/loss": 5.0 - step, "optim/lr": 0.1, "mem/rank_rss_gib": [1.0, 2.0], "world_size": 2}, step)
    first.close()
    events = read_events(tmp_path / "tb")
    assert events["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert "mem/rank_rss_gib" not in events and events["world_size"][0] == (1, 2.0)
    resumed = TensorBoardLogger(tmp_path / "tb")  # resumed from the checkpoint of step 1
    resumed.log({"train/loss": 1.5}, 2)
    resumed.close()
    assert read_events(tmp_path / "tb")["train/loss"] == [(1, 4.0), (2, 1.5)]
