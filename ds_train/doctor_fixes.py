"""What `ds-train doctor` tells a user to do about each class of finding, the first fix first. A
CUDA out-of-memory in a run directory gets the memory plan's fix: the cheapest change the planner
says fits this run on GPUs of the size the error names."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

from ds_train.errors import UserError
from ds_train.rundir import read_json


def _match(f, pattern: str) -> str:
    for e in f.evidence + f.context:
        m = re.search(pattern, e)
        if m:
            return next((g for g in m.groups() if g is not None), "")
    return ""


def _fix_cuda_oom(f, view) -> list[str]:
    gib = _match(f, r"total capacity of ([\d.]+) GiB|world \d+, ([\d.]+) GiB each")  # torch's line, or ours
    planned = _planned_fix(view, float(gib)) if view is not None and gib else []
    return planned + [
        "lower train.micro_batch_size (the global batch stays: more accumulation), turn on "
        "model.activation_checkpointing=true, or move to a higher ZeRO stage (--ds-config ds_configs/zero3.json)",
        "`ds-train estimate --config C --ds-config D --nodes N --gpus-per-node G --gpu-memory GIB --preset balanced` "
        "prints the configuration that fits, before queueing the job",
        "fragmentation (much reserved but unallocated): export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "(ds-train launch forwards it)"]


def _planned_fix(view, gpu_gib: float) -> list[str]:
    """The cheapest change the memory planner says fits this run on GPUs of `gpu_gib`."""
    from ds_train.configfile import load_config
    from ds_train.plan import Target, ds_config_dtype, pick_preset, plan_rows, suggestions

    try:
        cfg = load_config(str(view.paths.config), [])
        ds_config = read_json(view.paths.ds_config) or {}
        from ds_train.memory import model_shape
        from ds_train.model.hfconfig import build_hf_config

        # The run's own model config (hf_model/, written at start-up), else the config's, vocabulary as planned.
        model = replace(cfg.model, path=str(view.paths.hf_model), config={}) \
            if (view.paths.hf_model / "config.json").is_file() else cfg.model
        shape = model_shape(build_hf_config(model, int(cfg.model.config.get("vocab_size") or cfg.data.vocab_size),
                                            cfg.train.seq_len, weights=False))
    except (UserError, OSError, ValueError, KeyError, TypeError) as e:
        return [f"(the memory plan needs the run's config.yaml and ds_config.json: {str(e).splitlines()[0][:120]})"]
    world = int(view.env.get("world_size") or 1)
    target = Target(1, world, gpu_gib)
    dtype = ds_config_dtype(ds_config)
    zero = ds_config.get("zero_optimization", {"stage": 0})
    given = next((r for r in plan_rows(shape, cfg, zero, target, dtype) if r["given"]), None)
    plan = f" (this run: {given['gpu_peak_gib']:.1f} GiB planned)" if given else ""
    for s in suggestions(shape, cfg, zero, target, dtype):
        if s["fits"]:
            return [f"{s['change']}: the memory plan puts the per-GPU peak at {s['gpu_peak_gib']:.1f} GiB of "
                    f"{gpu_gib:.1f} GiB{plan}"]
    try:
        p = pick_preset(shape, cfg, target, dtype, "balanced")
    except UserError as e:
        return [str(e)]
    return [f"--ds-config {p['ds_config']} {p['overrides']}: the memory plan puts the per-GPU peak at "
            f"{p['gpu_peak_gib']:.1f} GiB of {gpu_gib:.1f} GiB{plan}"]


MISSING_MODULE = r"No module named '([^']+)'"


def _on(f) -> str:
    return f" on {f.where}" if f.where else ""


FIXES: dict[str, Callable] = {
    "cuda_oom": _fix_cuda_oom,
    "cpu_oom": lambda f, v: [
        f"host memory ran out{_on(f)}: offloaded optimizer states (ds_configs/*_offload.json) and every rank's "
        "copy of the model live in CPU RAM; use a ds_config without offload, fewer ranks per node, or nodes "
        "with more memory",
        "check the limit the job ran under: `ulimit -v`, the SLURM job's --mem (sacct -j JOB -o MaxRSS,ReqMem), "
        "or the container's memory limit",
        "`dmesg -T | grep -i -E 'killed process|out of memory'` on that host confirms an OOM kill"],
    "killed_rank": lambda f, v: [
        f"{f.where or 'a rank'} was killed by a signal (SIGKILL leaves no traceback): `dmesg -T | grep -i 'killed "
        "process'` on its host shows whether the kernel's OOM killer did it; if so, lower host memory (no offload, "
        "fewer ranks per node)",
        "under SLURM, `sacct -j JOB -o JobID,State,ExitCode,MaxRSS` tells a time or memory limit from a node failure",
        "the other ranks' connection errors that follow are consequences, not causes"],
    "nccl_timeout": lambda f, v: [
        "a collective waited past dist.timeout_s: some rank never reached it. The rank whose log ends first, or "
        "with an error, is the cause; set watchdog.stall_s (below dist.timeout_s) so ds_train names the stuck "
        "rank, its phase and its stack long before NCCL's timeout",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL shows mismatched collectives (a code path taken by some ranks only); "
        "ds-train launch forwards it to every node",
        "if the steps are just slow (a huge save, a slow file system), raise dist.timeout_s"],
    "nccl_error": lambda f, v: [
        "rerun with NCCL_DEBUG=INFO (ds-train launch forwards NCCL_* to every node) and read the first "
        "`NCCL WARN` line: it names the failing transport and interface",
        "choose the interface the nodes reach each other on: NCCL_SOCKET_IFNAME=<iface> (see `ip -br addr`; not "
        "lo or docker0)",
        "InfiniBand: `ibstat` must show the ports Active on every node; NCCL_IB_DISABLE=1 tests over TCP, "
        "NCCL_IB_HCA selects the adapters"],
    "port_in_use": lambda f, v: [
        f"another process holds the master port{_on(f)}: a previous job still running, or another user; choose "
        "another port (`deepspeed --master_port P`, `ds-train launch --master_port P`)",
        "`ss -ltnp | grep :PORT` on the first host shows who holds it; stop a stale job with `pkill -f ds_train`"],
    "ssh": lambda f, v: [
        f"the launcher could not ssh to a node{_on(f)}: `ssh HOST true` from the launching node must work without "
        "a password (key in ~/.ssh/authorized_keys, host key in known_hosts)",
        "the hostfile must name hosts as ssh resolves them: fix the name, or add it to /etc/hosts or ~/.ssh/config",
        "extra ssh options (port, identity file) go in PDSH_SSH_ARGS_APPEND; `ds-train launch` checks every host "
        "before starting"],
    "missing_module": lambda f, v: [
        f"module {_match(f, MISSING_MODULE) or '?'} is missing{_on(f)}: install "
        "the same environment on every node (the same venv path, e.g. on a shared file system, with pip install "
        "-r requirements.txt), or forward PYTHONPATH (ds-train launch does when it is set)",
        "`ds-train launch` compares Python, torch, DeepSpeed and ds_train versions on every host before it starts"],
    "wandb_login": lambda f, v: [
        "log in to Weights & Biases on every node that logs (rank 0's): `wandb login`, or export WANDB_API_KEY "
        "(ds-train launch forwards it only when listed in launch.env, as it looks like a secret)",
        "no network to wandb from the nodes: log.wandb=offline, then `wandb sync RUN_DIR/wandb/offline-run-*` "
        "from a machine that has one; or log.wandb=off"],
    "rendezvous": lambda f, v: [
        "every rank must reach MASTER_ADDR:MASTER_PORT (rank 0's host): use an address of the first host that "
        "the others reach, and open the port in the firewall (`nc -zv ADDR PORT` from another node)",
        "ranks that start late (slow file systems, container pulls) need a longer dist.join_timeout_s",
        "a torch built without libuv (some Windows and older builds): export USE_LIBUV=0"],
    "disk_full": lambda f, v: [
        "the file system ran full: free space (`df -h` on output_dir), lower checkpoint.keep, or choose an "
        "output_dir with room; the same command resumes from the last complete checkpoint",
        "`ds-train estimate` prints the size of one checkpoint"],
    "nonfinite": lambda f, v: [
        "the loss or gradients became NaN/inf: resume from the last good checkpoint with a lower optim.lr, a "
        "longer optim.warmup_steps, or train.grad_clip set",
        "fp16 overflows where bf16 does not: use a ds_config with bf16 on GPUs that have it",
        "train.nonfinite=skip skips such steps instead of stopping (DeepSpeed never applies them)"],
    "hang": lambda f, v: [
        (f"{f.where} stopped making progress" if f.where else "the hang report names the rank that never arrived")
        + ": its logs/stacks_rank_<r>.txt (on its node) shows where it is stuck; the ranks waiting in a "
        "collective are consequences",
        "usual causes: a code path that skips a collective on some ranks, a slow or stuck file system read, a "
        "dead peer; py-spy dump --native --pid PID shows native frames",
        "a long save or evaluation that is not a hang: raise watchdog.stall_s"],
    "config_error": lambda f, v: [
        "fix the input the line names (file, key or value); `ds-train train --help-config` lists every key",
        "`ds-train estimate --config C --ds-config D --nodes N --gpus-per-node G` checks the batch math for the "
        "target cluster on any machine"],
    "rank_error": lambda f, v: [
        f"an exception{_on(f)}: its traceback is in logs/rank_<r>.log of that rank (on its node); the other "
        "ranks' errors that follow are consequences",
        "rerun with `--debug` for full tracebacks and DeepSpeed's info logs"],
}
