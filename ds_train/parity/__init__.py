"""`ds-train parity`: prove that a layout keeps the math, against a one-process reference.

    ds-train parity --config recipes/sft.yaml --ds-config ds_configs/zero3.json --nproc 2 --shrink
    ds-train parity --config C --ds-config ds_configs/zero0.json ds_configs/zero3.json --nproc 1 2 \
        --grad-accum 1 4

Each layout (a ds_config's ZeRO stage, the run's dtype, a world size, a gradient accumulation) takes
`--steps` optimizer steps from the same initial weights, on the same data in the same order, with
the same global batch, as a reference: one process, ZeRO-0, fp32, eager layers, the global batch through
accumulation. Per step it prints both losses and gradient norms and their relative differences,
then the held-out loss after the last step (the same sequences for every layout), and a verdict
against stated tolerances: exit 0 within them, 1 past them. `--shrink` builds the same model type
with small dimensions (2 layers, hidden 16 per head), so the layout of a 70B job is proved on a
laptop. Every layout of one world size runs in one launch (one process group, in turn: the
hidden `parity-worker` command), and the reference is computed once.

Its parts: ds_train/parity/shrunk.py (`--shrink`) and ds_train/parity/tolerance.py (the comparison
and its tolerances).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ds_train.checkpoint.rundir import RunPaths, read_json_or_none
from ds_train.config import RunConfig
from ds_train.config.file import build_config
from ds_train.dist import free_port
from ds_train.dsconfig import read_ds_template
from ds_train.engine import zero_stage
from ds_train.errors import UserError
from ds_train.fs import write_atomic
from ds_train.inputs import check_inputs, model_config, model_dirs
from ds_train.parity.shrunk import shrink
from ds_train.parity.tolerance import FLOOR_FACTOR, compare, floor_problem, noise_floor, series, tolerances
from ds_train.plan.parallel import choices, plan_dims
from ds_train.train.loop import train_spec

REFERENCE, FLOOR = "reference", "floor"


@dataclass(frozen=True)
class Layout:
    ds_config: str  # the layout's DeepSpeed JSON
    nproc: int
    micro: int
    accum: int
    sequence: int = 1  # parallel.sequence (Ulysses)
    tensor: int = 1  # parallel.tensor (AutoTP)
    expert: int = 1  # parallel.expert (AutoEP)

    @property
    def name(self) -> str:
        sizes = "".join(f"_{key}{size}" for key, size in (("sp", self.sequence), ("tp", self.tensor),
                                                          ("ep", self.expert)) if size > 1)
        return f"{Path(self.ds_config).stem}_np{self.nproc}{sizes}_accum{self.accum}"

    def parallel(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with this layout's model-parallel sizes."""
        return replace(cfg, parallel=replace(cfg.parallel, sequence=self.sequence, tensor=self.tensor,
                                             expert=self.expert))

    def describe(self) -> str:
        return "".join(f", {what} parallel {size}" for what, size in (
            ("sequence", self.sequence), ("tensor", self.tensor), ("expert", self.expert)) if size > 1)


@dataclass(frozen=True)
class Job:
    """One run of a launch: its config (complete, as a dict) and DeepSpeed JSON."""

    name: str
    config: dict
    ds_config: str


