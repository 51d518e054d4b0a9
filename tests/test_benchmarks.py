"""ds_train/benchmarks.py and the benchmarks section: lm-evaluation-harness tasks checked in one line before
anything runs, and scored as lm_eval itself scores the export (`ds-train eval`). Offline: the tasks are
recipes/lm_eval/'s over the repository's files (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TESTS_ON_PATH, deepspeed_train, ds_train, ript_config, run_cmd, tiny_config, write_config
from test_preference import pref_data  # noqa: F401  (a fixture)
from ds_train.benchmarks import check_gen_kwargs, check_tasks, metrics
from ds_train.config.file import load_config
from ds_train.errors import UserError

MODEL = "model.config={model_type: llama, hidden_size: 64, num_attention_heads: 4}"
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def lm_eval_itself(export: Path, tasks: str, limit: int, out: Path) -> dict:
    """lm_eval's own command line on an export (its HF backend, no dtype given: the export's own, batch 4, the
    shipped tasks): its results."""
    res = run_cmd([str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
                   f"pretrained={export}", "--tasks", tasks, "--include_path",
                   str(ROOT / "recipes" / "lm_eval"), "--limit", str(limit), "--batch_size", "4", "--device", "cpu",
                   "--output_path", str(out)], timeout=300, env=OFFLINE)
    assert res.returncode == 0, res.out[-3000:]
    return json.loads(next(out.rglob("results_*.json")).read_text())["results"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_the_section_is_checked_with_the_run_config():
    """every, limit and num_fewshot out of range, each named with its bound; a benchmarks key set with no tasks
    is refused as ignored; the section relates itself to train.eval_every and ript.eval_every in its help."""
    from ds_train.config import RunConfig
    from ds_train.config.file import describe

    for override, needle in (("benchmarks.every=-2", "override benchmarks.every=-2: must be positive"),
                             ("benchmarks.every=0", "override benchmarks.every=0: must be positive"),
                             ("benchmarks.limit=-1", "override benchmarks.limit=-1: must be >= 0"),
                             ("benchmarks.num_fewshot=-3", r"override benchmarks.num_fewshot=-3: must be >= -1"),
                             ("benchmarks.batch_size=0", "override benchmarks.batch_size=0: must be positive")):
        with pytest.raises(UserError, match=needle):
            load_config(None, ["benchmarks.tasks=[arith_words]", override], command="train")
    for value in ("ten", "2.5", "true"):
        with pytest.raises(UserError, match=rf"override benchmarks.every={value}: must be an integer or null"):
            load_config(None, ["benchmarks.tasks=[arith_words]", f"benchmarks.every={value}"], command="train")
    assert load_config(None, [MODEL, "benchmarks.tasks=[arith_words]"], command="train").benchmarks.every is None
    with pytest.raises(UserError, match=r"override benchmarks.limit=5: set, but only lm-eval tasks "
                                        r"\(benchmarks.tasks\) uses"):
        load_config(None, [MODEL, "benchmarks.limit=5"], command="train")
    cfg = load_config(None, [MODEL, "benchmarks.tasks=[arith_words]", "benchmarks.every=50"], command="ript")
    assert isinstance(cfg, RunConfig) and cfg.benchmarks.every == 50 and cfg.benchmarks.at_end
    text = describe()
    assert "benchmarks.tasks" in text and "train.eval_every" in text.split("benchmarks", 1)[1]
    assert "  benchmarks.every = null\n" in text  # as YAML writes it


def test_each_task_lm_eval_would_stop_on_is_one_line_before_anything_runs(tmp_path):
    """A name lm_eval does not know (with the nearest it does), a task file that is missing, not YAML, names no
    task, or does not build (its data file missing), lm_eval not installed, a layout scoring in the run does not
    take (AutoEP): each one line naming benchmarks.tasks and the fix. The shipped tasks and a task file of
    one's own build. `ds-train eval` on a path that is no run or export, with no tasks, or a bad flag: one line,
    exit 2, before lm_eval's index of tasks is built."""
    (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    (tmp_path / "nodata.yaml").write_text(
        "task: nodata\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: /nonexistent/problems.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n")
    own = tmp_path / "own.yaml"
    own.write_text((ROOT / "recipes" / "lm_eval" / "arith_choice.yaml").read_text().replace(
        "task: arith_choice", "task: my_choice").replace("recipes/data/", str(ROOT / "recipes" / "data") + "/"))
    shipped = (ROOT / "recipes" / "lm_eval" / "arith_choice.yaml").read_text().replace(
        "recipes/data/", str(ROOT / "recipes" / "data") + "/")
    (tmp_path / "misspelt.yaml").write_text(shipped.replace("task: arith_choice", "task: misspelt").replace(
        "metric: acc_norm", "metric: acc_nrom"))  # lm_eval warns and scores the others (or nothing)
    (tmp_path / "unsafe.yaml").write_text(shipped.replace("task: arith_choice", "task: unsafe") + "unsafe_code: true\n")
    cases = [(["arith_wrds"], r"^benchmarks.tasks: 'arith_wrds' is not a task lm_eval knows \(did you mean "
                              r"'arith_words'\?\); give a name from `lm-eval ls tasks`"),
             ([str(tmp_path / "gone.yaml")], r"gone.yaml: no such task file; give the path of a task YAML"),
             ([str(tmp_path / "broken.yaml")], r"broken.yaml: not YAML \(.*\); fix the task file$"),
             ([str(tmp_path / "nameless.yaml")], r"nameless.yaml: names no task \(a task file has `task: NAME`"),
             ([str(tmp_path / "nodata.yaml")], r"^benchmarks.tasks: task 'nodata' does not build \(.*problems.jsonl"
                                               r".*\); fix its task file .*nodata.yaml$"),
             ([str(tmp_path / "misspelt.yaml")], r"^benchmarks.tasks: task 'misspelt': metric 'acc_nrom' is not one "
                                                 r"lm_eval knows .*; fix metric_list in its task file "
                                                 r".*misspelt.yaml$"),
             ([str(tmp_path / "unsafe.yaml")], r"^benchmarks.tasks: task 'unsafe' runs the model's generated code "
                                               r"\(unsafe_code\); set benchmarks.confirm_run_unsafe_code=true")]
    for tasks, needle in cases:
        with pytest.raises(UserError, match=needle):
            check_tasks(tasks)
    import ds_train.benchmarks as benchmarks

    real = benchmarks.installed
    benchmarks.installed = lambda: False
    try:
        with pytest.raises(UserError, match=r"^benchmarks.tasks: needs lm_eval, which is not installed; pip install "
                                            r"-e '.\[eval\]' \(or pip install 'lm_eval==0.4.13'\)"):
            check_tasks(["arith_words"])
    finally:
        benchmarks.installed = real
    from ds_train.benchmarks import check_section

    with pytest.raises(UserError, match=r"^benchmarks.tasks: scoring inside a run with parallel.expert=2 is not built "
                                        r".*`ds-train eval RUN_DIR --tasks \.\.\.`"):
        check_section(load_config(None, [MODEL, "benchmarks.tasks=[arith_words]", "parallel.expert=2"], command="train"))
    got = check_tasks(["arith_words", "arith_choice", "python_lines", str(own)])
    assert got.names == ("arith_words", "arith_choice", "python_lines", "my_choice") and str(tmp_path) in got.include
    assert check_tasks([str(tmp_path / "unsafe.yaml")], unsafe_code=True).names == ("unsafe",)
    with pytest.raises(UserError, match=r"^benchmarks.gen_kwargs: 'max_new_tokenz' is no generation argument \(did "
                                        r"you mean 'max_new_tokens'\?\)"):  # generate() would raise at the scoring
        check_section(load_config(None, [MODEL, "benchmarks.tasks=[arith_words]",
                                         "benchmarks.gen_kwargs={max_new_tokenz: 8}"], command="train"))
    check_gen_kwargs({"max_gen_toks": 8, "until": ["x"], "temperature": 0, "top_k": 5})
    hf_model, bare, damaged = tmp_path / "run" / "hf_model", tmp_path / "bare", tmp_path / "damaged"
    for where in (hf_model, bare, damaged):
        where.mkdir(parents=True)
        (where / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "run" / "config.yaml").write_text("output_dir: run\n")
    (damaged / "model.safetensors").write_bytes(b"garbage")
    for args, needle in (((str(tmp_path / "nothere"),), "'{0}/nothere' is not a directory; give a run directory"),
                         ((str(tmp_path),), "eval: no tasks: {0} names none (its benchmarks.tasks), so give --tasks"),
                         ((str(tmp_path), "--tasks", "arith_words"), "'{0}' holds no checkpoints (no checkpoints/"),
                         ((str(tmp_path), "--tasks", "arith_words", "--limit", "-1"), "--limit: -1 must be >= 0"),
                         ((str(hf_model), "--tasks", "arith_words"), "eval: '{0}/run/hf_model' is a run's model config "
                                                                     "and tokenizer, not an export; give the run "
                                                                     "directory '{0}/run'"),
                         ((str(bare), "--tasks", "arith_words"), "eval: '{0}/bare' holds no weights (model.safetensors"),
                         ((str(damaged), "--tasks", "arith_words"), "eval: '{0}/damaged' does not load as a causal LM "
                                                                    "(SafetensorError: ")):
        said = ds_train("eval", *args)
        assert said.returncode == 2 and needle.format(tmp_path) in said.out and "Traceback" not in said.out, said.out
    assert metrics({"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1}}}) == \
        {"bench/t/acc,none": 0.5}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ds_train_eval_on_a_run_and_on_its_export_gives_lm_evals_own_scores(straight_zero2, tmp_path):
    """`ds-train eval` on a ZeRO-2 run directory (its newest complete tag exported on the fly, named with the newer
    damaged one it skipped) and on `ds-train export` of it, and lm_eval's own command line on the export: the same
    scores to 4 decimals, in results files lm_eval's own writer wrote; and a run directory without tasks or a bad
    flag is one line."""
    import shutil

    export, damaged = tmp_path / "export", tmp_path / "damaged_run"
    assert ds_train("export", str(straight_zero2), "--out", str(export), env=OFFLINE).returncode == 0
    shutil.copytree(straight_zero2 / "checkpoints", damaged / "checkpoints")
    shutil.copytree(straight_zero2 / "hf_model", damaged / "hf_model")
    (damaged / "checkpoints" / "step_00000016").mkdir()  # a save cut short: newer than the last whole one
    (damaged / "checkpoints" / "step_00000016" / "ds_train_rank_0.pt").write_bytes(b"cut short")
    flags = ["--tasks", "arith_choice,arith_words", "--limit", "24", "--batch-size", "4"]
    scores = {}
    for name, path in (("run", damaged), ("export", export)):
        res = ds_train("eval", str(path), *flags, "--out", str(tmp_path / name), env=OFFLINE)
        assert res.returncode == 0, res.out[-3000:]
        assert "|arith_choice|" in res.out and f"lm_eval's results in {tmp_path / name}" in res.out
        tag = (f" at step_00000012 (skipped step_00000016 (incomplete: a save that did not finish))"
               if name == "run" else "")
        assert f"eval: arith_choice, arith_words on {path}{tag}: lm_eval's results" in res.out, res.out[-1000:]
        scores[name] = json.loads(next((tmp_path / name).rglob("results_*.json")).read_text())["results"]
    scores["lm_eval"] = lm_eval_itself(export, "arith_choice,arith_words", 24, tmp_path / "lm_eval")
    keys = [("arith_choice", "acc,none"), ("arith_choice", "acc_norm,none"), ("arith_words", "exact_match,none")]
    got = {name: [round(s[t][k], 4) for t, k in keys] for name, s in scores.items()}
    assert got["run"] == got["export"] == got["lm_eval"], got
    assert all(s["arith_choice"]["sample_len"] == 24 for s in scores.values())
    res = ds_train("eval", str(straight_zero2), env=OFFLINE)
    assert res.returncode == 2 and "eval: no tasks:" in res.out and "give --tasks" in res.out
    res = ds_train("eval", str(straight_zero2), "--tasks", "arith_choice", "--batch-size", "0", env=OFFLINE)
    assert res.returncode == 2 and "argument --batch-size: 0 must be >= 1" in res.out


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ds_config, lora, parallel, dtype", [("zero2.json", True, {}, "bf16"),
                                                               ("zero3.json", True, {}, "bf16"),
                                                               ("zero2.json", False, {"tensor": 2}, "fp32"),
                                                               ("zero2.json", False, {"sequence": 2}, "fp32")],
                         ids=["zero2_lora_bf16", "zero3_lora_bf16", "zero2_autotp2", "zero2_ulysses2"])
def test_the_live_models_scores_are_lm_evals_own_on_the_export_of_the_same_tag(ds_config, lora, parallel, dtype,
                                                                                tiny_data, tmp_path):
    """Two processes train 4 steps scoring arith_choice at the start and every 2 steps: the live model's scores at
    step 2 (weights walked together: ZeRO-3's and AutoTP's shards gathered, LoRA merged; scored on rank 0 in the
    run's dtype, under Ulysses with the attention it replaced) equal, to 4 decimals, those of lm_eval's own command
    line, with no dtype given, on `ds-train export` of the step-2 tag, which is in the run's dtype and says so in
    its config.json (bf16: in-run and export agree on it); every scoring is in metrics.jsonl and results.json, no
    scored copy is left in the run directory, and log_samples keeps each document's record.
    ZeRO-3's last scoring raises (benchmarks.debug_fault=4): the run finishes, its checkpoint of step 4 committed
    before the scoring (rank 0's log says so in that order), the scoring named as skipped in the console,
    metrics.jsonl and results.json. Resumed to step 6: step 4 is scored again (its checkpoint held the scorings
    before it, the run's benchmarks/scores.json the skipped one) and results.json lists every scoring of the run,
    those before the resume too."""
    from ds_train.checkpoint.commit import is_complete

    run = tmp_path / "run"
    cfg = tiny_config(tiny_data, run, train={"max_steps": 4}, checkpoint={"every": 2, "keep": 0},
                      benchmarks={"tasks": ["arith_choice"], "every": 2, "at_start": True, "limit": 16,
                                  "batch_size": 4, "log_samples": lora and ds_config == "zero2.json"})
    cfg["model"]["dtype"] = dtype
    if lora:
        cfg["model"]["lora"] = {"rank": 4}
    if parallel:  # AutoTP's shards gathered by the walk; Ulysses' attention not the scoring model's
        cfg["parallel"] = parallel
    zero3 = ds_config == "zero3.json"
    res = deepspeed_train(write_config(tmp_path / "run.yaml", cfg), ds_config,
                          *(["benchmarks.debug_fault=4"] if zero3 else []), timeout=600, env=OFFLINE)
    assert res.returncode == 0, res.out[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    live = {r["step"]: (r["bench/arith_choice/acc,none"], r["bench/arith_choice/acc_norm,none"])
            for r in rows if "bench/arith_choice/acc,none" in r}
    assert sorted(live) == ([0, 2] if zero3 else [0, 2, 4]), live
    results = json.loads((run / "results.json").read_text())
    assert [b["step"] for b in results["benchmarks"]] == [0, 2, 4]
    assert not [p.name for p in run.iterdir() if p.name.startswith("benchmarks_")]  # no scored copy left
    if cfg["benchmarks"]["log_samples"]:
        assert len((next((run / "benchmarks" / "step_00000002").glob("samples_arith_choice_*.jsonl"))
                    .read_text().splitlines())) == 16
    if zero3:  # the last scoring raised: skipped, named; the run finished with its final checkpoint
        skipped = results["benchmarks"][2]
        assert skipped["scores"] == {} and "benchmarks.debug_fault" in skipped["skipped"], skipped
        assert [r["step"] for r in rows if r.get("benchmarks/skipped") == 1] == [4], rows
        assert "benchmarks: the scoring of step 4 failed and is skipped (RuntimeError: injected failure" in res.out
        assert is_complete(run / "checkpoints" / "step_00000004") and "train: done, 4 steps" in res.out, res.out[-3000:]
        log = (run / "logs" / "rank_0.log").read_text()
        assert log.index("saved checkpoint step_00000004") < log.index("benchmarks: the scoring of step 4 failed")
    export = tmp_path / "export"
    res = ds_train("export", str(run), "--tag", "step_00000002", "--out", str(export), *(["--merge"] if lora else []),
                   env=OFFLINE)
    assert res.returncode == 0, res.out[-3000:]
    assert json.loads((export / "config.json").read_text())["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    own = lm_eval_itself(export, "arith_choice", 16, tmp_path / "lm_eval")["arith_choice"]
    assert (round(own["acc,none"], 4), round(own["acc_norm,none"], 4)) == tuple(round(v, 4) for v in live[2]), \
        (own, live)
    if zero3:  # resumed to step 6: step 4 scored again, results.json keeps the scorings before the resume
        res = deepspeed_train(tmp_path / "run.yaml", ds_config, "train.max_steps=6", timeout=600, env=OFFLINE)
        assert res.returncode == 0, res.out[-3000:]
        results = json.loads((run / "results.json").read_text())
        assert [b["step"] for b in results["benchmarks"]] == [0, 2, 4, 6], results["benchmarks"]
        assert "skipped" not in results["benchmarks"][2] and results["benchmarks"][2]["scores"], results["benchmarks"]
        assert results["benchmarks"][1]["scores"]["bench/arith_choice/acc,none"] == live[2][0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_rl_run_scores_its_starting_and_final_policy_into_ript_results(tiny_policy, tmp_path):
    """RIPT on two processes under ZeRO-0 with benchmarks at the start and the end: the scores in metrics.jsonl at
    iterations 0 and 2 beside the held-out success, in ript_results.json under benchmarks, in `ds-train monitor` and
    in `ds-train plot`'s benchmarks.png."""
    from test_ript_trainer import ript_args

    config = ript_config(tmp_path, tiny_policy)
    cfg = yaml.safe_load(config.read_text())
    cfg["benchmarks"] = {"tasks": ["arith_choice"], "at_start": True, "limit": 8, "batch_size": 4}
    config.write_text(yaml.safe_dump(cfg))
    args = ript_args(config)
    args[args.index("--ds-config") + 1] = str(ROOT / "ds_configs" / "zero0.json")
    res = run_cmd(args, timeout=500, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in rows if "bench/arith_choice/acc,none" in r}
    assert sorted(scored) == [0, 2] and "eval/success" in scored[0], scored
    results = json.loads((tmp_path / "run" / "ript_results.json").read_text())
    assert [b["step"] for b in results["benchmarks"]] == [0, 2]
    assert results["benchmarks"][1]["scores"]["bench/arith_choice/acc,none"] == \
        scored[2]["bench/arith_choice/acc,none"]
    shown = ds_train("monitor", str(tmp_path / "run"), "--once")
    assert "lm-eval at iteration 2: arith_choice/acc,none" in shown.out, shown.out
    plotted = ds_train("plot", str(tmp_path / "run"), "--out", str(tmp_path / "plots"))
    assert plotted.returncode == 0 and (tmp_path / "plots" / "benchmarks.png").is_file(), plotted.out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_preference_run_scores_its_policy_as_lm_eval_scores_its_export(pref_data, tmp_path):
    """DPO (data.format: preference) on two processes under ZeRO-1, scored every 2 steps: the policy's scores at
    step 2 are lm_eval's own on the export of step 2 (the reference model is not what is scored)."""
    from test_preference import dpo_run

    config = dpo_run(pref_data, tmp_path / "run", checkpoint={"every": 2, "keep": 0},
                     benchmarks={"tasks": ["arith_choice"], "every": 2, "limit": 16, "batch_size": 4})
    res = deepspeed_train(config, "zero1.json", timeout=600, env=OFFLINE)
    assert res.returncode == 0, res.out[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    live = {r["step"]: r["bench/arith_choice/acc,none"] for r in rows if "bench/arith_choice/acc,none" in r}
    assert sorted(live) == [2, 4, 6, 7], live
    export = tmp_path / "export"
    assert ds_train("export", str(tmp_path / "run"), "--tag", "step_00000002", "--out", str(export),
                    env=OFFLINE).returncode == 0
    own = lm_eval_itself(export, "arith_choice", 16, tmp_path / "lm_eval")["arith_choice"]
    assert round(own["acc,none"], 4) == round(live[2], 4), (own, live)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_scoring_stuck_in_a_forward_is_a_hang_of_rank_0_not_of_the_ranks_waiting_for_it(tiny_data, tmp_path):
    """The watchdog times each forward of rank 0's scoring model, not the whole scoring, and not the others' wait:
    rank 0 stuck in the first forward of its at_start scoring (watched: the loop's watch starts before it) ends the
    job with exit 5 within stall_s, naming rank 0 in phase scoring; rank 1, which waits for the scores from before
    then, is not the one named; the job killed in the middle of the scoring leaves no scored copy in the run
    directory (the model is built in memory)."""
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 4},
                      benchmarks={"tasks": ["arith_choice"], "at_start": True, "limit": 8, "batch_size": 4})
    stall_s = 8
    res = deepspeed_train(write_config(tmp_path / "run.yaml", cfg), "zero2.json", f"watchdog.stall_s={stall_s}",
                          "watchdog.debug_fault=stall:0:0", timeout=240, env=OFFLINE)
    assert res.returncode == 5, res.out[-4000:]
    report = [line for line in res.out.splitlines() if line.startswith("ds-train: error: hang")]
    assert len(report) == 1 and f"no progress for {stall_s} s (watchdog.stall_s): rank 0 on node 0" in report[0] \
        and "stalled in phase scoring of step 0" in report[0], res.out[-4000:]
    beats = {r: json.loads((tmp_path / "run" / "heartbeats" / f"rank_{r}.json").read_text()) for r in (0, 1)}
    assert beats[0]["phase"] == "scoring" and beats[1]["phase"] == "wait-scores", beats
    stacks = (tmp_path / "run" / "logs" / "stacks_rank_0.txt").read_text()
    assert "in _injected_stall" in stacks and "in _evaluate" in stacks, stacks[:2000]
    # rank 0 was killed in the middle of its scoring: no scored copy of the model is left in the run directory
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("benchmarks_")]


def test_local_tasks_reach_for_no_network_and_hub_tasks_are_left_to_the_environment(tmp_path):
    """The shipped tasks and task files over local data are scored offline whatever the environment says
    (datasets would otherwise count each load of a local file with a request to the hub's servers: checked with
    the offline variables set to 0, it makes them); lm_eval's own tasks and task files over hub datasets are not
    taken offline."""
    from ds_train.benchmarks import resolve

    hub = tmp_path / "hub.yaml"
    hub.write_text("task: my_hub\ndataset_path: openai/gsm8k\n")
    assert resolve(["python_lines", "arith_words", str(ROOT / "recipes" / "lm_eval" / "arith_choice.yaml")]).local
    assert not resolve(["python_lines", "hellaswag"]).local and not resolve([str(hub)]).local
    code = """
import json, os, socket, sys
asked = []
real = socket.getaddrinfo
socket.getaddrinfo = lambda host, *a, **k: asked.append(host) or real(host, *a, **k)
from ds_train.benchmarks import check_tasks
check_tasks(sys.argv[1:])
print(json.dumps({"asked": asked, "offline": os.environ.get("HF_DATASETS_OFFLINE")}))
"""
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    for env, offline in ((clean, "1"), ({**clean, "HF_DATASETS_OFFLINE": "0", "HF_HUB_OFFLINE": "0"}, "0")):
        res = run_cmd([sys.executable, "-c", code, "python_lines", "arith_choice"], timeout=120, env=env)
        assert res.returncode == 0, res.out[-2000:]
        said = json.loads(res.out.strip().splitlines()[-1])
        assert said["offline"] == offline and (said["asked"] == [] if offline == "1" else said["asked"]), said


def test_a_scoring_leaves_the_generators_as_they_were_and_keeps_its_samples(tiny_policy, tmp_path):
    """lm_eval reseeds python's, numpy's and torch's global generators (random_seed, numpy_random_seed,
    torch_random_seed): after `evaluate` each draws what it would have drawn without the scoring, and the model is
    back in training mode. With log_samples each document's record is kept, written as lm_eval writes it. A chat
    template the tokenizer lacks is refused in one line."""
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_train.benchmarks import check_chat_template, evaluate, write_samples
    from ds_train.config.benchmarks import BenchmarksConfig

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_policy), AutoTokenizer.from_pretrained(tiny_policy)
    model.train()
    cfg = BenchmarksConfig(tasks=["arith_choice"], limit=4, batch_size=4, log_samples=True)
    tasks = check_tasks(cfg.tasks)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    expected = random.random(), np.random.rand(), torch.rand(1).item()
    random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])
    results = evaluate(model, tok, cfg, tasks)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected and model.training
    assert len(results["samples"]["arith_choice"]) == 4 and "bench/arith_choice/acc,none" in metrics(results)
    written = write_samples(results, tmp_path / "benchmarks", "step_00000002")
    rows = [json.loads(x) for x in next(written.glob("samples_arith_choice_*.jsonl")).read_text().splitlines()]
    assert len(rows) == 4 and {"doc", "target", "acc"} <= set(rows[0]), rows[0].keys()
    check_chat_template(tok, False)
    with pytest.raises(UserError, match=r"^benchmarks.apply_chat_template: True, but the tokenizer has no chat "
                                        r"template; set benchmarks.apply_chat_template=false"):
        check_chat_template(tok, True)


