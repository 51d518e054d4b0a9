"""`ds-train launch` and `ds-train slurm`.

    ds-train launch --hostfile hostfile [deepspeed launcher flags] -- train --config C --ds-config D [k=v]
    ds-train launch --hostfile hostfile --check -- ript ...      # the preflight alone
    ds-train slurm --nodes 2 --gpus-per-node 8 --time 24:00:00 --requeue --out job.sbatch -- train ...

Both subcommands take their arguments raw (deepspeed launcher or srun flags pass through
unparsed) and split them at the first `--`: what follows is the command run on every rank (train or ript),
checked by the function the CLI registers (its own parser, its config, its batch math at the
target world size).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from ds_train.checkpoint.rundir import RunPaths
from ds_train.errors import OneLineParser, UserError
from ds_train.fs import write_atomic
from ds_train.observe.launchers import BEAT_ENV, BEAT_S, launch_beat_s

# DeepSpeed's runner default (deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT).
DEFAULT_MASTER_PORT = 29500


# The command after `--`, the target world size, ranks a node, the hosts' device ("cuda", "cpu" or None:
# not known yet) and each node's ranks (preflight.NodeRanks, or None) -> (run config, batch plan), or a UserError:
# the ranks' own checks (inputs.check_launch), and a split job the nodes cannot run.
CheckCommand = Callable[[list[str], int, int | None, str | None, object], tuple]
# The command after `--` and the target world size -> the memory plan's per-GPU peak in GiB.
PlanMemory = Callable[[list[str], int], float]


def add_subcommands(sub, check_command: CheckCommand, plan_memory: PlanMemory) -> None:
    """Register `launch` and `slurm` on ds_train.__main__'s subparsers."""
    # prefix_chars="+": every `-flag` reaches our own parser untouched (argparse would otherwise
    # reject the deepspeed flags it does not know before we see them).
    for func in (cmd_launch, cmd_slurm):
        p = sub.add_parser(func.__name__.removeprefix("cmd_"), help=_doc(func)[0], prefix_chars="+", add_help=False)
        p.add_argument("argv", nargs=argparse.REMAINDER)
        p.set_defaults(func=func, check_command=check_command, plan_memory=plan_memory)


def _doc(func) -> tuple[str, str]:
    """A subcommand's (help, description): the first line of its function's docstring, and the rest."""
    import inspect

    help_, _, description = inspect.cleandoc(func.__doc__).partition("\n\n")
    return help_, " ".join(description.split())


def _parser(func, usage: str) -> argparse.ArgumentParser:
    """The parser of launch or slurm (given their arguments raw), its description from func's docstring."""
    name = f"ds-train {func.__name__.removeprefix('cmd_')}"
    return OneLineParser(prog=name, allow_abbrev=False, usage=f"{name} {usage}", description=_doc(func)[1])


def _launch_parser() -> argparse.ArgumentParser:
    p = _parser(cmd_launch, "--hostfile H [--check] [deepspeed launcher flags] -- {train,ript} --config C "
                            "--ds-config D [key=value ...]")
    p.add_argument("-H", "--hostfile", required=True, help="DeepSpeed hostfile: '<host> slots=<n>' per line")
    p.add_argument("--check", action="store_true", help="run the preflight only")
    p.add_argument("--ssh-timeout", type=int, default=10, help="ssh connect timeout per host, seconds")
    g = p.add_argument_group("deepspeed launcher flags that the preflight reads (passed on)")
    g.add_argument("--num_nodes", type=int, default=-1)
    g.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    g.add_argument("-i", "--include", default="")
    g.add_argument("-e", "--exclude", default="")
    g.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT,
                   help="tried first; the next free one of 10 is taken when it is busy")
    g.add_argument("--master_addr", default="", help="default: the first host's address")
    g.add_argument("--ssh_port", type=int)
    g.add_argument("--launcher", default="pdsh")
    refused = p.add_argument_group("refused (ds-train launch sets or needs them)")
    for flag in ("--module", "--no_python", "--no_ssh"):
        refused.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    refused.add_argument("--autotuning", help=argparse.SUPPRESS)
    return p


def _split(argv: list[str], name: str) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            return argv, []
        raise UserError(f"{name}: missing `-- train|ript --config C --ds-config D`; everything after `--` is "
                        f"the command run on every rank")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _check_run(args, command: list[str], world_size: int, local_world_size: int | None = None,
               device: str | None = None, nodes=None):
    """The command after `--`, checked as its ranks check it at this world size: (run config, batch plan).
    `nodes`: each node's ranks (preflight.NodeRanks), where the launch knows them."""
    if not command:
        raise UserError(f"{args.command}: nothing after `--`; give `train` or `ript` with --config and --ds-config")
    return args.check_command(command, world_size, local_world_size, device, nodes)


