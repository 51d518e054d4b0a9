"""A post-training demo of docs/post_training.md, run as written, against continued SFT for the same wall
time; rewrites docs/post_training.md's and BENCHMARKS.md's figures of that demo from what it measured.

    python bench/rl_vs_sft.py [--demo ript|arith|tools] [--replace] [--no-write] [--reduced]

ript: RIPT on the seven built-in tasks (recipes/ript_sft.yaml, then recipes/ript_demo.yaml).
arith: RL from a dataset of arithmetic word problems with a numeric verifier (recipes/rl_sft.yaml,
then recipes/rl_demo.yaml).
tools: RL with a calculator tool on products a tiny model cannot work out in its head (recipes/tool_sft.yaml,
then recipes/tool_demo.yaml), two seeds, beside RL without the tool (recipes/tool_demo_no_tool.yaml), continued
SFT, and RL with the tool from a second start whose demonstrations all call the tool (recipes/tool_sft_calls.yaml,
then recipes/tool_demo_calls.yaml), each for two seeds (the RL command as written is the first; the second
overrides `seed` and `output_dir`). SFT continued from the same checkpoint is deterministic: its two rows differ
only by the wall time they match, each seed's RL-with-the-tool time. Each start is evaluated in the settings of
the RL runs from it (the first with the tool and without), each RL run in its own. Every row is scored on ONE
held-out set (one_heldout): the records, by their prompt text, that every RL arm's task holds out (ds-train ript
splits a task by a hash of the rendered prompt, which holds the tools' schema, so a task with the tool and its
twin without it hold out different records) and that no SFT start's demonstrations ask; each RL row's score on
its own task's held-out set is kept beside it and equals what its command printed.

1. SFT, the documented command: `deepspeed --num_gpus 2 --module ds_train train --config <sft recipe>
   --ds-config ds_configs/zero2.json`.
2. RL, the documented command: `deepspeed --num_gpus 2 --module ds_train ript --config <rl recipe>
   --ds-config ds_configs/zero2.json`; the line it prints last ("ript: done, N iterations, held-out
   success A (iteration 0) -> B (iteration N); ...") is the page's figure.
3. Continued SFT: the SFT run resumed into runs/bench_<demo>/sft_continued for at least as long as
   RL took (launcher start-ups included on both sides; topped up from its own checkpoint if short).
4. Held-out success per task of all three with the RL run's own evaluation (greedy, the same contexts; tools:
   on the one held-out set every arm holds out).

The demo's run directories must not exist (the commands would resume them): --replace removes them,
and the SFT data prepared for it, first. Writes runs/bench_<demo>/summary.json and, unless
--no-write, the marked blocks of docs/post_training.md and BENCHMARKS.md (date, machine, versions,
commands, numbers).

--reduced: the same commands with a few steps and tiny sizes (REDUCED_SFT, REDUCED_RL; continued SFT
for 2 steps), writing neither docs/post_training.md nor BENCHMARKS.md: a check that the demo runs end
to end in a minute or two on a CPU (tests/test_doc_commands.py), measuring nothing.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

FIGURES = ROOT / "docs" / "post_training.md"  # the demos' commands, and the blocks Demo.marker names

# --reduced: SFT for 4 steps; RL for 1 iteration of 2 accepted contexts per rank (K 8: 16 rollouts, two
# optimizer steps of 8 a rank), 16 held-out contexts per task.
REDUCED_SFT = ("train.max_steps=4", "train.eval_batches=1", "log.every=1", "log.plots=false")
REDUCED_RL = ("ript.iterations=1", "ript.rloo_batch_size=8", "ript.contexts_per_rank=2", "ript.rollout_contexts=2",
              "ript.max_contexts_checked=8", "ript.eval_contexts=16", "ript.eval_every=0",
              "train.micro_batch_size=8", "train.global_batch_size=16", "log.plots=false")
REPORTED = re.compile(r"held-out success (\d\.\d{3}) \(iteration 0\) -> (\d\.\d{3}) \(iteration (\d+)\)")


@dataclass(frozen=True)
class Demo:
    sft_recipe: str
    rl_recipe: str
    name: str  # what the RL row is called
    marker: str  # the FIGURES / BENCHMARKS.md blocks it rewrites
    what: str  # the held-out set, in words
    no_tool_recipe: str = ""  # tools: RL without the tool, the third arm
    calls_sft_recipe: str = ""  # tools: the second start, every demonstration a call
    calls_rl_recipe: str = ""  # tools: RL with the tool from calls_sft_recipe's run
    seeds: tuple[int, ...] = ()  # tools: the seeds of each arm (the first is the recipe's)
    lm_eval: tuple[str, ...] = ()  # lm-evaluation-harness tasks scored on each exported policy (recipes/lm_eval/)

    def cmd(self, command: str, recipe: str) -> str:
        return f"deepspeed --num_gpus 2 --module ds_train {command} --config {recipe} --ds-config ds_configs/zero2.json"

    @property
    def sft_cmd(self) -> str:
        return self.cmd("train", self.sft_recipe)

    @property
    def rl_cmd(self) -> str:
        return self.cmd("ript", self.rl_recipe)

    @property
    def no_tool_cmd(self) -> str:
        return self.cmd("ript", self.no_tool_recipe)

    @property
    def commands(self) -> tuple[str, ...]:
        """Every documented command the demo launches."""
        return (self.sft_cmd, self.rl_cmd) + ((self.no_tool_cmd,) if self.no_tool_recipe else ()) + (
            (self.cmd("train", self.calls_sft_recipe), self.cmd("ript", self.calls_rl_recipe))
            if self.calls_sft_recipe else ())

    def config(self, recipe: str, overrides: tuple[str, ...] = ()):
        from ds_train.config.file import load_config

        return load_config(ROOT / recipe, list(overrides))

    def written(self, recipe: str) -> dict:
        """The recipe's YAML as written: its directories are known before the SFT run exists, which the
        RL recipe's model.path names (a whole config check would refuse it until then)."""
        import yaml

        return yaml.safe_load((ROOT / recipe).read_text())

    @property
    def sft_dir(self) -> Path:
        return ROOT / self.written(self.sft_recipe)["output_dir"]

    @property
    def rl_dir(self) -> Path:
        return ROOT / self.written(self.rl_recipe)["output_dir"]

    @property
    def made(self) -> tuple[list[Path], list[Path]]:
        """What the demo's commands make: (every run directory of its recipes as written, the SFT data prepared)."""
        sft = [r for r in (self.sft_recipe, self.calls_sft_recipe) if r]
        rl = [r for r in (self.rl_recipe, self.no_tool_recipe, self.calls_rl_recipe) if r]
        return ([ROOT / self.written(r)["output_dir"] for r in sft + rl],
                [ROOT / self.written(r)["data"]["dir"] for r in sft])


