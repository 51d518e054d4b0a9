"""What the bench/gpu scripts share: model shapes, run configs, subprocesses, the versions record.

Every script writes to one output directory (--out): results.json, one log per subprocess, and
versions.json with what the machine actually had. `--reduced` swaps the model for a tiny one and
the GPU for this CPU, so the test suite runs each script end to end and none of them rots; its
numbers mean nothing. Each measured side runs in its own process (a fresh allocator, so peak
memory is its own), one after another, never at the same time.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere, with or without `pip install -e`
    sys.path.insert(0, str(ROOT))

# ~1.1B parameters (TinyLlama's shape: 22 layers, hidden 2048, GQA 32 / 4 heads, 32k vocabulary).
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}
# ~124M parameters: the memory planner's cases (at least 100M, as the issue asks).
LLAMA_124M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
              "max_position_embeddings": 2048, "tie_word_embeddings": False}
# --reduced: seconds on a CPU.
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": False}
DEFAULT_DATA = ROOT / "data" / "cache" / "python_stdlib"  # the quickstart's corpus, prepared on first use


def add_common_args(p) -> None:
    p.add_argument("--out", required=True, help="output directory (results.json, logs, versions.json)")
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="prepared data directory (default: the bundled corpus, prepared on first use)")
    p.add_argument("--reduced", action="store_true",
                   help="a tiny model on this CPU: checks the script end to end, measures nothing")
    p.add_argument("--timeout", type=float, default=540, help="seconds per subprocess (default 540)")


def check_device(reduced: bool) -> None:
    import torch

    if not reduced and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or add --reduced for the CPU check")


def start(args, model: dict) -> tuple[Path, dict, int, str]:
    """Checks the device and prepares the corpus; (output dir, model, seq_len, dtype): `model` at seq
    2048 in bf16 on a GPU, the tiny one at 64 in fp32 under --reduced."""
    check_device(args.reduced)
    out = Path(args.out).resolve()
    prepare(out, args.data, args.timeout)
    return (out, TINY, 64, "fp32") if args.reduced else (out, model, 2048, "bf16")


def run_config(out: Path, name: str, model: dict, data: str, *, seq: int, micro: int, global_batch: int,
               steps: int, dtype: str, ckpt: bool = False, compile: bool | None = None, log_every: int = 5,
               model_keys: dict | None = None, **sections) -> Path:
    """A ds_train run config (YAML) under out/configs; the run directory out/runs/NAME starts empty.
    A prepared corpus is named by its directory alone: its sources' fingerprint (the bundled corpus:
    this host's Python standard library) is not checked on a host with another Python (the GPU's).
    Only the bundled corpus not yet prepared names its source, to be prepared from it. `compile`:
    model.compile (None: ds_train's default); `model_keys`: more model.* keys; `sections`: more keys of
    other sections."""
    import yaml

    from ds_train.data.meta import META

    shutil.rmtree(out / "runs" / name, ignore_errors=True)  # this bench's own directory: never a resume

    cfg = {"output_dir": str(out / "runs" / name), "seed": 1234,
           "model": {"config": dict(model), "dtype": dtype, "activation_checkpointing": ckpt,
                     **({} if compile is None else {"compile": compile}), **(model_keys or {})},
           "data": {"dir": data} if Path(data) != DEFAULT_DATA or (Path(data) / META).is_file() else
                   {"dir": data, "sources": ["python-stdlib"], "vocab_size": 4096},
           "train": {"max_steps": steps, "micro_batch_size": micro, "global_batch_size": global_batch,
                     "seq_len": seq, "eval_every": 0, "eval_batches": 1},
           "optim": {"lr": 3e-4, "warmup_steps": 2},
           "checkpoint": {"every": 0, "save_final": False, "export_final": False},
           "log": {"every": log_every, "wandb": "off", "progress": False, "sample_prompt": "", "plots": False}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """One process of world size 1 (the env a launcher would give it; or `env`, its whole environment),
    in its own session; output to `log`. Returns (exit code, seconds); past `timeout` the whole group
    is killed (exit 124)."""
    env = env or {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.perf_counter() - t0


def ds_train(*args: str) -> list[str]:
    return [sys.executable, "-m", "ds_train", *args]


def launch_jobs(out: Path, name: str, jobs: list[tuple[str, Path, dict]], ds_config: str,
                timeout: float) -> tuple[int, float, Path]:
    """Several ds_train runs in turn as the jobs of one process (ds_train's parity worker: a plan's
    runs, each whole in its own run directory, in one process group), so that a reduced CPU check
    imports torch and DeepSpeed once. `jobs`: (job name, run config YAML, changes to its train
    section: a run again with more steps resumes). Returns (exit code, seconds, log)."""
    import yaml

    plan = {"jobs": []}
    for job, cfg, train in jobs:
        config = yaml.safe_load(cfg.read_text())
        config["train"].update(train)
        plan["jobs"].append({"name": job, "config": config, "ds_config": ds_config})
    path = out / "configs" / f"{name}.plan.json"
    path.write_text(json.dumps(plan, indent=1))
    log = out / "logs" / f"{name}.log"
    rc, wall = launch(ds_train("parity-worker", str(path)), log, timeout)
    return rc, wall, log


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


def prepare(out: Path, data: str, timeout: float) -> None:
    """Prepare the corpus once, before anything is timed (nothing to do when it is prepared)."""
    from ds_train.data.meta import META

    if (Path(data) / META).is_file():
        return
    cfg = run_config(out, "prepare", TINY, data, seq=64, micro=1, global_batch=1, steps=1, dtype="fp32")
    rc, _ = launch(ds_train("prepare", "--config", str(cfg)), out / "logs" / "prepare.log", timeout)
    if rc:
        raise SystemExit(f"prepare failed (exit {rc}); its log: {out / 'logs' / 'prepare.log'}")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def versions() -> dict:
    """What this machine had: Python, torch / CUDA, DeepSpeed, transformers, accelerate, the device."""
    import importlib.metadata as md

    import torch

    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu_count": os.cpu_count()}
    for name in ("deepspeed", "transformers", "accelerate", "tokenizers", "pydantic"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), gpu_memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}")
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out["driver"] = None
    else:
        out["device"] = "cpu"
    return out


def write_results(out: Path, name: str, results: dict) -> Path:
    """results.json (and versions.json) in out; returns the results path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "versions.json").write_text(json.dumps(versions(), indent=2) + "\n")
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
