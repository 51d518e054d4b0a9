"""The trainer through the real launchers: deepspeed (ZeRO 0-3, offload) and one process (torchrun: the
README's own torchrun command, run by tests/test_doc_commands.py, which checks the run knows its launcher)."""

from __future__ import annotations

import json
import math
import os
import socket

import pytest

from conftest import ROOT, deepspeed_train, ds_train, node_launch, run_cmd, tiny_config, write_config

pytestmark = pytest.mark.slow  # every test here runs the trainer through a launcher
STAGES = ["zero0", "zero1", "zero2", "zero3"]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_trained(res, run_dir, steps=8, world=2):
    assert res.returncode == 0, res.out[-4000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3, [m["loss"] for m in metrics]
    assert all(m["world_size"] == world for m in metrics)
    assert all(m["tokens_per_s"] > 0 and m["lr"] >= 0 for m in metrics)
    return metrics


@pytest.mark.parametrize("stage", STAGES)
def test_each_zero_stage_trains_through_the_deepspeed_launcher(stage, stage_run):
    res, run_dir = stage_run(stage)
    assert_trained(res, run_dir)
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 4, 1)
    assert ds["zero_optimization"]["stage"] == int(stage[-1])
    assert '"auto"' not in json.dumps(ds)
    env = json.loads((run_dir / "env.json").read_text())
    assert env["world_size"] == 2 and env["launcher"] == "deepspeed"
    assert env["hosts"] == [{"node": 0, "host": socket.gethostname(), "ranks": [0, 1]}]
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank_0.log", "rank_1.log", "train.log"}
    assert {p.name for p in (run_dir / "heartbeats").iterdir()} == {"rank_0.json", "rank_1.json"}
    beats = [json.loads((run_dir / "heartbeats" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [b["status"] for b in beats] == ["ended", "ended"] and all(b["step"] == 8 for b in beats)
    console = (run_dir / "logs" / "train.log").read_text()
    out = res.out.replace("\r", "")  # the ranks' lines interleave there: each of rank 0's lines is in it
    assert "step 8: train/loss" in console and all(line in out for line in console.splitlines())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 8 and results["tokens"] == 8 * 8 * 64
    # the start-up, phase by phase from the process's creation to the end of the first step: rank 0 says it
    # once, every rank logs its own, results.json keeps rank 0's
    phases = results["startup_s"]
    assert list(phases) == ["imports", "inputs", "process group", "model", "engine", "run set-up", "resume",
                            "first step"] and all(s >= 0 for s in phases.values())
    assert 0 < sum(phases.values()) < 600 and phases["imports"] > 0
    said = res.lines("start-up: ")
    assert len(said) == 1 and said[0].rsplit(", ", 1)[-1].startswith("first step "), said
    assert float(said[0].rsplit(" ", 1)[-1]) == pytest.approx(phases["first step"], abs=0.06)  # 0.1 s printed
    assert all("start-up: " in (run_dir / "logs" / f"rank_{r}.log").read_text() for r in (0, 1))
    assert console.splitlines()[-1] == (  # rank 0's last line: how the run ended and where it went
        f"train: done, 8 steps, final loss {results['final_train_loss']:.4g}, eval loss "
        f"{results['final_eval_loss']:.4g}; checkpoint step_00000008; run directory {run_dir.resolve()}")
    assert len(res.lines("batch: global 8 seqs = micro 4 x accum 1 x world 2")) == 1  # printed once
    cores = len(os.sched_getaffinity(0))  # the 2 ranks split them: not 2 x `cores` threads fighting over them
    threads = f"threads: {max(1, cores // 2)} per rank ({cores} cores shared by 2 ranks on this node"
    assert len(res.lines(threads)) == 1 and all(threads in (run_dir / "logs" / f"rank_{r}.log").read_text()
                                                for r in (0, 1)), res.out[-2000:]
    # a finished run plots its metrics (memory per rank from one gather) and says where
    assert res.lines(f"plots: {run_dir}/plots/{{loss,lr,throughput,memory}}.png"), res.out[-2000:]
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["loss.png", "lr.png", "memory.png",
                                                                     "throughput.png"]
    assert all(len(m["mem/rank_rss_gib"]) == 2 and m["mem/max_rank_rss_gib"] == max(m["mem/rank_rss_gib"])
               for m in read_metrics(run_dir))


def test_zero_stages_agree_on_the_loss(stage_run):
    """Same weights, same data, same AdamW, one micro-step per step: ZeRO 0-2 reduce each gradient as
    the same sum over the two ranks and agree on every step to 1e-6, bitwise on the first two (ZeRO-1
    recomputing activations too). ZeRO-3 starts from the same weights (step 1 bitwise); its partitioned parameters and
    reduce-scatter buckets may then move the last bits."""
    losses = {stage: [m["loss"] for m in read_metrics(stage_run(stage)[1])] for stage in STAGES}
    assert len(losses["zero0"]) == 8
    for stage in ("zero1", "zero2"):  # bitwise until the warm-up trained from the first update (2026-11-26):
        assert losses[stage][:2] == losses["zero0"][:2], stage  # since, ZeRO-1 moves the last bits from step 3
        assert losses[stage] == pytest.approx(losses["zero0"], rel=1e-6, abs=0), stage
    assert losses["zero3"][0] == losses["zero0"][0]
    assert losses["zero3"] == pytest.approx(losses["zero0"], rel=1e-5)


def test_wandb_offline_run_is_written_by_rank_0_only(stage_run):
    res, run_dir = stage_run("zero2")
    assert res.returncode == 0
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in runs[0].iterdir())
    assert not list(ROOT.glob("wandb/offline-run-*"))  # nothing leaked into the working directory


def test_tensorboard_events_hold_the_metrics_and_deepspeeds_own_monitors_still_write(stage_run):
    from test_metrics import read_events

    res, run_dir = stage_run("zero2")
    assert res.returncode == 0
    events = read_events(run_dir / "tensorboard")
    losses = {m["step"]: m["train/loss"] for m in read_metrics(run_dir)}
    assert [s for s, _ in events["train/loss"]] == list(range(1, 9))
    assert all(v == pytest.approx(losses[s], rel=1e-6) for s, v in events["train/loss"])
    assert {"optim/lr", "perf/tokens_per_s", "perf/straggler_ratio"} <= set(events)
    out = run_dir.parent
    ds_events = read_events(next((out / "ds_tb").rglob("events.out.tfevents.*")).parent)
    assert any(tag.startswith("Train/Samples/") for tag in ds_events), ds_events.keys()
    assert list((out / "ds_csv").rglob("*.csv")), list((out / "ds_csv").rglob("*"))


def test_logged_loss_is_the_token_weighted_mean_over_all_ranks(stage_run, tiny_data):
    """Step-1 loss of the 2-process run against the global batch's loss computed in one process
    with the model's own (Hugging Face) loss path."""
    import torch

    from ds_train.config.file import build_config
    from ds_train.data.datasets import TokenData, rank_micro_batches
    from ds_train.data.meta import load_meta
    from ds_train.model.build import build_model, seed_all
    from ds_train.model.hfconfig import build_hf_config

    res, run_dir = stage_run("zero0")
    assert res.returncode == 0
    cfg = build_config(tiny_config(tiny_data, run_dir))
    meta = load_meta(tiny_data)
    seed_all(cfg.seed)
    model = build_model(cfg.model, build_hf_config(cfg.model, meta["vocab_size"], 64),
                        {"zero_optimization": {"stage": 0}}, cfg.seed).model
    data = TokenData(tiny_data / "train.bin", meta["dtype"], 64, cfg.seed)
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for batch in rank_micro_batches(data, 0, 8, 8, data_rank=0, data_parallel=1):
            ids = torch.from_numpy(batch)
            mean = model(input_ids=ids, labels=ids).loss  # HF shifts labels itself
            n = ids[:, 1:].numel()
            loss_sum, tokens = loss_sum + float(mean) * n, tokens + n
    assert read_metrics(run_dir)[0]["loss"] == pytest.approx(loss_sum / tokens, rel=1e-5)


@pytest.mark.parametrize("ds_config", ["zero2_offload.json", "zero3_offload.json"])
def test_offload_configs_run_on_the_cpu(ds_config, tiny_data, tmp_path):
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run"))
    res = deepspeed_train(cfg, ds_config, timeout=600)  # the first run JIT-compiles cpu_adam
    assert_trained(res, tmp_path / "run")
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_single_process_form_with_eval_sample_and_checkpoint(tiny_data, tmp_path):
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, tmp_path / "run", train={"eval_every": 4},
        checkpoint={"save_final": True, "export_final": True},
        log={"every": 2, "sample_prompt": "def", "sample_tokens": 8, "sample_repetition_penalty": 1.3}))
    res = ds_train("train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero0.json"),
                   "optim.lr_scaling=linear", "optim.reference_batch_size=16",  # global 8: half the lr
                   "model.liger_kernels=true")  # no GPU here: one line, and the run goes on without them
    assert res.returncode == 0, res.out[-4000:]
    assert ("model.liger_kernels: Liger's kernels are Triton kernels for a CUDA GPU, and this run is on cpu; it "
            "goes on without them") in res.out
    assert "lr 0.005 (optim.lr 0.01, scaling linear)" in res.out  # as RIPT's (test_ript_trainer.py)
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["optimizer"]["params"]["lr"] == 0.005  # WarmupCosineLR scales from the optimizer lr
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [2, 4, 6, 8]
    evals = [m for m in metrics if "eval/loss" in m]
    assert [m["step"] for m in evals] == [4, 8]
    assert all(math.isclose(m["eval/ppl"], math.exp(m["eval/loss"]), rel_tol=1e-6) for m in evals)
    assert metrics[-1]["world_size"] == 1
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["sample"].startswith("def") and len(results["sample"]) > 3
    assert "--- sample ---" in res.out
    assert res.out.strip().splitlines()[-1] == (
        f"train: done, 8 steps, final loss {results['final_train_loss']:.4g}, eval loss "
        f"{results['final_eval_loss']:.4g}; checkpoint step_00000008; run directory {(tmp_path / 'run').resolve()}")
    assert (tmp_path / "run" / "checkpoints" / "step_00000008").is_dir()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = tmp_path / "run" / "hf_export_step_00000008"
    assert results["export"] == str(exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.use_cache is True  # training switched the cache off per call, not in the config
    tokenizer = AutoTokenizer.from_pretrained(exported)  # the sample is greedy: the same weights say the same
    greedy = model.generate(tokenizer("def", return_tensors="pt").input_ids, do_sample=False, max_new_tokens=8,
                            min_new_tokens=8, repetition_penalty=1.3, pad_token_id=tokenizer.eos_token_id)
    assert results["sample"] == tokenizer.decode(greedy[0], skip_special_tokens=True)


def test_the_loss_is_a_mean_over_all_tokens_when_ranks_hold_different_counts(tmp_path):
    """Rank 0 holds 4 target tokens, rank 1 holds 120: a mean of per-rank means would weigh rank
    0's tokens 30 times as much."""
    res = run_cmd([*node_launch(), str(ROOT / "tests" / "uneven_loss.py"), str(tmp_path)], timeout=180, env={"PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.out[-3000:]
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["tokens"] for r in ranks] == [4, 120]
    assert ranks[0]["token_mean"] == ranks[1]["token_mean"]  # one all-reduce: every rank the same
    assert ranks[0]["token_mean"] == pytest.approx(ranks[0]["reference"], rel=1e-9)
    assert abs(ranks[0]["token_mean"] - ranks[0]["mean_of_means"]) > 1e-3


def _chat_records(n: int) -> list[dict]:
    """Arithmetic conversations: a system turn, a question, an answer (and a second pair in a third)."""
    out = []
    for i in range(n):
        a, b = i % 17, (i * 7) % 13
        messages = [{"role": "system", "content": "Answer with the number."},
                    {"role": "user", "content": f"{a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "times 2?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]
        out.append({"messages": messages})
    return out


def test_fine_tuning_a_local_pretrained_model_on_conversations_lowers_the_held_out_loss_and_resumes_exactly(tmp_path):
    """model.path + data.format sft through the deepspeed launcher: packed examples, loss on the
    assistant's tokens, held-out assistant loss before and after, and an exact resume mid-run."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY_MODEL
    from ds_train.data.datasets import SftData, eval_micro_batches
    from ds_train.data.meta import load_meta
    from ds_train.data.tokenizer import train_tokenizer
    from ds_train.train.losses import forward_loss
    from test_data import CHAT_TEMPLATE

    records = _chat_records(240)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model_dir = tmp_path / "pretrained"  # a local Hugging Face directory: weights, config, tokenizer + template
    tok = train_tokenizer([json.dumps(r) for r in records], 300, model_dir, CHAT_TEMPLATE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": len(tok)})) \
        .save_pretrained(model_dir)
    cfg = tiny_config(tmp_path / "data", tmp_path / "run", model={"path": str(model_dir)},
                      data={"sources": [str(tmp_path / "chat.jsonl")], "format": "sft", "val_fraction": 0.2},
                      train={"max_steps": 24, "micro_batch_size": 4, "global_batch_size": 16, "seq_len": 96,
                             "eval_every": 24, "eval_batches": 3},
                      optim={"lr": 3e-3, "warmup_steps": 2}, checkpoint={"every": 12, "save_final": True},
                      log={"every": 1})
    del cfg["model"]["config"]
    config = write_config(tmp_path / "sft.yaml", cfg)
    res = deepspeed_train(config, str(ROOT / "ds_configs" / "zero2.json"))
    assert res.returncode == 0, res.out[-4000:]
    said = [line for line in res.out.splitlines() if "data: sft, " in line]
    assert said and " packed into " in said[0] and "% non-pad tokens)" in said[0], said
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, 25))

    # The held-out loss of the model before fine-tuning, as the evaluator computes it (both ranks' batches).
    meta = load_meta(tmp_path / "data")
    val = SftData(tmp_path / "data", "val", meta["dtype"], 96, 7, True, "drop", meta["eos_token_id"], False)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        parts = [forward_loss(model, b) for r in range(2) for b in eval_micro_batches(val, 3, 4, r, 2)]
    before = sum(float(p[0]) for p in parts) / sum(p[1] for p in parts)
    after = metrics[-1]["eval/loss"]
    assert after < before - 1.0, (before, after)

    # Resume from the save at step 12 in a fresh run directory: the same batches, the same losses.
    res = deepspeed_train(config, str(ROOT / "ds_configs" / "zero2.json"), f"output_dir={tmp_path / 'resumed'}",
                          f"checkpoint.resume={tmp_path / 'run' / 'checkpoints' / 'step_00000012'}")
    assert res.returncode == 0, res.out[-4000:]
    resumed = read_metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == list(range(13, 25))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in metrics[12:]]