DEMOS = {"ript": Demo("recipes/ript_sft.yaml", "recipes/ript_demo.yaml", "RIPT", "ript-bench",
                      "all seven tasks"),
         "arith": Demo("recipes/rl_sft.yaml", "recipes/rl_demo.yaml", "RL", "rl-bench",
                       "arithmetic word problems held out by a hash of the prompt",
                       lm_eval=("arith_words", "arith_choice")),
         "tools": Demo("recipes/tool_sft.yaml", "recipes/tool_demo.yaml", "RL with the tool", "tool-bench",
                       "3-digit by 2-digit products held out by a hash of the prompt",
                       no_tool_recipe="recipes/tool_demo_no_tool.yaml", calls_sft_recipe="recipes/tool_sft_calls.yaml",
                       calls_rl_recipe="recipes/tool_demo_calls.yaml", seeds=(1234, 1235))}


def run(command: str, *overrides: str, log: Path) -> tuple[float, str]:
    """Run a documented command (plus overrides) from the repository root, its output teed to `log`;
    returns the wall time and the output."""
    args = command.split() + list(overrides)
    args[0] = str(Path(sys.executable).parent / args[0])  # the venv's launcher
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - t0
    log.write_text(proc.stdout)
    if proc.returncode:
        raise cli.fail(f"`{' '.join([command, *overrides])}` failed (exit {proc.returncode}); see {log}")
    return seconds, proc.stdout