def _check_flags(opts) -> None:
    refused = [f"--{k}" for k in ("module", "no_python", "no_ssh", "autotuning") if getattr(opts, k)]
    if refused:
        raise UserError(f"launch: {', '.join(refused)} not supported here (ds-train launch runs `--module "
                        f"ds_train` over ssh after its own ssh check); call `deepspeed` directly for that")
    if opts.launcher.lower() != "pdsh":
        raise UserError(f"launch: --launcher {opts.launcher} is not supported; ds-train launch drives the "
                        f"pdsh launcher (the default); use `deepspeed --launcher {opts.launcher}` directly")


def _check_local(cwd: str, python: str, command_argv: list[str], variables: dict[str, str]) -> None:
    """What must survive the launcher's remote command line, checked before any ssh."""
    from ds_train.launch import envfile
    from ds_train.launch.preflight import check_shell_safe

    problems = check_shell_safe(cwd, python, command_argv)
    try:
        envfile.check_values({**envfile.launcher_forwarded(os.environ), **variables})
    except UserError as e:
        problems.append(str(e))
    if problems:
        raise UserError("launch: " + problems[0] if len(problems) == 1 else
                        f"launch: {len(problems)} problems:\n  " + "\n  ".join(problems))


def _notes(pool: dict, passthrough: list[str]) -> list[str]:
    notes = []
    strays = [Path(".deepspeed_env"), Path.home() / ".deepspeed_env"]
    strays += [Path(os.environ["DS_ENV_FILE"])] if os.environ.get("DS_ENV_FILE") else []
    for stray in strays:
        if stray.is_file():
            notes.append(f"note: {stray} is not read (DS_ENV_FILE points at the run's own file); list the "
                         f"variables you need from it under launch.env")
    if len(pool) == 1 and "--force_multi" not in passthrough:
        notes.append(f"note: one host: the deepspeed launcher runs it on this machine without ssh (pass "
                     f"--force_multi to start it on {next(iter(pool))} through pdsh)")
    return notes


def _deepspeed_cmd(opts, passthrough: list[str], python: str, master_addr: str, master_port: int,
                   command_argv: list[str]) -> list[str]:
    return [python, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", os.path.abspath(opts.hostfile),
            *(["--num_nodes", str(opts.num_nodes)] if opts.num_nodes >= 0 else []),
            *(["--num_gpus", str(opts.num_gpus)] if opts.num_gpus >= 0 else []),
            *(["--include", opts.include] if opts.include else []),
            *(["--exclude", opts.exclude] if opts.exclude else []),
            *(["--ssh_port", str(opts.ssh_port)] if opts.ssh_port is not None else []),
            "--master_addr", master_addr, "--master_port", str(master_port),
            "--no_ssh_check",  # done by the preflight, with the ssh options pdsh uses (DeepSpeed's ignores them)
            *passthrough, "--module", "ds_train", *command_argv]


