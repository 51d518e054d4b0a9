"""ds-train doctor against real failures: every fixture under tests/fixtures/doctor (logs and run
directories kept from failures produced on this machine, GPU-only ones in the exact formats torch
and NCCL print; MANIFEST.yaml says how each was made and where each format comes from) is
classified as its manifest says, with the first fix of its class."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import ds_train
from ds_train.doctor import PRIORITY, diagnose

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"
MANIFEST = yaml.safe_load((FIXTURES / "MANIFEST.yaml").read_text())


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


@pytest.mark.parametrize("entry", MANIFEST, ids=[e["path"] for e in MANIFEST])
def test_each_fixture_is_classified_as_its_manifest_says(entry):
    for i, paths in enumerate(inputs(entry)):
        expect = ALONE.get(entry["path"], entry["expect"]) if i else entry["expect"]
        findings = diagnose(*paths)
        if expect == "none":
            assert findings == [], [(f.cls, f.evidence) for f in findings]
            continue
        assert findings, paths
        first = findings[0]
        assert first.cls == expect, (paths, [(f.cls, f.evidence[:1]) for f in findings])
        assert first.evidence and first.fixes
        if entry.get("where"):
            assert entry["where"] in first.where, (first.where, entry["where"])


def test_the_first_fix_for_a_cuda_oom_is_a_configuration_the_memory_planner_says_fits():
    """Apply the doctor's first fix to the run's own config and ds_config, plan it again: it fits."""
    from ds_train.configfile import load_config
    from ds_train.dryrun import run_estimate
    from ds_train.plan import Target

    run = FIXTURES / "gpu" / "cuda_oom_run"
    first = diagnose(str(run))[0]
    assert first.cls == "cuda_oom" and first.where == "rank 3 on gpu017"
    fix = first.fixes[0]
    m = re.match(r"(--ds-config (\S+)|(\S+=\S+)).*the memory plan puts the per-GPU peak at ([\d.]+) GiB of 79.1 GiB", fix)
    assert m, fix
    ds_config = str(Path("ds_configs") / Path(m.group(2)).name) if m.group(2) else "ds_configs/zero1.json"
    overrides = [m.group(3)] if m.group(3) else []
    cfg = load_config(str(run / "config.yaml"), overrides)
    rows = run_estimate(cfg, ds_config, Target(1, 8, 79.11), None)["rows"]
    given = next(r for r in rows if r["given"])
    assert given["fits"] and given["gpu_peak_gib"] == pytest.approx(float(m.group(4)), abs=0.06)
    before = next(r for r in run_estimate(load_config(str(run / "config.yaml")), "ds_configs/zero1.json",
                                          Target(1, 8, 79.11), None)["rows"] if r["given"])
    assert not before["fits"]  # the run as it was does not


def test_the_command_exits_1_on_a_problem_0_on_a_clean_run_and_2_on_no_such_path(tmp_path):
    bad = ds_train("doctor", str(FIXTURES / "gpu" / "cuda_oom_run"), timeout=120)
    assert bad.returncode == 1 and "1. CUDA out of memory (rank 3 on gpu017) [cuda_oom]" in bad.out, bad.out
    clean = ds_train("doctor", str(FIXTURES / "real" / "clean" / "run"), timeout=120)
    assert clean.returncode == 0 and clean.out.strip().endswith("nothing wrong found"), clean.out
    missing = ds_train("doctor", str(tmp_path / "nope"), timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.out


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