def prompt_key(task, prompt) -> str:
    """A record's prompt text (its prompt_key's value), the same whatever the tools, template or tokenizer."""
    return json.dumps(prompt.record[task.options["prompt_key"]], sort_keys=True)


def scored(prompts: list[str]) -> str:
    """A digest of the prompts a row is scored on, in their order."""
    import hashlib

    return hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]


def heldout_success(model_dir: Path, cfg, common: list[str] | None = None) -> dict:
    """The evaluation `ds_train ript` runs, in this process, for a Hugging Face directory: the task's own held-out
    contexts. With `common` (prompt_key's of each task's records, found in either split), the row's figures are
    over those records, and the own held-out set's kept as "own_success_rate" / "own_problems"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_train.ript.rollout import model_policy, rollout
    from ds_train.ript.environments import load_tasks

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    act = model_policy(model, tok, cfg.ript.max_new_tokens, temperature=0.0)
    batch = cfg.ript.rollout_contexts * cfg.ript.rloo_batch_size
    wins = total = calls = own_wins = own_total = 0
    per_task = {}
    for task in load_tasks(cfg, tok, model.config).values():
        own = task.contexts("heldout", cfg.ript.eval_contexts, cfg.seed)
        eps = rollout(act, tok, [(task, c, 0) for c in own], batch, max_new_tokens=cfg.ript.max_new_tokens)
        own_wins, own_total = own_wins + sum(e.success for e in eps), own_total + len(eps)
        if common is not None:  # the own set's episodes as they ran (the command's batches), the rest after them
            keys = {prompt_key(task, c): e for c, e in zip(own, eps)}
            rest = {prompt_key(task, c): c for split in ("heldout", "train") for c in task.splits[split]}
            missing = [k for k in common if k not in keys and k not in rest]
            if missing:
                raise cli.fail(f"{model_dir}: task {task.name} has no record whose prompt is {missing[0]} (of "
                               f"{len(missing)} of the common held-out set): not one held-out set")
            more = [k for k in common if k not in keys]
            keys.update(zip(more, rollout(act, tok, [(task, rest[k], 0) for k in more], batch,
                                          max_new_tokens=cfg.ript.max_new_tokens)))
            eps = [keys[k] for k in common]
        per_task[task.name] = sum(e.success for e in eps) / len(eps)
        wins, total = wins + sum(e.success for e in eps), total + len(eps)
        calls += sum(e.tool_calls > 0 for e in eps)
    row = {"success_rate": wins / total, "per_task": per_task, "called_tool": calls / total}
    if common is not None:  # "scored": which records, as a digest (every row of one demo: the same)
        row.update(problems=total, scored=scored(common), own_success_rate=own_wins / own_total,
                   own_problems=own_total)
    return row


def one_heldout(demo: Demo, starts: list[tuple[Path, object]], n: int) -> tuple[list[str], dict]:
    """The one held-out set of the tools demo: the records (by prompt text) that every RL arm's task holds out,
    `starts` (each RL recipe's start, exported, and the recipe's config: its tokenizer renders the prompts the
    split hashes), less any prompt a user turn of an SFT start's demonstrations asks; in the first task's
    seeded held-out order, at most n. Returns (the prompts, how they were counted)."""
    from transformers import AutoConfig, AutoTokenizer

    from ds_train.ript.environments import load_tasks

    held: list[list[str]] = []
    for model_dir, cfg in starts:
        tok, hf_config = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
        task, = load_tasks(cfg, tok, hf_config).values()
        held.append([prompt_key(task, c) for c in task.contexts("heldout", len(task.splits["heldout"]), cfg.seed)])
    seen = set()
    for recipe in (demo.sft_recipe, demo.calls_sft_recipe):
        for source in demo.config(recipe).data.sources:
            for line in (ROOT / source).read_text().splitlines():
                seen |= {json.dumps(m["content"]) for m in json.loads(line)["messages"] if m["role"] == "user"}
    shared = set(held[0]).intersection(*held[1:])
    common = [k for k in held[0] if k in shared and k not in seen]
    counted = {"held_out_by_each": [len(h) for h in held], "held_out_by_all": len(shared),
               "asked_in_sft": len(shared) - len([k for k in shared if k not in seen]), "problems": min(n, len(common)),
               "prompts": common[:n]}
    return common[:n], counted


def lm_eval_scores(model_dir: Path, tasks: tuple[str, ...], limit: int) -> dict:
    """lm-evaluation-harness's scores of an exported policy (ds_train/benchmarks.py: lm_eval's own HF backend, as
    `ds-train eval` scores it): {"<task> <metric>": value}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_train.benchmarks import check_tasks, evaluate
    from ds_train.config.benchmarks import BenchmarksConfig

    cfg = BenchmarksConfig(tasks=list(tasks), limit=limit)
    results = evaluate(AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto"),
                       AutoTokenizer.from_pretrained(model_dir), cfg, check_tasks(cfg.tasks))
    return {f"{task} {name.split(',')[0]}": value for task, values in results["results"].items()
            for name, value in values.items() if "," in name and "_stderr" not in name}