def test_the_waiting_ranks_deadline_and_rank_0s_memory_are_their_own_lines():
    """The other ranks wait for rank 0's scores in the rendezvous store (a channel passed in here: a dict), at most
    benchmarks.wait_s, then raise what they are given; a resume merges its checkpoint's scorings with rank 0's file
    of them up to its step; a scoring that cannot fit rank 0 (2x the model in host
    memory, a copy on its GPU) is one line naming what it needs, what is free and `ds-train eval` on a tag."""
    import time

    from ds_train.benchmarks import scoring_memory_problem
    from ds_train.plan.memory import GiB
    from ds_train.train.benchmarks import merged, wait_for

    class Store(dict):
        def get(self, key):
            return super().get(key)

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="late"):
        wait_for(Store(), "benchmarks/scores/4", 0.5, lambda: TimeoutError("late"))
    assert 0.5 <= time.monotonic() - start < 2
    assert wait_for(Store({"benchmarks/scores/4": "[]"}), "benchmarks/scores/4", 0.5, lambda: None) == "[]"
    # a resume at step 4 takes the file's scorings after its checkpoint up to step 4, not those of the lost steps
    saved, written = [{"step": 0}, {"step": 2}], [{"step": 0}, {"step": 2}, {"step": 4, "skipped": "E"}, {"step": 6}]
    assert merged(saved, written, 4) == [{"step": 0}, {"step": 2}, {"step": 4, "skipped": "E"}]
    said = scoring_memory_problem(8 * 10**9, "bf16", True, 20 * GiB, 10 * GiB)
    assert said == ("benchmarks.tasks: scoring inside the run needs on rank 0 29.80 GiB of host memory (2x the model) "
                    "with 20.00 GiB available and 14.90 GiB on its GPU (a whole copy beside its shards) with 10.00 GiB "
                    "free; leave benchmarks.tasks empty and score the run's tags after it with `ds-train eval RUN_DIR "
                    "--tag TAG --tasks ...` (one process, no training state beside the model)"), said
    assert scoring_memory_problem(8 * 10**9, "bf16", False, 40 * GiB, None) is None
    assert "59.60 GiB of host memory" in scoring_memory_problem(8 * 10**9, "fp32", False, 40 * GiB, None)