def cmd_launch(args) -> int:
    """preflight a hostfile, then run the deepspeed launcher (multi-node)

    Check the command after `--` (its own parser, its batch math at this world size) and every host of
    the hostfile (ssh without a password, same Python and versions, working directory, free master
    port, no machine named twice: DS_TRAIN_ONE_MACHINE=h1,h2 allows a test cluster on one machine),
    write output_dir/.deepspeed_env, then run the deepspeed launcher (pdsh) and exit with its
    exit code; its last line says how the job ended (done, the hang or failure report, a stop by a
    signal, or the exit code); --check ends with the preflight's verdict. SIGTERM, SIGINT or
    SIGUSR1 sent to it reach every rank on every node: each saves a checkpoint and stops; if it is
    killed, the ranks see its beat stop (six beats of 5 s, DS_TRAIN_LAUNCHER_BEAT_S), save and stop too. Other flags
    before `--` go to the deepspeed launcher unchanged."""
    from ds_train.launch import envfile
    from ds_train.launch.hostfile import read_hostfile, select_hosts
    from ds_train.launch.packages import run_modules, run_packages
    from ds_train.launch.preflight import SshOptions, node_ranks, one_machine_hosts, run_preflight

    ours, command_argv = _split(args.argv, "launch")
    opts, passthrough = _launch_parser().parse_known_args(ours)
    _check_flags(opts)
    beat_s = launch_beat_s(os.environ)
    hosts = read_hostfile(opts.hostfile)
    pool = select_hosts(hosts, opts.num_nodes, opts.num_gpus, opts.include, opts.exclude)
    nodes = node_ranks(pool, hosts, opts.hostfile)  # each node's ranks, as the deepspeed launcher starts them
    world_size, per_node = nodes.world_size, nodes.per_node  # per_node: what divides every node's ranks
    cfg, plan = _check_run(args, command_argv, world_size, per_node, nodes=nodes)
    cwd, python = os.path.abspath("."), sys.executable
    variables = envfile.collect_env(os.environ, list(cfg.launch.env), cwd)
    _check_local(cwd, python, command_argv, variables)

    ssh = SshOptions.from_env(os.environ, opts.ssh_timeout, opts.ssh_port)
    result = run_preflight(pool, ssh, python, cwd, opts.master_addr, opts.master_port,
                           needed_gib=lambda: args.plan_memory(command_argv, world_size),
                           packages=run_packages(cfg.log, cfg.ript, cfg.benchmarks),
                           modules=run_modules(cfg, optional=True),
                           where={h.name: f"{opts.hostfile}:{h.line}" for h in hosts},
                           one_machine=one_machine_hosts(os.environ), nodes=nodes,
                           rollout_per_node=cfg.ript.rollout_ranks_per_node if command_argv[0] == "ript" else 0)
    _check_run(args, command_argv, world_size, per_node, "cuda" if result.on_gpu else "cpu")  # its ds_config
    print(f"preflight: {len(pool)} host(s), world size {world_size} "
          f"({', '.join(f'{h}: {len(s)}' for h, s in pool.items())}); ssh, Python {python}, versions and "
          f"working directory {cwd} ok on every host")
    print(f"preflight: {plan.describe()}")
    for note in result.notes + _notes(pool, passthrough):
        print(f"preflight: {note}")
    print(f"preflight: master {result.master_addr}:{result.master_port}", flush=True)
    if opts.check:
        print(f"launch: preflight ok on {len(pool)} host(s), world size {world_size}; nothing launched (--check)",
              flush=True)
        return 0

    # The host of each node, in rank order: a rank that never reaches the rendezvous is named by it.
    variables = {**variables, "DS_TRAIN_HOSTS": ",".join(pool), BEAT_ENV: f"{beat_s:g}"}  # see observe/launchers.py
    env_file = envfile.write_env_file(Path(cfg.output_dir) / envfile.ENV_FILE, variables)
    print(f"launch: wrote {env_file} ({', '.join(variables)})")
    cmd = _deepspeed_cmd(opts, passthrough, python, result.master_addr, result.master_port, command_argv)
    print(f"launch: {' '.join(cmd)}", flush=True)
    return supervise(cmd, {**os.environ, "DS_ENV_FILE": str(env_file)}, result.master_addr, result.master_port,
                     Path(cfg.output_dir), beat_s)


def supervise(cmd: list[str], env: dict[str, str], master_addr: str, master_port: int, run_dir: Path,
              beat_s: float = BEAT_S) -> int:
    """Run the deepspeed launcher and wait for it. SIGTERM, SIGINT and SIGUSR1 (SLURM's warning
    before the time limit) sent to this process reach every rank on every node through the
    rendezvous store: each saves and stops, as if it had the signal itself (the launcher alone
    cannot pass SIGUSR1 on, nor anything through pdsh). When the job is over, the last line says
    how (final_line): done, the hang or failure report of the rank that wrote one, or the exit code."""
    import signal
    import socket
    import subprocess
    import threading
    import time

    from ds_train.dist import store
    started = time.time()
    proc = subprocess.Popen(cmd, env=env)
    signals, helpers, done = [], [], threading.Event()

    def forward(signum, frame) -> None:
        signals.append(signum)
        if len(signals) > 1 and signum in (signal.SIGINT, signal.SIGTERM):
            proc.send_signal(signal.SIGTERM)  # asked twice: DeepSpeed's launcher stops the ranks now
            return

        def send() -> None:
            if not store.send_stop(master_addr, master_port, signum) and signum != signal.SIGUSR1:
                proc.send_signal(signum)  # the ranks are not up yet: the launcher stops them
        helpers.append(threading.Thread(target=send, daemon=True))
        helpers[-1].start()

    def beat() -> None:  # while this process lives, the ranks on every node know it does
        channel = None
        while not done.is_set():
            try:
                if channel is None:  # a plain connect first: torch's client logs each refusal
                    socket.create_connection((master_addr, master_port), timeout=beat_s).close()
                    channel = store.SideChannel(master_addr, master_port, timeout_s=beat_s)
                channel.add("launcher/beats", 1)
            except OSError:  # the job's store is not up yet
                pass
            except Exception:  # the store went with rank 0: the job is ending, its ranks say why
                return
            done.wait(beat_s)
    helpers.append(threading.Thread(target=beat, daemon=True))
    helpers[-1].start()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # A store connection under way as the job ended (the store went with rank 0) retries for up to ~4 of its
    # timeouts, and torch logs each try on stderr: wait for it, so that the verdict below stays the last line.
    done.set()
    for helper in helpers:
        helper.join(timeout=4 * max(beat_s, 5.0) + 5)
    code = code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it
    print(final_line(run_dir, code, started), file=sys.stderr if code else sys.stdout, flush=True)
    return code