def continued_sft(demo: Demo, out: Path, rl_s: float, reduced: bool, name: str = "sft_continued") -> tuple[float, int]:
    """SFT resumed from the demo's SFT run into out/name for at least rl_s seconds (2 steps when reduced);
    returns (seconds, extra steps)."""
    sft_extra = REDUCED_SFT if reduced else ()
    final = demo.config(demo.sft_recipe, sft_extra).train.max_steps
    steps = [m["perf/step_time_s"] for m in map(json.loads, (demo.sft_dir / "metrics.jsonl").read_text().splitlines())
             if m.get("perf/step_time_s")]
    extra = 2 if reduced else math.ceil(rl_s / statistics.median(steps))  # launcher start-up counted as training
    more = out / name
    common = (*sft_extra, f"output_dir={more}", "log.progress=false")
    more_s, _ = run(demo.sft_cmd, *common, f"checkpoint.resume={demo.sft_dir / 'checkpoints'}",
                    f"train.max_steps={final + extra}", log=out / f"{name}.log")
    while more_s < rl_s and not reduced:  # at least as long as RL: top up at the rate it just ran (from its checkpoint)
        extra += math.ceil((rl_s - more_s) * extra / more_s) + 1
        more_s += run(demo.sft_cmd, *common, f"train.max_steps={final + extra}", log=out / f"{name}.log")[0]
    return more_s, extra