def layouts(cfg: RunConfig, templates: dict[str, dict], nprocs: list[int], accums: list[int],
            sequences: list[int] | None = None, tensors: list[int] | None = None, hf_config=None,
            experts: list[int] | None = None) -> list[Layout]:
    """Every ds_config (path -> its template) x world size x sequence- and tensor-parallel sizes that
    divide it (x expert-parallel sizes that divide its data ranks) x accumulation, with the micro-batch
    that keeps the global batch (no --grad-accum: the config's micro-batch); each checked by the run's
    own layout check (RunSpec.check), or one line."""
    ds_configs = list(templates)
    g = cfg.train.global_batch_size
    out = []
    sequences = sequences or [cfg.parallel.sequence]
    tensors = tensors or [cfg.parallel.tensor]
    experts = experts or [cfg.parallel.expert]
    several = len(sequences) > 1 or len(tensors) > 1 or len(experts) > 1
    for n, sp, tp, ep in ((n, sp, tp, ep) for n in nprocs for sp in sequences for tp in tensors for ep in experts):
        if (n % (sp * tp) or n // (sp * tp) % ep) and several:
            continue  # sizes of the lists that do not divide this world size: another world size takes them
        cfg_sp = replace(cfg, parallel=replace(cfg.parallel, sequence=sp, tensor=tp, expert=ep))
        dp = plan_dims(cfg_sp.parallel, n).data  # the layout's data-parallel size (refused: one line)
        for accum in accums or [0]:
            micro = cfg.train.micro_batch_size if not accum else g // (accum * dp)
            if accum and (g % (accum * dp) or micro == 0):
                fits = [a for a in range(1, g // dp + 1) if (g // dp) % a == 0] if g % dp == 0 else []
                raise UserError(f"parity: --grad-accum {accum} at {n} process(es) needs train.global_batch_size="
                                f"{g} divisible by {accum} x data-parallel size {dp}; choose "
                                f"{choices(fits) if fits else 'another global batch size'}")
            run = replace(cfg_sp, train=replace(cfg.train, micro_batch_size=micro))
            for d in ds_configs:  # the run's own check of this layout at this world size, or one line
                plan = train_spec(run).check(run, templates[d], n, hf_config)[0].batch
                out.append(Layout(str(d), n, micro, plan.grad_accum_steps, sp, tp, ep))
    return out


def _job(cfg: RunConfig, name: str, out: Path, steps: int, micro: int, accum: int, **changes) -> dict:
    """A run config for one layout (or the reference): `steps` steps, every step logged, no
    checkpoint, no sample; the held-out loss after the last step over one global batch of the val
    split (eval_batches x micro x data-parallel size is the global batch for every layout)."""
    raw = cfg.to_dict()
    raw["output_dir"] = str(out / name)
    raw["train"] |= {"max_steps": steps, "micro_batch_size": micro, "eval_every": 0, "eval_batches": accum,
                     "debug_nonfinite_steps": []}  # (train.debug_loss_fault stays: parity's own test sets it)
    raw["checkpoint"] |= {"every": 0, "save_final": False, "export_final": False, "resume": "restart",
                          "debug_fault": ""}
    raw["log"] |= {"every": 1, "progress": False, "plots": False, "wandb": "off", "tensorboard": False,
                   "sample_prompt": ""}
    raw["watchdog"] |= {"debug_fault": ""}
    for key, value in changes.items():
        section, _, field = key.partition(".")
        raw[section][field] = value
    build_config(raw, source=f"parity job {name}")  # it must load as the worker will load it
    return raw


def reference_template(template: dict, out: Path) -> str:
    """The reference's DeepSpeed JSON: the layout's optimizer, scheduler and clipping, ZeRO-0 (its
    precision comes from model.dtype: fp32 for the reference, the layouts' for the noise floor)."""
    ref = {k: v for k, v in template.items() if k not in ("bf16", "bfloat16", "fp16", "zero_optimization")}
    ref["zero_optimization"] = {"stage": 0}
    path = out / "reference_ds_config.json"
    write_atomic(path, json.dumps(ref, indent=2))
    return str(path)


def dropout(hf_config) -> dict:
    """The config's non-zero dropout probabilities: a layout's runs would differ by their masks."""
    return {k: v for k, v in hf_config.to_dict().items()
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0}


# --- launches --------------------------------------------------------------------------------------

def launch(jobs: list[Job], nproc: int, out: Path, launcher_args: list[str], local: bool,
           name: str = "") -> tuple[int, Path]:
    """Run `jobs` in one process group of `nproc` ranks (the deepspeed launcher; one local process
    for the reference's group); returns its exit code and its log (launch_<name>.log)."""
    name = name or f"np{nproc}"
    plan = out / f"launch_{name}.json"
    write_atomic(plan, json.dumps({"jobs": [job.__dict__ for job in jobs]}, indent=1))
    log = out / f"launch_{name}.log"
    if local:
        cmd = [sys.executable, "-m", "ds_train", "parity-worker", str(plan)]
    else:
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
               "--master_port", str(free_port()), *launcher_args, "--module", "ds_train", "parity-worker",
               str(plan)]
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    return code, log


def run_jobs(plan_path: str) -> int:
    """The worker: every job of the plan in turn, in this launch's one process group."""
    import gc

    from ds_train import dist, topology
    from ds_train.observe.startup import StartupClock
    from ds_train.start import build_run
    from ds_train.train.loop import run_training

    env = topology.detect_env()
    for job in json.loads(Path(plan_path).read_text())["jobs"]:
        clock = StartupClock(time.time())  # this job's start-up, from its start (the process's imports are done)
        cfg = build_config(job["config"], source=f"{plan_path}: {job['name']}")
        inputs = check_inputs(cfg, job["ds_config"])
        clock.mark("inputs")
        with build_run(inputs, env, train_spec(cfg, keep_group=True), quiet=True, clock=clock) as run:
            run_training(run, inputs.data)
        del run, inputs
        gc.collect()  # the engine's memory, before the next layout builds its own
    dist.release_shared_memory(env)
    dist.shutdown()
    return 0


def _launch_failed(code: int, log: Path) -> None:
    """One line from a launch that failed: the error a rank printed, else the end of its log."""
    text = log.read_text(errors="replace").splitlines()
    said = [line for line in text if line.startswith("ds-train")]
    line = said[-1].removeprefix("ds-train: error: ") if said else (text[-1] if text else "no output")
    raise UserError(f"parity: a launch failed (exit {code}): {line}; its output is in {log}")


def parity(cfg: RunConfig, label: str, ds_configs: list[str], nprocs: list[int], accums: list[int], steps: int,
           shrink_it: bool, out: str, launcher_args: str, loss_tol: float | None, grad_tol: float | None,
           sequences: list[int] | None = None, tensors: list[int] | None = None, tf32: bool = False,
           experts: list[int] | None = None) -> int:
    """Every layout against the reference, printed as it goes; 0 when every one is within tolerance."""
    templates = {d: read_ds_template(d) for d in ds_configs}
    if steps <= 0 or min(nprocs) <= 0:
        raise UserError(f"parity: --steps {steps} and --nproc {' '.join(map(str, nprocs))} must be positive")
    for flag, tol in (("--loss-tol", loss_tol), ("--grad-tol", grad_tol)):
        if tol is not None and not (tol > 0 and math.isfinite(tol)):
            raise UserError(f"parity: {flag} {tol}: give a positive relative tolerance, e.g. 1e-3")
    notes = []
    if shrink_it:
        sizes = [s * t for s in sequences or [cfg.parallel.sequence] for t in tensors or [cfg.parallel.tensor]]
        cfg, notes = shrink(cfg, math.lcm(*sizes))
    split = any(s * t * e > 1 for s in sequences or [cfg.parallel.sequence] for t in tensors or [cfg.parallel.tensor]
                for e in experts or [cfg.parallel.expert])
    lays = layouts(cfg, templates, sorted(set(nprocs)), sorted(set(accums)), sorted(set(sequences or [])),
                   sorted(set(tensors or [])), model_config(cfg) if split else None,
                   sorted(set(experts or [])))  # all checked before any launch
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="ds_train_parity_"))
    _check_out(out_dir)
    passed, verdict = _parity(cfg, label, lays, templates, steps, notes, out_dir, shlex.split(launcher_args),
                              loss_tol, grad_tol, tf32)
    if not out:  # a failed launch keeps them: its log is named in the error
        shutil.rmtree(out_dir, ignore_errors=True)
    print(f"\n{verdict}" + (f"; the runs are in {out_dir}" if out else ""))
    return 0 if passed else 1


