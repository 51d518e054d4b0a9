"""lm-evaluation-harness on ds_train's models (the run config's `benchmarks` section, `ds-train eval`).

The tasks are names lm_eval knows (its own, and those in recipes/lm_eval/, always searched) or paths of task YAML
files (their directories searched too). `check_tasks` says in one line, before anything runs, what lm_eval would
stop on later: lm_eval not installed, a name it does not know, a task file that is not YAML, names no task, or does
not build (its dataset, its templates), a metric or aggregation it does not know (it would only warn), a task
flagged unsafe_code without benchmarks.confirm_run_unsafe_code; check_gen_kwargs the generation arguments.
`evaluate` scores a model that is already loaded, in this process, through lm_eval's own Hugging Face backend
(HFLM on the model object: no reload, no copy), so that the numbers are those `lm_eval --model hf` gives on the
exported model (with the section's chat template, gen_kwargs, log_samples; the global generators lm_eval reseeds
put back after it); `metrics` names them after each task's own metrics
(bench/<task>/<metric>,<filter>, lm_eval's keys). lm_eval is imported only here, and only when tasks are named.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ds_train.errors import UserError
from ds_train.model.hfconfig import said

LOCAL_TASKS = Path(__file__).resolve().parents[1] / "recipes" / "lm_eval"  # the tasks shipped with ds_train
LM_EVAL_PIN = "lm_eval==0.4.13"  # pyproject.toml's eval extra, requirements-test.txt
KEY = "benchmarks.tasks"


# `dataset_path`s that read local files (datasets' packaged builders): a task with one needs no network
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")


@dataclass(frozen=True)
class Tasks:
    names: tuple[str, ...]  # what lm_eval evaluates
    files: dict  # name -> the task file that gave it (a path given in benchmarks.tasks)
    include: tuple[str, ...]  # directories lm_eval's TaskManager searches besides its own tasks
    local: bool = False  # every task reads local files (the shipped ones, task files over local data)

    def offline(self) -> None:
        """Where every task is local, nothing reaches for the network: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE
        set (unless the environment sets them) before `datasets` is imported, which otherwise counts each load
        of a local file with a request to the hub's servers. lm_eval's own tasks download their data: left
        as the environment says."""
        import os

        if self.local:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def resolve(tasks: list[str], key: str = KEY) -> Tasks:
    """The task names and the directories to search, from benchmarks.tasks (names and task-file paths)."""
    names, files, include = [], {}, [str(LOCAL_TASKS)] if LOCAL_TASKS.is_dir() else []
    local = True
    for entry in tasks:
        if not entry.endswith((".yaml", ".yml")):
            names.append(entry)
            local = local and _shipped().get(entry, False)
            continue
        path = Path(entry)
        if not path.is_file():
            raise UserError(f"{key}: {entry}: no such task file; give the path of a task YAML, or a task name "
                            f"lm_eval knows")
        doc = _task_file(path, key)
        name = _task_name(doc, path, key)
        names.append(name)
        files[name] = entry
        local = local and _reads_local_files(doc)
        if str(path.parent.resolve()) not in include:
            include.append(str(path.parent.resolve()))
    return Tasks(tuple(names), files, tuple(include), local)


@functools.lru_cache(maxsize=1)
def _shipped() -> dict[str, bool]:
    """recipes/lm_eval/'s task names, each with whether it reads local files."""
    out = {}
    for path in sorted(LOCAL_TASKS.glob("*.yaml")):
        doc = _task_file(path, str(path))
        out[_task_name(doc, path, str(path))] = _reads_local_files(doc)
    return out


def _reads_local_files(doc: dict) -> bool:
    where = doc.get("dataset_path")
    return isinstance(where, str) and (where in LOCAL_BUILDERS or Path(where).is_dir())


def _task_file(path: Path, key: str) -> dict:
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML with lm_eval's own tags (!function ...) read as nothing: not ours to resolve here."""

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        doc = yaml.load(path.read_text(), Loader=Loader)
    except yaml.YAMLError as e:
        raise UserError(f"{key}: {path}: not YAML ({said(e, 120)}); fix the task file") from None
    return doc if isinstance(doc, dict) else {}


def _task_name(doc: dict, path: Path, key: str) -> str:
    name = doc.get("task") or doc.get("group")
    if not isinstance(name, str) or not name:
        raise UserError(f"{key}: {path}: names no task (a task file has `task: NAME`, a group file `group: NAME`); "
                        f"fix the task file")
    return name


def installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def task_manager(tasks: Tasks):
    return _manager(tasks.include)