def tool_arms(demo: Demo, out: Path, reduced: bool) -> tuple[dict, dict, float]:
    """The tools demo after its SFT: the second start's SFT; per seed, RL with the tool, RL without it, RL with the
    tool from the second start and continued SFT for the time RL with the tool took; every run and both starts
    evaluated (the first both ways) on one_heldout's set. Returns (the rows, the set's counts, the second SFT's s)."""
    from ds_train.checkpoint.export import export

    sft_extra, rl_extra = (REDUCED_SFT, REDUCED_RL) if reduced else ((), ())
    calls_s, _ = run(demo.cmd("train", demo.calls_sft_recipe), *sft_extra, log=out / "sft_calls.log")
    calls_dir = ROOT / demo.written(demo.calls_sft_recipe)["output_dir"]
    with_tool, without, calls = (demo.config(r, rl_extra) for r in (demo.rl_recipe, demo.no_tool_recipe,
                                                                     demo.calls_rl_recipe))

    def hf(run_dir: Path) -> Path:
        path = out / f"hf_{run_dir.name}"
        if not path.exists():  # a start is evaluated in each setting of the RL runs from it
            export(run_dir, path)
        return path

    arms = [("SFT (start)", demo.sft_dir, 0.0, with_tool, {}), ("SFT (start), no tool", demo.sft_dir, 0.0, without, {}),
            ("SFT (start, every demonstration a call)", calls_dir, 0.0, calls, {})]
    seeds = demo.seeds[:1] if reduced else demo.seeds  # reduced: a check that every arm runs, one seed of each
    for i, seed in enumerate(seeds):
        for arm, recipe, cfg in (("RL with the tool", demo.rl_recipe, with_tool),
                                 ("RL without the tool", demo.no_tool_recipe, without),
                                 ("RL with the tool from the all-calls start", demo.calls_rl_recipe, calls)):
            cmd = demo.cmd("ript", recipe)
            run_dir = ROOT / demo.written(recipe)["output_dir"] if i == 0 else out / f"{Path(recipe).stem}_{seed}"
            own = () if i == 0 else (f"seed={seed}", f"output_dir={run_dir}")  # the first: the command as written
            seconds, said = run(cmd, *rl_extra, *own, log=out / f"{run_dir.name}.log")
            printed = REPORTED.findall(said)
            if not printed:
                raise cli.fail(f"`{cmd}` printed no \"held-out success A (iteration 0) -> B (iteration N)\" line; "
                               f"see {out / f'{run_dir.name}.log'}")
            arms.append((f"{arm}, seed {seed}", run_dir, seconds, cfg, {"printed": list(printed[-1])}))
        rl_s = arms[-3][2]
        more_s, extra = continued_sft(demo, out, rl_s, reduced, name=f"sft_continued_{seed}")
        arms.append((f"SFT continued, seed {seed}", out / f"sft_continued_{seed}", more_s, with_tool, {"steps": extra}))
    common, counted = one_heldout(demo, [(hf(demo.sft_dir), with_tool), (hf(demo.sft_dir), without),
                                         (hf(calls_dir), calls)], with_tool.ript.eval_contexts)
    rows: dict = {}
    for name, run_dir, seconds, cfg, more in arms:
        rows[name] = {"seconds": round(seconds, 1), **heldout_success(hf(run_dir), cfg, common), **more}
        if "printed" in more and f"{rows[name]['own_success_rate']:.3f}" != more["printed"][1]:
            raise cli.fail(f"{name}: the held-out success recomputed here on its own task's held-out set, "
                           f"{rows[name]['own_success_rate']:.3f}, is not the {more['printed'][1]} the command "
                           f"printed ({out / f'{run_dir.name}.log'})")
    return rows, counted, calls_s