# Exit codes whose reason the ranks printed themselves (ds_train/__main__.py): what the job's last line calls them.
SAID_BY_THE_RANKS = {2: "bad input, named in the error line above",
                     3: "too many non-finite steps (train.nonfinite=stop), said in the ranks' error line above",
                     4: "CUDA out of memory, with the memory plan's fixes above"}


def final_line(run_dir: Path, code: int, since: float) -> str:
    """How the job ended, in one line: done, the report a rank wrote into run_dir/logs, else the code
    and, where the ranks said why, what it means. It follows the launchers' own last lines ("Process
    ... exits successfully", "exits with return code = 2"), which would otherwise end the output."""
    import json

    if code == 0:
        return f"launch: done, every rank exited 0; run directory {run_dir.resolve()}"
    paths = RunPaths(run_dir)
    for path in (paths.hang_report, paths.failure):
        try:
            if path.stat().st_mtime >= since:
                return f"ds-train: error: {json.loads(path.read_text())['line']}"
        except (OSError, ValueError, KeyError):
            continue
    if code > 128:
        latest = paths.latest
        saved = latest.read_text().strip() if latest.is_file() and latest.stat().st_mtime >= since else ""
        return (f"ds-train: stopped by signal {code - 128}; " +
                (f"checkpoint {saved} saved; the same command resumes from it" if saved else
                 "no checkpoint was saved by this job"))
    logs = f"each rank's output is in {paths.logs}/rank_<r>.log on its node"
    if code == 2:  # mostly refused at start-up, before a rank opened its log
        return f"ds-train: error: the job ended with exit code 2: {SAID_BY_THE_RANKS[2]}"
    if code in SAID_BY_THE_RANKS:
        return f"ds-train: error: the job ended with exit code {code}: {SAID_BY_THE_RANKS[code]}; {logs}"
    return f"ds-train: error: the job ended with exit code {code}; {logs}"


def _slurm_parser() -> argparse.ArgumentParser:
    p = _parser(cmd_slurm, "--nodes N --gpus-per-node G [options] [srun flags] -- {train,ript} --config C "
                           "--ds-config D [key=value ...]")
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node")
    p.add_argument("--partition", default="", help="SLURM partition")
    p.add_argument("--time", default="", help="time limit, e.g. 24:00:00")
    p.add_argument("--job-name", default="ds_train", help="job name (default ds_train)")
    p.add_argument("--account", default="", help="SLURM account")
    p.add_argument("--requeue", action="store_true",
                   help="queue the job again after its save before the time limit (and on preemption)")
    p.add_argument("--signal-lead", type=int, default=300,
                   help="seconds before the time limit to save (SIGUSR1; default 300, 0: none); SLURM may "
                        "send it up to ~30 s earlier")
    p.add_argument("--no-gpu-request", action="store_true",
                   help="do not request GPUs (CPU nodes, or a site that gives them by partition)")
    p.add_argument("--out", default="", help="write the script here (default: stdout)")
    return p


def cmd_slurm(args) -> int:
    """write an sbatch script that launches through the deepspeed launcher

    Write an sbatch script that runs every rank as a SLURM task (srun, no ssh), asks SLURM for SIGUSR1
    --signal-lead seconds before the time limit (every rank saves and exits 138) and, with --requeue,
    queues the job again after that save. Flags not listed here go to srun."""
    from ds_train.launch.slurm import SlurmJob, render_sbatch

    ours, command_argv = _split(args.argv, "slurm")
    opts, srun_args = _slurm_parser().parse_known_args(ours)
    job = SlurmJob(opts.nodes, opts.gpus_per_node, opts.partition, opts.time, opts.job_name, opts.account,
                   opts.requeue, opts.signal_lead, not opts.no_gpu_request)
    # as its ranks check it, here rather than in the queue (on GPUs when the job asks SLURM for them)
    _check_run(args, command_argv, opts.nodes * opts.gpus_per_node, opts.gpus_per_node,
               "cuda" if job.request_gpus else None)
    script = render_sbatch(job, sys.executable, os.path.abspath("."), srun_args, command_argv)
    size = f"{opts.nodes} node(s) x {opts.gpus_per_node} rank(s)"
    if not opts.out:  # the script alone on stdout (`> job.sbatch`); what was done on stderr
        sys.stdout.write(script)
        sys.stdout.flush()
        print(f"slurm: wrote the sbatch script ({size}) to stdout; submit it with sbatch", file=sys.stderr)
        return 0
    write_atomic(Path(opts.out), script)
    print(f"slurm: wrote {opts.out} ({size}); submit it with: sbatch {opts.out}", file=sys.stderr)
    return 0
