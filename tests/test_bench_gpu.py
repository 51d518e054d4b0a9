"""bench/gpu's scripts end to end in their reduced CPU mode (a tiny model, a few steps), so they do
not rot between the sessions that have a GPU. What they measure is checked on the GPU; here, that
every side runs, every figure is computed and written, and the OOM report's fix is parsed and run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cmd
from ds_train.plan.planner import USABLE

_spec = importlib.util.spec_from_file_location("lease", ROOT / "bench" / "gpu" / "lease.py")
lease = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lease)

pytestmark = pytest.mark.slow


def bench(script: str, out, tiny_data, *extra: str, timeout: float = 600):
    r = run_cmd([sys.executable, str(ROOT / "bench" / "gpu" / script), "--out", str(out), "--reduced",
                 "--data", str(tiny_data), *extra], timeout=timeout)
    assert r.returncode == 0, r.out[-3000:]
    return r


def test_mfu_measures_every_side_and_the_ratios(tiny_data, tmp_path):
    """Every side but `ckpt` (ds_train's own side again, with activation checkpointing on: the
    checkpointing itself is tested in tests/test_model.py), `eager` (here ds_train's default is
    eager) and `compile` (ds_train's side again with model.compile=true: inductor's C++ build of its
    graphs was half of this test's time; every layer compiled through ds-train and keeping
    the math is tests/test_parity.py's Ulysses run); `liger` says in one line that its kernels need a
    GPU and trains without them. Reduced, the ds_train sides are the jobs of one process and bare and
    hf share another (two launches, not six). `liger_max` takes the largest micro-batch the plan says
    fits (on a CPU, 80 GiB: the search's cap, 8x the given one). Then startup.py reads the ds_train and
    bare sides' start-up clocks from the results (--from-mfu), phase by phase."""
    sides = ["ds_train", "bare", "hf", "fused_loss", "liger", "liger_max"]
    r = bench("mfu.py", tmp_path, tiny_data, "--sides", ",".join(sides))
    d = json.loads((tmp_path / "mfu.json").read_text())
    assert list(d["sides"]) == sides
    for side, s in d["sides"].items():
        assert s["tokens_per_s"] > 0 and s["steps"] == d["timed_steps"], (side, s)
    assert set(d["ratios"]) == {f"ds_train/{s}" for s in sides[1:]} and all(x > 0 for x in d["ratios"].values())
    big = d["sides"]["liger_max"]
    assert big["micro_batch_size"] == 8 * d["micro_batch_size"] and 0 < big["predicted_gib"] < 80
    assert configs_micro(tmp_path, "liger_max") == (big["micro_batch_size"], big["micro_batch_size"] * d["grad_accum"])
    assert list(d["sides"]["bare"]["startup_s"]) == ["imports", "model", "engine", "first step"]
    configs = {s: yaml.safe_load((tmp_path / "configs" / f"{s}.yaml").read_text())
               for s in sides if s not in ("bare", "hf")}
    assert configs["fused_loss"]["train"]["fused_loss"] is True and configs["liger"]["model"]["liger_kernels"]
    assert "compile" not in configs["ds_train"]["model"]
    assert "Liger's kernels are Triton kernels for a CUDA GPU" in (tmp_path / "runs" / "liger" / "logs" /
                                                                  "rank_0.log").read_text()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["bare_hf.log", "ds_train_sides.log"]
    assert d["versions"]["deepspeed"] and d["versions"]["device"] == "cpu" and d["peak_flops"] is None
    assert "ds_train/hf:" in r.out and "results:" in r.out
    # the jobs of one process (the reduced form) clock each run from its own start
    assert list(d["sides"]["ds_train"]["startup_s"]) == ["inputs", "process group", "model", "engine", "run set-up",
                                                        "resume", "first step"]
    r = bench("startup.py", tmp_path / "startup", tiny_data, "--from-mfu", str(tmp_path / "mfu.json"))
    s = json.loads((tmp_path / "startup" / "startup.json").read_text())
    totals = {side: sum(d["sides"][side]["startup_s"].values()) for side in ("ds_train", "bare")}
    assert s["total_s"] == pytest.approx(totals)
    assert s["difference_s"] == pytest.approx(totals["ds_train"] - totals["bare"])
    excess = [row["excess_s"] for row in s["phases"]]
    assert excess == sorted(excess, reverse=True) and {row["phase"] for row in s["phases"]} == set(
        d["sides"]["ds_train"]["startup_s"])
    model = next(row for row in s["phases"] if row["phase"] == "model")
    assert model["bare_s"] == d["sides"]["bare"]["startup_s"]["model"] and "launch to first step:" in r.out


def configs_micro(out, side: str) -> tuple[int, int]:
    train = yaml.safe_load((out / "configs" / f"{side}.yaml").read_text())["train"]
    return train["micro_batch_size"], train["global_batch_size"]


def test_compiled_layers_under_dpo_against_eager_and_the_plan(tiny_data, tmp_path):
    """compiled.py's DPO layout (the one that writes a base model and prepares preference pairs): its
    compiled run (inductor on this CPU) and its eager one as the jobs of one process, each with the plan's
    peak and its losses; on a CPU fp32 the two agree far inside the bf16 tolerance."""
    r = bench("compiled.py", tmp_path, tiny_data, "--layouts", "dpo")
    d = json.loads((tmp_path / "compiled.json").read_text())
    (row,) = d["layouts"]
    assert row["layout"] == "dpo" and row["error"] is None and set(row["runs"]) == {"compiled", "eager"}
    for run in row["runs"].values():
        assert len(run["losses"]) == d["steps"] == 3 and run["predicted_gib"] > 0
    assert row["loss_max_rel_diff"] < 1e-4 and row["losses_within"]
    logs = {side: (tmp_path / "runs" / f"dpo_{side}" / "logs" / "rank_0.log").read_text() for side in row["runs"]}
    assert "model.compile: torch.compile" in logs["compiled"] and "model.compile" not in logs["eager"]
    assert (tmp_path / "policy" / "config.json").is_file() and "losses compiled vs eager" in r.out


def test_memory_predicts_and_measures_each_case(tiny_data, tmp_path):
    bench("memory.py", tmp_path, tiny_data)
    d = json.loads((tmp_path / "memory.json").read_text())
    assert [(c["zero_stage"], c["micro_batch_size"]) for c in d["cases"]] == [(2, 2), (3, 2)]
    for c in d["cases"]:
        assert c["error"] is None and c["predicted_gib"] > 0 and c["measured_kind"] == "process RSS growth"
        assert c["relative_error"] is None or c["relative_error"] > -1
    assert d["tolerance"] == 0.10


def test_oom_report_fix_is_parsed_and_runs(tiny_data, tmp_path):
    bench("oom.py", tmp_path, tiny_data)
    d = json.loads((tmp_path / "oom.json").read_text())
    first = d["attempts"][0]
    assert first["micro_batch_size"] == 2 and first["exit"] == 0
    assert first["predicted_gib"] > USABLE * d["gpu_memory_gib"]  # beyond what the plan may fill
    assert "out of GPU memory" in d["oom_report"] and " fits " in d["oom_report"]
    assert d["fix"]["change"][1:] == ["train.micro_batch_size=1"] and d["fix"]["exit"] == 0 and d["verified"]


def test_steps_overhead_precision_checkpoint_export(tiny_data, tmp_path):
    bench("steps.py", tmp_path, tiny_data)
    d = json.loads((tmp_path / "steps.json").read_text())
    assert d["overhead"]["median_ratio"] > 0
    p = d["precision"]
    assert set(p["bf16"]) == set(p["fp32"]) and len(p["bf16"]) >= 3
    assert 0 < p["max_relative_difference"] < 0.01  # bf16 really ran, and agrees with fp32 early on
    c = d["checkpoint"]
    assert c["resume"] and c["save_s"] is not None and c["load_s"] is not None and c["bytes"] > 0
    assert d["export"]["bytes"] > 0 and (tmp_path / "export" / "config.json").is_file()


def test_one_lease_runs_its_parts_in_order_skips_what_does_not_fit_and_packs_one_archive(tiny_data, tmp_path):
    """bench/gpu/lease.py, the one command a GPU session runs: `capture` runs (a CUDA error through
    ds_train under the real deepspeed launcher, kept as a doctor fixture is kept; on this CPU it is
    torch's IndexError and no OOM can happen), `mfu` needs more than the budget and is skipped, and
    everything comes back in one archive without checkpoints or weights."""
    out = tmp_path / "out"
    # The GPU host as the first lease met it: a corpus prepared under another Python (its stdlib
    # fingerprint names 3.12.3), TORCH_CUDA_ARCH_LIST with an arch-specific entry, no nvcc. The run
    # configs name the corpus by its directory (the bundled one too: the test above), so it trains; on
    # a CPU the arch list and nvcc meet no build (test_engine checks those through DeepSpeed's builder).
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_data, corpus)
    meta = json.loads((corpus / "meta.json").read_text())
    meta.update(sources=["python-stdlib"], fingerprint=str({"version": 1, "sources": [
        {"source": "python-stdlib", "kind": "stdlib", "python": "3.12.3", "files": {}}]}))
    (corpus / "meta.json").write_text(json.dumps(meta))
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvcc").exists())
    r = run_cmd([sys.executable, str(ROOT / "bench" / "gpu" / "lease.py"), "--out", str(out), "--reduced",
                 "--data", str(corpus), "--parts", "capture,mfu", "--budget", "140"], timeout=300,
                env={**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0a", "PATH": path})
    assert r.returncode == 1, r.out[-3000:]  # not every part ran
    d = json.loads((out / "lease.json").read_text())
    assert list(d["parts"]) == ["capture", "mfu"] and d["parts"]["capture"]["exit"] == 0
    assert d["parts"]["mfu"]["skipped"].startswith("needs ~230 s") and "lease: " in r.out
    cap = json.loads((out / "work" / "capture" / "capture.json").read_text())["captures"]
    err = cap["cuda_error"]
    assert cap["cuda_oom"]["skipped"] and err["exit"] == 1 and err["expect"] == "rank_error"
    assert err["how"].startswith("deepspeed --num_gpus 1 ")
    assert err["how"].endswith("watchdog.debug_fault=device_assert:0:3")
    together, alone = err["doctor"]
    assert together[0]["cites"][0].startswith("gpu/cuda_error/console.log:") and alone[0]["where"] == "rank 0 on vm"
    console = (out / "work" / "capture" / "cuda_error" / "console.log").read_text()
    assert "IndexError: index 4 is out of bounds for dimension 0 with size 4" in console
    with tarfile.open(out / "lease.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"lease/capture/capture.json", "lease/capture/cuda_error/console.log",
            "lease/capture/cuda_error/run/logs/rank_0.log"} <= names
    assert not any(n.endswith(".ds_train.lock") for n in names if "/cuda_error/run/" in n)
    # what stays out of the archive: checkpoint and weight directories, files past 4 MiB
    (tmp_path / "w" / "runs" / "a" / "checkpoints").mkdir(parents=True)
    (tmp_path / "w" / "runs" / "a" / "checkpoints" / "state.pt").write_bytes(b"x")
    (tmp_path / "w" / "big.bin").write_bytes(b"\0" * (5 << 20))
    (tmp_path / "w" / "results.json").write_text("{}")
    lease.pack(tmp_path / "w", tmp_path / "w.tar.gz")
    with tarfile.open(tmp_path / "w.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["lease", "lease/results.json", "lease/runs", "lease/runs/a"]
    # a part past its time: every process it started goes, also one in a session of its own
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                              env={**os.environ, lease.TAG: "t-1"})
    assert lease.reap("t-0") == 0 and lease.reap("t-1") == 1
    assert orphan.wait(timeout=30) == -signal.SIGKILL


def test_a_prepared_corpus_is_named_by_its_directory_alone_so_no_host_fingerprint_is_checked(tmp_path, monkeypatch):
    """On 2026-11-26 the GPU host (Python 3.12) refused the bundled corpus prepared here (3.11): its
    source, python-stdlib, is fingerprinted by the host's own standard library. A prepared corpus is
    now named by its directory alone; only an unprepared bundled corpus names its source."""
    common = sys.modules["common"]
    corpus = tmp_path / "python_stdlib"
    monkeypatch.setattr(common, "DEFAULT_DATA", corpus)
    unprepared = common.run_config(tmp_path, "a", common.TINY, str(corpus), seq=64, micro=1, global_batch=1,
                                   steps=1, dtype="fp32")
    corpus.mkdir()
    (corpus / "meta.json").write_text("{}")
    prepared = common.run_config(tmp_path, "b", common.TINY, str(corpus), seq=64, micro=1, global_batch=1,
                                 steps=1, dtype="fp32")
    import yaml

    assert yaml.safe_load(unprepared.read_text())["data"]["sources"] == ["python-stdlib"]
    assert yaml.safe_load(prepared.read_text())["data"] == {"dir": str(corpus)}