def tool_tables(demo: Demo, s: dict) -> tuple[str, str]:
    """(the FIGURES paragraph, BENCHMARKS.md's section body) of the tools demo, from the summary."""
    rows, held = s["rows"], s["heldout"]
    seeds = [seed for seed in demo.seeds if f"RL with the tool, seed {seed}" in rows]  # reduced: the first only

    def mean(arm: str) -> float:
        return statistics.mean(rows[f"{arm}, seed {seed}"]["success_rate"] for seed in seeds)

    start, start_no_tool, calls_start = (rows[k]["success_rate"] for k in (
        "SFT (start)", "SFT (start), no tool", "SFT (start, every demonstration a call)"))
    tool, no_tool, more, from_calls = (mean(a) for a in ("RL with the tool", "RL without the tool", "SFT continued",
                                                         "RL with the tool from the all-calls start"))

    def start_of(name: str) -> str:  # the row a run compares against
        return "-" if name.startswith("SFT (start") else (
            "SFT (start, every demonstration a call)" if "all-calls" in name else "SFT (start)")

    lines = ["| policy | from | wall s | held-out success | called the tool | its own held-out set (problems) |",
             "|---|---|---|---|---|---|"] + [
        f"| {name} | {start_of(name)} | {row['seconds']:.0f} | {row['success_rate']:.3f} | {row['called_tool']:.3f} | "
        f"{row['own_success_rate']:.3f} ({row['own_problems']}) |" for name, row in rows.items()]
    bench = "python bench/rl_vs_sft.py --demo tools" + (" --reduced" if s.get("reduced") else "")
    each = held["held_out_by_each"]
    one = (f"one held-out set for every row: the {held['problems']} problems (by the record's prompt) that "
           f"{Path(demo.rl_recipe).stem} ({each[0]} held out), {Path(demo.no_tool_recipe).stem} ({each[1]}) and "
           f"{Path(demo.calls_rl_recipe).stem} ({each[2]}) all hold out ({held['held_out_by_all']}; each task's "
           f"split hashes its rendered prompt, which holds the tool's schema), less {held['asked_in_sft']} an SFT "
           f"start's demonstrations ask")
    said = (f"Mean of seeds {' and '.join(map(str, seeds))}, on {held['problems']} held-out problems: RL with "
            f"the tool {tool:.3f}, **{100 * (tool - start):+.1f} points** over its SFT start ({start:.3f}, built to "
            f"prefer answering from its head); SFT continued from that start for the same wall time {more:.3f} "
            f"({100 * (tool - more):+.1f} points for RL with the tool); RL without the tool {no_tool:.3f} (the start "
            f"without the tool: {start_no_tool:.3f}). From the start whose demonstrations all call the tool "
            f"({calls_start:.3f}), RL with the tool {from_calls:.3f}: **{100 * (from_calls - calls_start):+.1f} "
            f"points** over that start, {100 * (from_calls - tool):+.1f} against RL with the tool from the first.")
    doc = (f"Measured on this 2-core CPU ({s['date']}, 2 processes, ZeRO-2, fp32; `{bench}` runs the commands "
           f"above, two seeds each, and writes these figures; greedy, {one}; \"from\": the start each row "
           f"compares against; \"called the tool\": the share of episodes with a call; the last column: each row on "
           f"its own task's held-out set, what its RL command printed). {said}\n\n" + "\n".join(lines) + "\n")
    section = (f"- Date: {s['date']}. Machine: {s['machine']}; {s['versions']}.\n"
               f"- Commands (the docs', as written, for seed {demo.seeds[0]}; `seed` and `output_dir` overridden "
               f"for the others): `{demo.sft_cmd}` ({s['sft_s']:.0f} s), "
               f"`{demo.cmd('train', demo.calls_sft_recipe)}` ({s['calls_sft_s']:.0f} s), `{demo.rl_cmd}`, "
               f"`{demo.no_tool_cmd}`, `{demo.cmd('ript', demo.calls_rl_recipe)}`; continued SFT: the first resumed "
               f"from {demo.sft_dir.name} for each seed's RL-with-the-tool time. All by `{bench}`, which wrote this "
               f"section.\n"
               f"- Held-out success: greedy, {one}; the evaluation `ds_train ript` logs (recomputed in-process from "
               f"each exported model; each RL row's own held-out figure equals what its command printed); with the "
               f"tool for every row but those that say so.\n\n" + "\n".join(lines) + f"\n\n{said}\n")
    return doc, section


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, no GPU"


def versions() -> str:
    import deepspeed
    import torch
    import transformers
    return f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, transformers {transformers.__version__}"