@functools.lru_cache(maxsize=4)
def _manager(include: tuple[str, ...]):
    """lm_eval's index of its tasks and those in `include` (seconds to build: kept for the process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, verbosity="ERROR")


def check_tasks(tasks: list[str], key: str = KEY, unsafe_code: bool = False) -> Tasks:
    """benchmarks.tasks as lm_eval will take them, or one line saying what it would stop on (and the fix): every
    task built, its metrics and aggregations ones lm_eval knows, and a task flagged unsafe_code refused unless
    `unsafe_code` (benchmarks.confirm_run_unsafe_code)."""
    if not tasks:
        return Tasks((), {}, ())
    if not installed():
        raise UserError(f"{key}: needs lm_eval, which is not installed; pip install -e '.[eval]' (or "
                        f"pip install '{LM_EVAL_PIN}'), or leave {key} empty")
    resolved = resolve(tasks, key)
    resolved.offline()
    manager = task_manager(resolved)
    for name in resolved.names:
        if name not in manager.all_subtasks and name not in manager.all_groups and name not in manager.all_tags:
            close = difflib.get_close_matches(name, manager.all_tasks, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{key}: {name!r} is not a task lm_eval knows{hint}; give a name from `lm-eval ls tasks` "
                            f"or recipes/lm_eval/, or the path of a task YAML")
        where = f"its task file {resolved.files[name]}" if name in resolved.files else f"task {name!r}"
        for task in _leaves(_build(manager, name, where, key)):
            _check_task(task, where, key, unsafe_code)
    return resolved


def check_section(cfg) -> None:
    """The run config's benchmarks section, before anything is written: its tasks (check_tasks), its gen_kwargs,
    and what scoring inside the run cannot take yet."""
    bench = cfg.benchmarks
    if not bench.tasks:
        return
    if cfg.parallel.expert > 1:
        raise UserError(f"{KEY}: scoring inside a run with parallel.expert={cfg.parallel.expert} is not built (the "
                        f"experts are not gathered whole for lm_eval); leave {KEY} empty and score the run "
                        f"afterwards with `ds-train eval RUN_DIR --tasks ...` (it exports first)")
    check_gen_kwargs(bench.gen_kwargs)
    check_tasks(bench.tasks, unsafe_code=bench.confirm_run_unsafe_code)


def scoring_memory_problem(n_params: int, dtype: str, on_gpu: bool, host_available: float | None,
                           device_free: float | None) -> str | None:
    """One line when rank 0 cannot hold a scoring inside the run (ds_train/plan/memory.py scoring_bytes: 2x the
    model in host memory, a copy on its GPU) in what it has free; None where it fits or is not known."""
    from ds_train.plan.memory import scoring_bytes, scoring_refusal

    short = scoring_refusal(scoring_bytes(n_params, dtype, on_gpu), host_available, device_free)
    if short is None:
        return None
    return (f"{KEY}: scoring inside the run needs on rank 0 {short}; leave {KEY} empty and score the run's "
            f"tags after it with `ds-train eval RUN_DIR --tag TAG --tasks ...` (one process, no training state "
            f"beside the model)")


# what lm_eval's HF backend takes in gen_kwargs beside transformers' GenerationConfig (models/utils.py
# normalize_gen_kwargs, HFLM.generate_until)
LM_EVAL_GEN_KEYS = ("until", "max_gen_toks", "max_tokens", "max_completion_tokens")


def check_gen_kwargs(gen_kwargs: dict) -> None:
    """Each key one lm_eval's HF backend or transformers' generate() takes: another would end the scoring in
    generate() (`model_kwargs are not used by the model`) at the first generate_until task."""
    if not gen_kwargs:
        return
    from transformers import GenerationConfig

    known = GenerationConfig()
    for name in gen_kwargs:
        if name not in LM_EVAL_GEN_KEYS and not hasattr(known, name):
            close = difflib.get_close_matches(name, [*LM_EVAL_GEN_KEYS, *known.to_dict()], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"benchmarks.gen_kwargs: {name!r} is no generation argument{hint}; give keys of "
                            f"transformers' GenerationConfig or lm_eval's {', '.join(LM_EVAL_GEN_KEYS)}")


def check_chat_template(tokenizer, template: bool | str) -> None:
    """benchmarks.apply_chat_template against the tokenizer that will render the documents: one it has."""
    if template is False or template is None:
        return
    held = getattr(tokenizer, "chat_template", None)
    names = sorted(held) if isinstance(held, dict) else (["default"] if held else [])
    if not names:
        raise UserError(f"benchmarks.apply_chat_template: {template!r}, but the tokenizer has no chat template; set "
                        f"benchmarks.apply_chat_template=false, or give a tokenizer with one (its "
                        f"tokenizer_config.json's chat_template)")
    if isinstance(template, str) and isinstance(held, dict) and template not in held:
        raise UserError(f"benchmarks.apply_chat_template: {template!r} is not one of the tokenizer's templates "
                        f"({', '.join(names)}); give one of them, or true for its default")


def _build(manager, name: str, where: str, key: str) -> dict:
    from lm_eval.tasks import get_task_dict

    try:
        return get_task_dict([name], manager)
    except Exception as e:  # noqa: BLE001 - lm_eval raises what its loaders raise: said in one line
        raise UserError(f"{key}: task {name!r} does not build ({said(e, 160)}); fix {where}") from None


def _leaves(tasks: dict) -> list:
    """The tasks of get_task_dict's answer (groups hold dicts of their subtasks)."""
    out = []
    for value in tasks.values():
        out += _leaves(value) if isinstance(value, dict) else [value]
    return out