def _exported_once(cfg: RunConfig, out: Path) -> RunConfig:
    """A ds_train run given as model.path is exported once into `out`, which every run then loads
    (each run would otherwise export its own copy)."""
    from ds_train.checkpoint.export import export

    model_dir, export_from = model_dirs(cfg)
    if export_from is None:
        return cfg
    hf_dir = out / "init_model"
    if not (hf_dir / "config.json").is_file():
        export(export_from, hf_dir)
    raw = cfg.to_dict()
    raw["model"]["path"] = str(hf_dir)
    if not cfg.data.tokenizer:  # the data keeps the run's tokenizer (hf_model/'s, exported with it)
        raw["data"]["tokenizer"] = str(model_dir)
    return build_config(raw, source="parity")


def _check_out(out: Path) -> None:
    """--out holds parity's own runs or nothing: never a directory of something else."""
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / "parity.json").is_file()):
        raise UserError(f"parity: --out {str(out)!r} exists and is not a parity directory; give a new or empty one")
    out.mkdir(parents=True, exist_ok=True)


def _parity(cfg: RunConfig, label: str, lays: list[Layout], templates: dict, steps: int, notes: list[str],
            out: Path, launcher_args: list[str], loss_tol: float | None, grad_tol: float | None,
            tf32: bool) -> tuple[bool, str]:
    """Every layout against the reference, printed as it goes: (all within tolerance, the verdict line)."""
    cfg = _exported_once(cfg, out)
    g, seq = cfg.train.global_batch_size, cfg.train.seq_len
    micro_ref = min(lay.micro for lay in lays)
    # The reference runs the model's own forward: one process, its layers eager (model.compile=true in
    # the layouts is proved against it).
    alone = {"parallel.sequence": 1, "parallel.tensor": 1, "parallel.expert": 1, "train.debug_loss_fault": "",
             "model.compile": False}
    ref_cfg = build_config(_job(cfg, REFERENCE, out, steps, micro_ref, g // micro_ref,
                                **alone, **{"model.dtype": "fp32", "model.tf32": tf32}))
    ref_ds = reference_template(next(iter(templates.values())), out)
    fp32 = {"model.tf32": tf32} if cfg.model.dtype == "fp32" else {}  # (auto is fp32 only where TF32 is not)
    write_atomic(out / "parity.json", json.dumps({"config": label, "steps": steps,
                                                   "layouts": [lay.name for lay in lays]}, indent=1))
    for note in notes:
        print(note)
    print(f"parity: {label}, {steps} steps, global batch {g} x seq_len {seq} = {g * seq:,} tokens per step; "
          f"reference: 1 process, ZeRO-0, fp32, micro {micro_ref} x accum {g // micro_ref}; TF32 "
          f"{'allowed (--tf32)' if tf32 else 'off'} in the fp32 runs")
    ref_inputs = check_inputs(ref_cfg, ref_ds)  # the model and the data, prepared once before any launch
    if dropout(ref_inputs.source.hf_config):
        print(f"note: the model's dropout ({dropout(ref_inputs.source.hf_config)}) draws other masks in each "
              f"layout, so the runs differ by more than rounding; --shrink builds it without dropout")
    # One launch per world size, and per AutoTP size: DeepSpeed makes its tensor groups once a process.
    groups: dict[tuple[int, int], list[Job]] = {(1, 1): [Job(REFERENCE, ref_cfg.to_dict(), ref_ds)]}
    if cfg.model.dtype != "fp32":  # the noise floor: the reference's layout in the layouts' precision
        groups[(1, 1)].append(Job(FLOOR, _job(cfg, FLOOR, out, steps, micro_ref, g // micro_ref, **alone), ref_ds))
    for lay in lays:
        job = _job(cfg, lay.name, out, steps, lay.micro, lay.accum,
                   **{"parallel.sequence": lay.sequence, "parallel.tensor": lay.tensor, "parallel.expert": lay.expert,
                      **fp32})
        groups.setdefault((lay.nproc, lay.tensor), []).append(Job(lay.name, job, lay.ds_config))
    for (n, tp), jobs in sorted(groups.items()):
        name = f"np{n}" + (f"_tp{tp}" if tp > 1 else "")
        print(f"parity: {len(jobs)} run(s) in one launch of {n} process(es) (log: {out / f'launch_{name}.log'})",
              flush=True)
        code, log = launch(jobs, n, out, launcher_args, local=n == 1, name=name)
        if code:
            _launch_failed(code, log)
    reference = series(out / REFERENCE)
    floor = _measured_floor(out, reference) if cfg.model.dtype != "fp32" else None
    passed = 0
    for lay in lays:
        paths = RunPaths(out / lay.name)
        dtype = (read_json_or_none(paths.env) or {}).get("dtype", "fp32")
        stage = zero_stage(read_json_or_none(paths.ds_config) or {})
        print(f"\n{lay.name}: ZeRO-{stage}, {dtype}, {lay.nproc} process(es){lay.describe()}, micro {lay.micro} "
              f"x accum {lay.accum} ({lay.ds_config})")
        lines, ok = compare(series(out / lay.name), reference, *tolerances(dtype, floor, loss_tol, grad_tol))
        print("\n".join(lines))
        passed += ok
    verdict = "PASS" if passed == len(lays) else "FAIL"
    return passed == len(lays), (f"verdict: {verdict}: {passed} of {len(lays)} layout(s) within tolerance of the "
                                 f"reference over {steps} steps")


def _measured_floor(out: Path, reference: dict) -> tuple[float, float] | None:
    """The noise floor of the layouts' precision (None when it resolved to fp32: auto on a CPU), said
    with the tolerances it gives; a floor run without finite numbers is one line."""
    dtype = (read_json_or_none(RunPaths(out / FLOOR).env) or {}).get("dtype", "fp32")
    if dtype == "fp32":
        return None
    floor = noise_floor(series(out / FLOOR), reference)
    if not all(math.isfinite(x) for part in floor for x in part.values()):
        raise UserError(f"parity: the {dtype} noise-floor run (the reference's layout in {dtype}) has no finite "
                        f"loss or gradient norm at some step, so no {dtype} tolerance can be derived; its metrics "
                        f"are in {out / FLOOR}")
    past = floor_problem(dtype, floor)
    if past:
        raise UserError(f"parity: the {dtype} noise-floor run (the reference's layout in {dtype}) differs from the "
                        f"fp32 reference by more than {dtype} rounding explains: {past} (ds_train/parity/"
                        f"tolerance.py FLOOR_BOUNDS): that precision's path computes something else, so no {dtype} "
                        f"tolerance can be derived; its metrics are in {out / FLOOR} (model.dtype=fp32 compares "
                        f"the layouts without it)")
    loss_tol, grad_tol = tolerances(dtype, floor, None, None)
    first = next(iter(floor[1]))
    print(f"\nnoise floor: the reference's layout in {dtype} differs from it in fp32 by up to {floor[0]['eval']:.1e} "
          f"(loss) and {max(floor[1].values()):.1e} (gradient norm) over {len(floor[1])} steps; a {dtype} layout may "
          f"differ by {FLOOR_FACTOR}x the floor so far at each step (at step {first}: loss {loss_tol[first]:.1e}, "
          f"gradient norm {grad_tol[first]:.1e})")
    return floor