def tables(demo: Demo, s: dict) -> tuple[str, str]:
    """(the FIGURES paragraph, BENCHMARKS.md's section body) from the summary."""
    rows, tasks = s["rows"], list(s["rows"][demo.name]["per_task"])
    start, end, more = (rows[k]["success_rate"] for k in ("SFT (start)", demo.name, "SFT continued"))
    scored = list(rows[demo.name].get("lm_eval", {}))  # lm-eval's, on each exported policy
    head = ("| policy | wall s | held-out success | " + " | ".join(tasks + [f"lm-eval {k}" for k in scored]) +
            " |\n|---|---|---|" + "---|" * (len(tasks) + len(scored)))
    lines = [head] + [f"| {name} | {row['seconds']:.0f} | {row['success_rate']:.3f} | " +
                      " | ".join([f"{row['per_task'][t]:.2f}" for t in tasks] +
                                 [f"{row['lm_eval'][k]:.3f}" for k in scored]) + " |" for name, row in rows.items()]
    printed = s["printed"]
    bench = f"python bench/rl_vs_sft.py --demo {s['demo']}" + (" --reduced" if s.get("reduced") else "")
    doc = (f"Measured on this 2-core CPU ({s['date']}, 2 processes, ZeRO-2, fp32; `{bench}` runs the two "
              f"commands above as written and writes these figures): the {demo.name} command prints "
              f"\"held-out success {printed[0]} (iteration 0) -> {printed[1]} (iteration {printed[2]})\", "
              f"**{100 * (end - start):+.1f} points** over the SFT start (greedy, {s['eval_contexts']} held-out "
              f"contexts per task, {demo.what}), in {s['sft_s'] + s['rl_s']:.0f} s for both commands "
              f"(SFT {s['sft_s']:.0f} s, {demo.name} {s['rl_s']:.0f} s, start-ups included). SFT continued for "
              f"{rows['SFT continued']['seconds']:.0f} s instead reaches {more:.3f} ({100 * (end - more):+.1f} points "
              f"for {demo.name}). Per task" + (f", and lm-evaluation-harness's {', '.join(demo.lm_eval)} (recipes/"
              f"lm_eval/: every one of the 4,000 problems, held out or not, scored as `ds-train eval` scores the "
              f"export)" if scored else "") + ":\n\n" + "\n".join(lines) + "\n")
    section = (f"- Date: {s['date']}. Machine: {s['machine']}; {s['versions']}.\n"
               f"- Commands (the docs', as written): `{demo.sft_cmd}` ({s['sft_s']:.0f} s), then `{demo.rl_cmd}` "
               f"({s['rl_s']:.0f} s; it printed \"held-out success {printed[0]} (iteration 0) -> {printed[1]} "
               f"(iteration {printed[2]})\"); continued SFT: the first command resumed from {demo.sft_dir.name} for "
               f"{s['rows']['SFT continued']['steps']} more steps. All by `{bench}`, which wrote this section.\n"
               f"- Held-out success: greedy, {s['eval_contexts']} held-out contexts per task ({demo.what}), the "
               f"evaluation `ds_train ript` logs (recomputed in-process from each exported model; the "
               f"{demo.name} column's start and end equal what the command printed).\n\n" + "\n".join(lines) + "\n\n"
               f"{demo.name} - SFT start: **{100 * (end - start):+.1f} points**; {demo.name} - SFT continued for "
               f"the same wall time: **{100 * (end - more):+.1f} points**.\n")
    return doc, section


def rewrite(path: Path, name: str, text: str) -> None:
    """Replace the block between `<!-- NAME:start -->` and `<!-- NAME:end -->` in path."""
    begin, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    doc = path.read_text()
    i, j = doc.index(begin) + len(begin), doc.index(end)
    path.write_text(doc[:i] + text + doc[j:])


