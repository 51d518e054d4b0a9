"""ds-train doctor against real failures: every fixture under tests/fixtures/doctor is either captured
(a log or run directory kept from a failure produced on this machine, `how` the command) or composed
(GPU-only failures: a real CPU run's console with lines in the formats torch and NCCL print on GPUs,
rebuilt byte for byte by its `generator`). MANIFEST.yaml says which, and what the doctor must say of
each: every finding's class, the rank and host it names, the file:line of every line it cites (each
checked against the fixture's own text), and the doctor_fixes.yaml entry its fixes come from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, ds_train
from ds_train.observe.doctor import PRIORITY, classify_line, diagnose
from ds_train.observe.doctor_fixes import FIXES

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"
MANIFEST = yaml.safe_load((FIXTURES / "MANIFEST.yaml").read_text())
CITED = re.compile(r"^(?P<file>\S+?):(?P<line>\d+): (?P<text>.*)$|^(?P<record>\S+?): (?P<said>.*)$", re.S)


def test_the_manifest_covers_every_class_and_its_fixtures_exist():
    classes = {e["expect"] for e in MANIFEST}
    assert classes >= set(PRIORITY) | {"none"}, set(PRIORITY) - classes
    for e in MANIFEST:
        assert (FIXTURES / e["path"]).exists(), e["path"]
        assert e.get("how") or e.get("source"), e["path"]


def inputs(entry) -> list[list[str]]:
    """What a user would give the doctor for this fixture: a log file; for a run, everything kept of
    the job together (the run directory, the console, a node's dmesg), then the run directory alone."""
    path = FIXTURES / entry["path"]
    if entry["kind"] == "log":
        return [[str(path)]]
    together = [str(p) for p in sorted(path.iterdir())]
    return [together, [str(path / "run")]] if (path / "run").is_dir() else [[str(path)]]


# Without dmesg an OOM kill looks like any SIGKILL: the run directory alone says "killed rank", with
# the OOM killer as its first fix.
ALONE = {"real/cpu_oom_killed": "killed_rank", "real/cpu_oom_killed_step": "killed_rank"}


def test_every_fixture_is_captured_with_its_command_or_composed_by_a_generator_in_the_repository():
    for e in MANIFEST:
        assert bool(e.get("captured")) != bool(e.get("composed")), e["path"]
        if e.get("captured"):
            assert e.get("how"), e["path"]
        else:
            assert (FIXTURES / e["generator"]).is_file() and e.get("source"), e["path"]
    # what was made without a GPU says so: a GPU-only fixture is composed, or names the GPU it was captured on
    assert all(e.get("composed") or e.get("device") for e in MANIFEST if e["path"].startswith("gpu/"))
    assert {e["path"] for e in MANIFEST if e.get("device")} == {"gpu/cuda_oom", "gpu/cuda_error", "gpu/op_build_arch.log"}


def test_the_composed_gpu_logs_are_what_their_generator_writes_byte_for_byte(tmp_path):
    script = FIXTURES / "gpu" / "compose_gpu_logs.py"
    res = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    made = [e["path"] for e in MANIFEST if e.get("generator") == "gpu/compose_gpu_logs.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(m).name for m in made)
    for path in made:
        assert (tmp_path / Path(path).name).read_bytes() == (FIXTURES / path).read_bytes(), path


def _location(entry, evidence: str) -> tuple[str, Path, int | None, str]:
    """(what the manifest calls it, the file, its line number or None for a record, the cited text)."""
    text = evidence.replace(f"{FIXTURES}/", "")
    m = CITED.match(text)
    assert m, evidence
    name = m.group("file") or m.group("record")
    base = FIXTURES / entry["path"]
    run = base / "run" if (base / "run").is_dir() else base
    path = FIXTURES / name if name.startswith(("real/", "gpu/")) else run / name
    if m.group("file"):
        return f"{name}:{m.group('line')}", path, int(m.group("line")), m.group("text")
    return name, path, None, m.group("said")


def _check_cited(entry, evidence: str) -> str:
    """The cited line is the fixture's own text at that file and line; a record says what is cited."""
    where, path, line, text = _location(entry, evidence)
    assert path.is_file(), (entry["path"], evidence)
    if line is not None:
        lines = path.read_text(errors="replace").splitlines()
        silent = re.match(r"the log ends without a word .*; its last line: (.*)$", text)
        if silent:  # a rank that died silently: the line cited is its log's last
            assert line == len(lines) and silent.group(1) == lines[-1][:160], (entry["path"], evidence)
        else:
            assert text == lines[line - 1].strip()[:300], (entry["path"], evidence)
    elif path.name in ("failure.json", "hang_report.json"):
        assert text == json.loads(path.read_text())["line"][:300], (entry["path"], evidence)
    return where


def _expected_fixes(cls: str, where: str, module: str) -> list[str]:
    """The doctor_fixes.yaml entry of `cls`, for the rank/host and module the manifest names."""
    values = {"on": f" on {where}" if where else "", "who": where or "a rank", "module": module,
              "stuck": f"{where} stopped making progress" if where else
                       "the hang report names the rank that never arrived"}
    return [line.format(**values) for line in FIXES[cls]]


@pytest.mark.parametrize("entry", MANIFEST, ids=[e["path"] for e in MANIFEST])
def test_each_fixture_gets_the_findings_evidence_and_fixes_its_manifest_says(entry):
    modes = inputs(entry)
    assert len(entry["doctor"]) == len(modes), entry["path"]
    for paths, expected in zip(modes, entry["doctor"]):
        findings = diagnose(*paths)
        got = [{"cls": f.cls, "where": f.where, "cites": [_check_cited(entry, e) for e in f.evidence]}
               for f in findings]
        assert got == expected, (paths, got)
        for f in findings:
            fixes = _expected_fixes(f.cls, f.where, entry.get("module", "?"))
            planned = 1 if f.cls == "cuda_oom" and entry["kind"] == "run" else 0  # the memory plan's fix first
            assert f.fixes[planned:] == fixes and len(f.fixes) == len(fixes) + planned, (entry["path"], f.cls)
    first = entry["doctor"][0]
    assert (first[0]["cls"] if first else "none") == entry["expect"]
    if entry.get("captured") and entry["expect"] != "none" and entry["path"] not in KEY_NOT_CITED:
        # the line the capture kept as telling the class (written down then, not by this doctor) is cited
        key = re.sub(r"^(\S+: )?(\[rank\d+\]: )?ds-train(\[rank \d+\])?: error: ", "", " ".join(entry["key"].split()))[:100]
        cited = [" ".join(e.split()) for f in diagnose(*modes[0]) for e in f.evidence]
        assert any(key.lstrip() in e for e in cited), (entry["path"], key)


# Captured keys the doctor does not cite, and why: the class shows in other lines.
KEY_NOT_CITED = {
    "real/hang_no_watchdog": "the key is the launcher's SIGTERM line; the heartbeats tell the hang",
    "real/rl_no_signal": "the class is told by metrics.jsonl's statistics (test_post_training_findings_cite_"
                         "the_runs_own_statistics), not by a log line",
    "real/rl_truncated": "as real/rl_no_signal",
    "real/rl_env_failing": "as real/rl_no_signal: metrics.jsonl's ript/env_failed_frac and env_failed/REASON tell it "
                           "(tests/test_environments.py)",
    "real/router_collapse": "as real/rl_no_signal: metrics.jsonl's expert load tells it (tests/test_routers.py)",
    "real/rollout_mismatch": "as real/rl_no_signal: metrics.jsonl's rollout/logp_diff_mean tells it",
    "real/rl_stale_dropped": "as real/rl_no_signal: metrics.jsonl's async/stale_dropped tells it "
                             "(tests/test_async_rl.py)",
    "real/rl_trainer_starved": "as real/rl_no_signal: metrics.jsonl's async/trainer_wait_s against perf/iteration_s "
                               "tells it",
    # Known gaps (the doctor's class and fixes are right, its evidence misses the clearest line):
    "real/rendezvous/console.log": "evidence stops at 3 lines; ds_train's own start-up line (40) comes after "
                                   "torch's store errors (2, 3, 21)",
    "real/ssh_master_addr/console.log": "the bare `ssh: connect to host ... port 22` line has no host prefix, so "
                                        "the doctor cites the CalledProcessError line (17) instead",
}


def test_the_first_fix_for_the_captured_cuda_oom_fits_by_the_peaks_an_h200_measured():
    """The CUDA OOM captured on an H200 (gpu/cuda_oom: the 124M Llama at micro-batch 512, ZeRO-2): the
    doctor's first fix is the largest micro-batch the plan says fits, and the peak the H200 measured
    for that model and stage (tests/fixtures/gpu/h200_memory.json: micro 4 and 16, linear in the
    micro-batch) puts that micro-batch within 10% of the plan, and within the GPU's memory."""
    from test_memory import H200

    run = FIXTURES / "gpu" / "cuda_oom" / "run"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["train"]["micro_batch_size"], cfg["model"]["config"]["hidden_size"]) == (512, 768)
    first = diagnose(str(run))[0]
    assert first.cls == "cuda_oom" and first.where == "rank 0 on vm"
    m = re.match(r"train\.micro_batch_size=(\d+) .*: the memory plan puts the per-GPU peak at ([\d.]+) GiB of "
                 r"([\d.]+) GiB \(this run: ([\d.]+) GiB planned\)", first.fixes[0])
    assert m, first.fixes[0]
    micro, planned, capacity = int(m.group(1)), float(m.group(2)), float(m.group(3))
    measured = {c["micro_batch_size"]: c["measured_gib"] for c in H200["cases"]
                if c["zero_stage"] == 2 and not c["activation_checkpointing"]}
    per_sample = (measured[16] - measured[4]) / 12
    at_fix = measured[4] + per_sample * (micro - 4)
    assert micro == 128 and capacity == pytest.approx(139.8, abs=0.05)
    assert planned == pytest.approx(at_fix, rel=0.10) and at_fix < 0.9 * capacity
    assert measured[4] + per_sample * (2 * micro - 4) > capacity  # twice that micro-batch would not have fit


def test_the_command_exits_1_on_a_problem_0_on_a_clean_run_and_2_on_no_such_path(tmp_path):
    bad = ds_train("doctor", str(FIXTURES / "gpu" / "cuda_oom" / "run"), timeout=120)
    assert bad.returncode == 1 and "1. CUDA out of memory (rank 0 on vm) [cuda_oom]" in bad.out, bad.out
    last = bad.out.strip().splitlines()[-1]
    assert re.fullmatch(rf"ds-train doctor: {re.escape(str(FIXTURES / 'gpu' / 'cuda_oom' / 'run'))}: \d+ finding\(s\); "
                        rf"the most likely cause: CUDA out of memory \(rank 0 on vm\) \[cuda_oom\]", last), last
    clean = ds_train("doctor", str(FIXTURES / "real" / "clean" / "run"), timeout=120)
    assert clean.returncode == 0, clean.out
    said = f"ds-train doctor: {FIXTURES / 'real' / 'clean' / 'run'}: nothing wrong found"
    assert clean.out.strip().splitlines()[-1] == said
    missing = ds_train("doctor", str(tmp_path / "nope"), timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.out


@pytest.mark.parametrize("line,cls", [
    # the forms a failing kernel or GPU takes in torch, cuBLAS / cuDNN and the kernel's log
    ("[rank3]: torch.AcceleratorError: CUDA error: an illegal memory access was encountered", "cuda_error"),
    ("RuntimeError: CUDA error: unspecified launch failure", "cuda_error"),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "cuda_error"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, m, n, k",
     "cuda_error"),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR", "cuda_error"),
    ("[Tue Nov 24 10:02:11 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", "cuda_error"),
    ("RuntimeError: The NVIDIA driver on your system is too old. CUDA driver version is insufficient for "
     "CUDA runtime version", "cuda_error"),
    # an allocation that fails is an OOM, whatever prints it; NCCL's lines stay NCCL's
    ("RuntimeError: CUDA error: out of memory", "cuda_oom"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error "
     "(run with NCCL_DEBUG=INFO for details)", "nccl_error"),
    ("[rank0]: RuntimeError: index 4 is out of bounds for dimension 0 with size 4", "rank_error"),
])
def test_a_cuda_error_is_told_from_an_oom_an_nccl_error_and_a_plain_exception(line, cls):
    assert classify_line(line) == cls


def test_an_earlier_attempt_in_a_rank_log_is_history(tmp_path):
    """A resumed run appends to its rank logs: what went wrong before the last start is not news."""
    log = tmp_path / "logs" / "rank_0.log"
    log.parent.mkdir(parents=True)
    log.write_text("2026-11-23 10:00:00.000 n0 rank0 log: pid 1 host n0 local_rank 0 node 0 world 2 launcher deepspeed\n"
                   "2026-11-23 10:01:00.000 n0 rank0 err: OSError: [Errno 28] No space left on device\n"
                   "2026-11-23 10:05:00.000 n0 rank0 log: pid 2 host n0 local_rank 0 node 0 world 2 launcher deepspeed\n"
                   "2026-11-23 10:06:00.000 n0 rank0 out: step 10: train/loss 5.1\n")
    assert diagnose(str(tmp_path)) == []
    with open(log, "a") as fh:
        fh.write("2026-11-23 10:07:00.000 n0 rank0 err: RuntimeError: boom\n")
    (finding,) = diagnose(str(tmp_path))
    assert finding.cls == "rank_error" and finding.evidence == [
        "logs/rank_0.log:5: 2026-11-23 10:07:00.000 n0 rank0 err: RuntimeError: boom"] and finding.where == "rank 0 on n0"


def test_post_training_findings_cite_the_runs_own_statistics(capsys):
    """The post-training findings quote metrics.jsonl's last syncs (their range, as percentages),
    and `ds-train doctor` prints the run's statistics at its last sync first."""
    from ds_train.observe.doctor import doctor

    for name, key, what in (("rl_no_signal", "ript/frac_reward_zero_std", "of the groups had K equal rewards"),
                            ("rl_truncated", "ript/truncated_frac", "of the rollouts were truncated")):
        run = FIXTURES / "real" / name / "run"
        synced = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r][-5:]
        values = [r[key] for r in synced]
        cited = next(e for f in diagnose(str(run)) if f.cls == name for e in f.evidence)
        assert cited == (f"metrics.jsonl: iterations {synced[0]['step']}-{synced[-1]['step']}: "
                         f"{min(values):.0%}-{max(values):.0%} {what}")
        assert doctor([str(run)]) == 1
        last = synced[-1]
        assert capsys.readouterr().out.splitlines()[0] == (
            f"ds-train doctor: {run}: post-training statistics at iteration {last['step']}: reward mean "
            f"{last['ript/reward_mean']:.3g}, reward std {last['ript/reward_std']:.3g}, groups with equal rewards "
            f"{last['ript/frac_reward_zero_std']:.3g}, truncated {last['ript/truncated_frac']:.3g}, held-out success "
            f"{last['eval/success']:.3g}")