def _check_task(task, where: str, key: str, unsafe_code: bool) -> None:
    """What lm_eval finds only when it scores: a metric or an aggregation it does not know (it warns, scores the
    others or nothing), a task that runs the model's code (it raises at the scoring)."""
    name = getattr(task.config, "task", None) or "?"
    custom = getattr(task.config, "process_results", None) is not None  # its own function gives the values
    for metric, fn in getattr(task, "_metric_fn_list", {}).items():
        if fn is None and not custom:
            raise UserError(f"{key}: task {name!r}: metric {metric!r} is not one lm_eval knows (its registry or "
                            f"HF evaluate's); fix metric_list in {where}")
    for metric, fn in getattr(task, "_aggregation_list", {}).items():
        if fn is None:
            raise UserError(f"{key}: task {name!r}: metric {metric!r} has no aggregation lm_eval knows; give it "
                            f"one (aggregation: mean) in {where}")
    if getattr(task, "UNSAFE_CODE", False) and not unsafe_code:
        raise UserError(f"{key}: task {name!r} runs the model's generated code (unsafe_code); set "
                        f"benchmarks.confirm_run_unsafe_code=true to let it, on a machine where that is safe, "
                        f"or drop the task")


def evaluate(model, tokenizer, cfg, tasks: Tasks, device: str = "cpu") -> dict:
    """lm_eval's results for `model` (a transformers model, loaded, in eval mode for the call) on `tasks`, with the
    section's chat template, gen_kwargs, log_samples and confirm_run_unsafe_code: its own dict (results, configs,
    versions, n-shot, samples with log_samples, ...), as `lm_eval` writes it. The process's global generators
    (python, numpy, torch, CUDA's), which lm_eval reseeds, are as they were after it."""
    tasks.offline()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    check_chat_template(tokenizer, cfg.apply_chat_template)
    was_training = model.training
    model.eval()
    try:
        with kept_generators():
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, device=device)
            return simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=task_manager(tasks),
                                   limit=cfg.limit or None,
                                   num_fewshot=None if cfg.num_fewshot < 0 else cfg.num_fewshot,
                                   apply_chat_template=cfg.apply_chat_template, gen_kwargs=dict(cfg.gen_kwargs) or None,
                                   log_samples=cfg.log_samples, confirm_run_unsafe_code=cfg.confirm_run_unsafe_code,
                                   verbosity="ERROR")
    finally:
        model.train(was_training)


@contextlib.contextmanager
def kept_generators():
    """The global generators lm_eval reseeds (simple_evaluate's random_seed, numpy_random_seed, torch_random_seed)
    put back as they were: in a run, rank 0's dropout, sampling and data order go on as if no scoring happened."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None  # every device, as seeding sets them
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def metrics(results: dict) -> dict[str, float]:
    """The scores under each task's own metric names: bench/<task>/<metric>,<filter> (lm_eval's keys), standard
    errors left out."""
    out = {}
    for task, values in results.get("results", {}).items():
        for name, value in values.items():
            if "," in name and "_stderr" not in name and isinstance(value, (int, float)):
                out[f"bench/{task}/{name}"] = float(value)
    return out


def write_results(results: dict, out_dir: Path, model_name: str) -> Path:
    """The results file as lm_eval writes it (its EvaluationTracker: OUT/<model>/results_<time>.json), and with
    log_samples each task's samples beside it (write_samples)."""
    tracker = _tracker(out_dir, model_name)
    samples = results.get("samples") or {}
    tracker.save_results_aggregated(results={k: v for k, v in results.items() if k != "samples"}, samples=samples)
    for task, rows in samples.items():
        tracker.save_results_samples(task_name=task, samples=rows)
    written = sorted((out_dir / model_name.replace("/", "__")).glob("results_*.json"))
    return written[-1]


def write_samples(results: dict, out_dir: Path, model_name: str) -> Path:
    """Each task's samples (benchmarks.log_samples) as lm_eval writes them: OUT/<model>/samples_<task>_<time>.jsonl.
    Returns that directory."""
    from datetime import datetime

    tracker = _tracker(out_dir, model_name)
    tracker.date_id = datetime.now().isoformat().replace(":", "-")  # what save_results_aggregated sets, as lm_eval does
    for task, rows in (results.get("samples") or {}).items():
        tracker.save_results_samples(task_name=task, samples=rows)
    return out_dir / model_name.replace("/", "__")


def _tracker(out_dir: Path, model_name: str):
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(out_dir))
    tracker.general_config_tracker.model_name = model_name
    tracker.general_config_tracker.model_name_sanitized = model_name.replace("/", "__")
    return tracker