def main() -> None:
    from ds_train.checkpoint.export import export

    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", choices=sorted(DEMOS), default="ript", help="which demo (default ript)")
    ap.add_argument("--replace", action="store_true", help="remove the demo's run directories, its "
                                                           "runs/bench_<demo> and its prepared SFT data first")
    ap.add_argument("--no-write", action="store_true", help="leave docs/post_training.md and BENCHMARKS.md as "
                                                            "they are")
    ap.add_argument("--reduced", action="store_true", help="a few steps, tiny sizes, nothing written into "
                                                           "docs/post_training.md or BENCHMARKS.md: the CPU check "
                                                           "that the demo runs")
    args = ap.parse_args()
    demo = DEMOS[args.demo]
    out = ROOT / "runs" / f"bench_{args.demo}"
    runs, data = demo.made
    held = [str(p.relative_to(ROOT)) for p in runs + [out] if p.exists()]
    if held and not args.replace:
        raise cli.fail(f"{', '.join(held)} exist: the documented commands would resume them; give --replace to "
                       f"remove them first")
    for p in (*runs, out, *data):
        shutil.rmtree(p, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    sft_extra, rl_extra = (REDUCED_SFT, REDUCED_RL) if args.reduced else ((), ())
    sft_s, _ = run(demo.sft_cmd, *sft_extra, log=out / "sft.log")
    if demo.seeds:
        rows, counted, calls_s = tool_arms(demo, out, args.reduced)
        summary = {"demo": args.demo, "reduced": args.reduced, "date": datetime.date.today().isoformat(),
                   "machine": machine(), "versions": versions(), "sft_s": round(sft_s, 1),
                   "calls_sft_s": round(calls_s, 1), "heldout": counted,
                   "eval_contexts": demo.config(demo.rl_recipe, rl_extra).ript.eval_contexts, "rows": rows}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return write_figures(demo, args, *tool_tables(demo, summary))
    rl_s, said = run(demo.rl_cmd, *rl_extra, log=out / "rl.log")
    if not REPORTED.search(said):
        raise cli.fail(f"`{demo.rl_cmd}` printed no \"held-out success A (iteration 0) -> B (iteration N)\" line; "
                       f"see {out / 'rl.log'}")
    printed = REPORTED.findall(said)[-1]
    more_s, extra = continued_sft(demo, out, rl_s, args.reduced)

    cfg = demo.config(demo.rl_recipe, rl_extra)
    rows = {}
    for name, run_dir, seconds in (("SFT (start)", demo.sft_dir, 0.0), (demo.name, demo.rl_dir, rl_s),
                                   ("SFT continued", out / "sft_continued", more_s)):
        hf = out / f"hf_{run_dir.name}"
        export(run_dir, hf)
        rows[name] = {"seconds": round(seconds, 1), **heldout_success(hf, cfg)}
        if demo.lm_eval:
            rows[name]["lm_eval"] = lm_eval_scores(hf, demo.lm_eval, 16 if args.reduced else 0)
    rows["SFT continued"]["steps"] = extra
    for name, value in (("SFT (start)", printed[0]), (demo.name, printed[1])):
        if f"{rows[name]['success_rate']:.3f}" != value:
            raise cli.fail(f"{name}: the held-out success recomputed here, {rows[name]['success_rate']:.3f}, is not "
                           f"the {value} the RL command printed ({out / 'rl.log'})")
    summary = {"demo": args.demo, "reduced": args.reduced, "date": datetime.date.today().isoformat(),
               "machine": machine(),
               "versions": versions(), "sft_s": round(sft_s, 1), "rl_s": round(rl_s, 1), "printed": list(printed),
               "eval_contexts": cfg.ript.eval_contexts, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_figures(demo, args, *tables(demo, summary))


def write_figures(demo: Demo, args, doc: str, section: str) -> None:
    print(section)
    if not (args.no_write or args.reduced):
        rewrite(FIGURES, demo.marker, doc)
        rewrite(ROOT / "BENCHMARKS.md", demo.marker, section)
        print(f"rewrote the {demo.marker} blocks of {FIGURES.relative_to(ROOT)} and BENCHMARKS.md")


if __name__ == "__main__":
    sys.exit(cli.run(main))