def test_a_file_that_is_not_text_is_refused_as_not_a_log(tmp_path):
    """`ds-train doctor FILE` given a checkpoint's binary file: one line saying it is not a log, exit 2
    (before: "nothing wrong found", exit 0); a text log with odd bytes is still read."""
    from conftest import expect_error

    weights = tmp_path / "mp_rank_00_model_states.pt"
    weights.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    expect_error(["doctor", str(weights)], f"doctor: {weights} is not a log (binary data: a NUL byte at offset")
    log = tmp_path / "console.log"
    log.write_bytes(b"step 1: loss 2.0 \xff\xfe\nTraceback (most recent call last):\nValueError: x\n")
    from ds_train.observe.doctor import read_sources

    assert [len(s.lines) for s in read_sources(log)] == [3]


def test_a_growing_rollout_mismatch_is_named_and_a_steady_one_is_not(tmp_path):
    """vLLM's log-probs against the trainer's (ds_train/ript/update.py): the captured run whose engine never
    took the updated weights is named with its first and last figures; the same run with a steady
    mismatch (as a healthy bf16 run's, 1e-2) has no such finding."""
    import shutil

    run = FIXTURES / "real" / "rollout_mismatch" / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "rollout/logp_diff_mean" in r]
    first, last = synced[0], synced[-1]
    (finding,) = [f for f in diagnose(str(run)) if f.cls == "rollout_mismatch"]
    assert finding.evidence == [
        f"metrics.jsonl: rollout/logp_diff_mean {first['rollout/logp_diff_mean']:.2g} at iteration {first['step']} -> "
        f"{last['rollout/logp_diff_mean']:.2g} at iteration {last['step']} "
        f"({last['rollout/logp_diff_frac_over_0.1']:.0%} of the tokens off by more than 0.1)"]
    steady = tmp_path / "run"
    shutil.copytree(run, steady)
    (steady / "metrics.jsonl").write_text("".join(
        json.dumps(r | ({"rollout/logp_diff_mean": 0.012} if "rollout/logp_diff_mean" in r else {})) + "\n"
        for r in rows))
    assert "rollout_mismatch" not in {f.cls for f in diagnose(str(steady))}
    # the same drift in a run whose episodes were a step old by design (rollout ranks, ript.max_staleness 1): the
    # staleness's, not a sync that did not take
    stale = tmp_path / "stale"
    shutil.copytree(run, stale)
    (stale / "metrics.jsonl").write_text("".join(
        json.dumps(r | ({"async/staleness_max": 1.0} if r.get("step") == 2 else {})) + "\n" for r in rows))
    assert "rollout_mismatch" not in {f.cls for f in diagnose(str(stale))}
