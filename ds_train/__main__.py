"""ds-train: config-driven DeepSpeed training of Hugging Face causal LMs.

    deepspeed --num_gpus 2 --module ds_train train --config recipes/quickstart.yaml
        --ds-config ds_configs/zero2.json train.max_steps=50
    torchrun --nproc_per_node 2 -m ds_train train --config ... --ds-config ...
    ds-train train --config ... --ds-config ...          # one process
    deepspeed --num_gpus 2 --module ds_train ript --config recipes/ript_demo.yaml
        --ds-config ds_configs/zero2.json                # RIPT post-training (RLOO)
    ds-train prepare SOURCE... --out DIR                 # tokenise text/JSONL into .bin files
    ds-train convert --to universal RUN_DIR              # DeepSpeed universal checkpoint
    ds-train export RUN_DIR --out hf_dir                 # Hugging Face model directory
    ds-train launch --hostfile H -- train --config C --ds-config D   # preflight, then deepspeed
    ds-train slurm --nodes 2 --gpus-per-node 8 -- ript ...           # an sbatch script
    ds-train estimate --config C --ds-config D --nodes 2 --gpus-per-node 8   # memory plan
    ds-train dry-run --config C --ds-config D --hostfile hostfile            # one-device rehearsal
    ds-train parity --config C --ds-config D --nproc 2 [--shrink]  # the layout against a 1-process reference
    ds-train monitor RUN_DIR [--once]                    # watch a run from another terminal
    ds-train doctor RUN_DIR [LOGFILE ...]                # what went wrong, and what to do
    ds-train plot RUN_DIR [RUN_DIR ...]                  # PNG plots, several runs overlaid

The last line a command prints says how it ended and where its output went (`train: done, 200 steps,
final loss ..., eval loss ...; checkpoint step_00000200; run directory ...`); after a failure it is
the `ds-train: error:` line, after a stop by a signal `ds-train: stopped ...`.

Exit codes: 0 done; 1 a rank failed (the job's last line names the first one, its host and the
end of its log), or parity found a layout past its tolerances; 2 bad input (one line naming the
file, key or value); 3 too many non-finite steps (train.nonfinite=stop); 4 CUDA out of memory (with
the memory plan); 5 a hang: ranks that never reached the rendezvous, or no progress for
watchdog.stall_s (the report names the ranks); 128+N stopped by signal N after every rank saved a
checkpoint (SIGTERM 143, SIGUSR1 138).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import traceback

from ds_train import commands as cmd
from ds_train.errors import AgreedError, OneLineParser, OutOfMemory, PeerFailed, RunStopped, Stalled, UserError
from ds_train.fs import check_path_args
from ds_train.launch import cli as launch_cli
from ds_train.signals import keep_usr1

RUN_COMMANDS = ("train", "ript")  # run on every rank, from a run config: what `launch` and `slurm` start
BUILDS_A_RUN = (*RUN_COMMANDS, "dry-run", "parity-worker")  # start.build_run turns the collector back on (cli)


def check_command(argv: list[str], world_size: int, local_world_size: int | None = None,
                  device: str | None = None, nodes=None):
    """The command `ds-train launch` / `slurm` runs on every rank: parsed by that subcommand's own
    parser, its config loaded and checked at the target world size as each rank checks it
    (inputs.check_launch; `device`: "cuda" or "cpu" where known, for the rendered ds_config)."""
    from ds_train.config.file import load_config
    from ds_train.inputs import check_launch

    args = build_parser().parse_args(argv)
    if getattr(args, "spec", None) is None:
        raise UserError(f"after `--` comes the command every rank runs, {' or '.join(RUN_COMMANDS)}; got "
                        f"{args.command or 'nothing'!r}")
    if not args.config or not args.ds_config:
        raise UserError(f"{args.command} needs --config and --ds-config")
    cfg = load_config(args.config, args.overrides, command=args.command)
    split = nodes.problems(cfg.ript.rollout_ranks_per_node) if nodes and args.command == "ript" else []
    if split:  # before check_launch splits the job at one count a node
        raise UserError(f"preflight: {split[0]}")
    return cfg, check_launch(cfg, args.ds_config, args.spec(cfg), world_size, local_world_size, device)


def plan_memory(argv: list[str], world_size: int) -> float:
    """The memory plan's per-GPU peak (GiB) of the command after `--` at this world size (for the
    GPU preflight of `ds-train launch`)."""
    from ds_train.config.file import load_config
    from ds_train.estimate import run_estimate
    from ds_train.plan.planner import Target

    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides, command=args.command)
    out = run_estimate(cfg, args.ds_config, Target(1, world_size, 80.0), preset=None)  # 80: only "fits" uses it
    return next(r for r in out["rows"] if r["given"])["gpu_peak_gib"]


def _command(sub, name: str, func, **defaults):
    """A subcommand running `func`: its --help from func's docstring (the first line, then the rest),
    and --debug after the subcommand too (`ds-train train --debug ...`; default: the top level's)."""
    import inspect

    doc = inspect.cleandoc(func.__doc__ or "")
    help_, _, description = doc.partition("\n\n")
    p = sub.add_parser(name, help=help_, description=" ".join(description.split()) or help_)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p.set_defaults(func=func, **defaults)
    return p


def _add_plan_args(p) -> None:
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--ds-config", required=True, help="DeepSpeed JSON")
    p.add_argument("--hostfile", help="target cluster as a DeepSpeed hostfile")
    p.add_argument("--nodes", type=int, help="target nodes (instead of --hostfile)")
    p.add_argument("--gpus-per-node", type=int, help="target GPUs per node (instead of --hostfile)")
    p.add_argument("--gpu-memory", type=float, help="GiB per GPU (default: this GPU's, else 80)")
    p.add_argument("overrides", nargs="*", metavar="key=value", default=[])


def _add_run_args(p, example: str) -> None:
    """train and ript: a run config, a DeepSpeed JSON and key=value overrides."""
    p.add_argument("--config", help=f"run config YAML ({example})")
    p.add_argument("--ds-config", help="DeepSpeed JSON (ds_configs/zero*.json)")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def _at_least(low: int):
    """An argparse type: a whole number >= low (argparse says the flag and the value in one line)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def _add_checkpoint_source(p, verb: str) -> None:
    """convert and export: which checkpoint."""
    p.add_argument("source", help="run directory, its checkpoints/ directory, or a tag directory")
    p.add_argument("--tag", help=f"tag to {verb} (default: the latest complete one)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ds-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks and DeepSpeed's info logs")
    # --local_rank from the deepspeed launcher, --local-rank from python -m torch.distributed.launch;
    # the rank itself is read from the environment both set (ds_train/dist/__init__.py).
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _add_run_commands(sub)  # train, ript
    _add_prepare(sub)
    _add_checkpoint_commands(sub)  # convert, export
    _add_plan_commands(sub)  # estimate, dry-run
    launch_cli.add_subcommands(sub, check_command, plan_memory)  # launch, slurm
    _add_parity(sub)  # parity, parity-worker
    _add_run_dir_commands(sub)  # monitor, doctor, plot
    return p


def _add_run_commands(sub) -> None:
    _add_run_args(_command(sub, "train", cmd.cmd_train, spec=cmd.train_spec_of), "recipes/*.yaml")
    _add_run_args(_command(sub, "ript", cmd.cmd_ript, spec=cmd.ript_spec_of), "recipes/ript_demo.yaml")


def _add_prepare(sub) -> None:
    pr = _command(sub, "prepare", cmd.cmd_prepare)
    pr.add_argument("sources", nargs="*", metavar="SOURCE",
                    help="files or directories (.txt/.md/.py/... one document each; .jsonl, .jsonl.gz, "
                         ".parquet, .csv, .arrow a record per line or row), a `datasets` save_to_disk "
                         "directory, or python-stdlib")
    pr.add_argument("--out", help="output directory")
    pr.add_argument("--tokenizer", default="", help="tokenizer directory (default: train a byte-level BPE)")
    pr.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    pr.add_argument("--split-digits", action="store_true",
                    help="the trained BPE makes every digit its own token (data.split_digits)")
    pr.add_argument("--val-fraction", type=float, default=0.02, help="documents held out (default 0.02)")
    pr.add_argument("--text-key", default="text", help="the records' text field (default text)")
    pr.add_argument("--format", choices=("text", "sft", "preference"), default="text",
                    help="text (default): pretraining documents; sft: conversations ('messages') or "
                         "'prompt'/'completion' records, rendered with the chat template, targets on the "
                         "assistant's tokens; preference: 'prompt', 'chosen' and 'rejected' records")
    pr.add_argument("--chat-template", default="", metavar="FILE",
                    help="sft, preference: a file holding the Jinja chat template (default: the tokenizer's)")
    pr.add_argument("--workers", type=int, default=None,
                    help="tokenising processes (default: data.workers with --config, else 0: one per core)")
    pr.add_argument("--config", help="take the data section of this run config instead")
    pr.add_argument("--overwrite", action="store_true", help="replace the prepared data already in --out")
    pr.add_argument("overrides", nargs="*", metavar="key=value", default=[])


def _add_checkpoint_commands(sub) -> None:
    c = _command(sub, "convert", cmd.cmd_convert)
    _add_checkpoint_source(c, "convert")
    c.add_argument("--to", choices=["universal"], default="universal", help="target format")
    e = _command(sub, "export", cmd.cmd_export)
    _add_checkpoint_source(e, "export")
    e.add_argument("--out", required=True, help="output directory (must not exist or be empty, and lie outside "
                                               "checkpoints/: retention prunes there)")
    e.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    e.add_argument("--merge", action="store_true",
                   help="LoRA runs: merge the adapters into the base and write one model (default: the peft "
                        "adapter directory)")
    v = _command(sub, "eval", cmd.cmd_eval)
    v.add_argument("path", help="a run directory (its newest complete checkpoint, exported first) or a Hugging Face "
                                "export")
    v.add_argument("--tag", help="a run directory's tag to score (default: the latest complete one)")
    v.add_argument("--tasks", help="comma-separated lm-evaluation-harness tasks: names (lm_eval's, recipes/lm_eval/'s) "
                                   "or task YAML paths (default: the run's benchmarks.tasks)")
    v.add_argument("--limit", type=_at_least(0), help="documents per task, 0: all (default: the run's "
                                                     "benchmarks.limit, else 0)")
    v.add_argument("--batch-size", type=_at_least(1), help="lm_eval's batch size (default: benchmarks.batch_size)")
    v.add_argument("--num-fewshot", type=_at_least(-1), help="few-shot examples, -1: each task's own (default: "
                                                            "benchmarks.num_fewshot)")
    v.add_argument("--out", help="directory for lm_eval's results file (default: PATH/lm_eval)")


def _add_plan_commands(sub) -> None:
    es = _command(sub, "estimate", cmd.cmd_estimate)
    _add_plan_args(es)
    es.add_argument("--preset", choices=["conservative", "balanced", "aggressive"],
                    help="pick micro-batch, checkpointing and stage for ~50/70/90%% of GPU memory")
    dr = _command(sub, "dry-run", cmd.cmd_dry_run)
    _add_plan_args(dr)
    dr.add_argument("--out", help="where to write dry_run.json (default: output_dir/dry_run.json)")


def _add_parity(sub) -> None:
    """parity, and parity-worker: what the launches parity starts run."""
    pa = _command(sub, "parity", cmd.cmd_parity)
    pa.add_argument("--config", required=True, help="run config YAML (the job whose layout to prove)")
    pa.add_argument("--ds-config", required=True, nargs="+", metavar="DS_CONFIG",
                    help="DeepSpeed JSON(s) of the layouts (ds_configs/zero*.json)")
    pa.add_argument("--nproc", nargs="+", default=[], metavar="N",
                    help="world size(s) of the layouts: processes per launch (default 2)")
    pa.add_argument("--grad-accum", nargs="+", default=[], metavar="A",
                    help="gradient accumulation(s) at the config's global batch (default: the config's micro-batch)")
    pa.add_argument("--sequence", nargs="+", default=[], metavar="S",
                    help="Ulysses sequence-parallel size(s) of the layouts, each at the world sizes it divides "
                         "(default: the config's parallel.sequence)")
    pa.add_argument("--tensor", nargs="+", default=[], metavar="T",
                    help="AutoTP tensor-parallel size(s) of the layouts, each at the world sizes it divides "
                         "(default: the config's parallel.tensor)")
    pa.add_argument("--expert", nargs="+", default=[], metavar="E",
                    help="AutoEP expert-parallel size(s) of the layouts (a mixture-of-experts model), each at the "
                         "world sizes whose data ranks it divides (default: the config's parallel.expert)")
    pa.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default 5)")
    pa.add_argument("--shrink", action="store_true",
                    help="the same model type with small dimensions (2 layers, 16 per head) and small steps")
    pa.add_argument("--loss-tol", type=float, help="relative loss tolerance (default: 1e-5 in fp32; in bf16/fp16 "
                                                     "4x the noise floor parity measures, the reference in that dtype)")
    pa.add_argument("--grad-tol", type=float,
                    help="relative gradient-norm tolerance (default: 1e-4 in fp32; in bf16/fp16 4x the noise floor)")
    pa.add_argument("--tf32", action="store_true",
                    help="let the fp32 runs use TF32 matmuls on the GPU (default: off, model.tf32=false)")
    pa.add_argument("--out", help="keep the runs here (default: a temporary directory, removed)")
    pa.add_argument("--launcher-args", default="", metavar="ARGS",
                    help='deepspeed launcher flags for the layouts\' launches, e.g. "--hostfile H --master_port P"')
    pa.add_argument("overrides", nargs="*", metavar="key=value", default=[])
    pw = sub.add_parser("parity-worker")  # no help: the launches `parity` starts
    pw.add_argument("plan")
    pw.set_defaults(func=cmd.cmd_parity_worker, debug=False)


def _add_run_dir_commands(sub) -> None:
    """monitor, doctor and plot: they read a run directory."""
    mo = _command(sub, "monitor", cmd.cmd_monitor)
    mo.add_argument("run_dir", help="the run's output_dir (mounted from another node is fine)")
    mo.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    mo.add_argument("--once", action="store_true", help="print one frame and exit")
    do = _command(sub, "doctor", cmd.cmd_doctor)
    do.add_argument("paths", nargs="+", metavar="RUN_DIR|LOGFILE",
                    help="a run's output_dir and/or log files of the same job (the launcher's console, a SLURM "
                         "output file, `dmesg` of a node)")
    pl = _command(sub, "plot", cmd.cmd_plot)
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (output_dir)")
    pl.add_argument("--out", help="output directory (default: RUN_DIR/plots for one run, ./plots for several)")


def _split_overrides(args) -> None:
    """argparse puts SOURCE and key=value in one list for `prepare`; separate them."""
    if args.command == "prepare":
        args.overrides = [s for s in args.sources if "=" in s]
        args.sources = [s for s in args.sources if "=" not in s]


def _tools_of_this_python_first() -> None:
    """This Python's bin directory first on PATH, as if its virtualenv were activated. A rank that
    pdsh or srun starts runs the venv's python without it: torch's JIT would then build DeepSpeed's
    ops with the system's ninja, which hashes commands differently from the venv's and rebuilds
    them (a minute) every time the other one built them last."""
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def main(argv: list[str] | None = None) -> int:
    _tools_of_this_python_first()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UserError as e:
        return _report(e)
    if not args.debug:
        import warnings

        # c10's C++ warnings (a TCPStore that lost rank 0 prints its C++ stack): --debug shows them
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

        warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # ript.rollout_engine=vllm: its start-up chatter
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "spec", None) is not None:  # a run command: a run config and a DeepSpeed JSON
        keep_usr1()  # SLURM's SIGUSR1 before the run's handlers, or after its end, is never fatal
        if args.help_config:
            from ds_train.config.file import describe

            print(describe())
            return 0
        if not args.config or not args.ds_config:
            return _report(UserError(f"{args.command} needs --config and --ds-config (see `ds-train "
                                     f"{args.command} --help`)"))
    _split_overrides(args)
    if args.command not in BUILDS_A_RUN:
        gc.enable()
    try:
        check_path_args(args)  # a path the operating system refuses: one line naming the flag
        return args.func(args)
    except (UserError, RunStopped, OutOfMemory, Stalled, PeerFailed) as e:
        if args.debug and getattr(e, "is_error", True):
            traceback.print_exc()
        return _report(e)
    except KeyboardInterrupt:
        return 130


def _report(e: Exception) -> int:
    """One line on stderr and the exception's exit code. A stop every rank agreed on is printed by
    rank 0 alone; an input error or an out-of-memory by each rank that hit it. The line that says
    how the command ended comes last: a failed run's pointer to the doctor (a note) goes before it,
    and the job's verdict (a note `ds-train: error: ...`, on the rank that reports it) after it."""
    from ds_train.dist import rank_for_messages

    rank = rank_for_messages()
    notes = getattr(e, "__notes__", ())
    hints = [note for note in notes if not note.startswith("ds-train")]
    verdicts = [note for note in notes if note.startswith("ds-train")]
    if isinstance(e, PeerFailed):  # the job's verdict, from the rank that wrote it
        if e.say:
            print(*hints, f"ds-train: error: {e}", *verdicts, sep="\n", file=sys.stderr, flush=True)
        return e.exit_code
    agreed = isinstance(e, (RunStopped, AgreedError)) or getattr(e, "agreed", False)
    for note in hints:
        print(note, file=sys.stderr, flush=True)
    if rank == 0 or not agreed:
        who = "ds-train" if rank == 0 else f"ds-train[rank {rank}]"
        kind = "error: " if getattr(e, "is_error", True) else ""
        print(f"{who}: {kind}{e}", file=sys.stderr if kind else sys.stdout, flush=True)
    for note in verdicts:
        print(note, file=sys.stderr, flush=True)
    return e.exit_code


def cli() -> None:
    """The `ds-train` command and `python -m ds_train`: `main` with the garbage collector off through
    the start-up, then an exit without the interpreter's last full collection. Importing torch,
    DeepSpeed and transformers makes millions of objects that the collector would scan again and
    again: a quarter of a rank's start-up CPU (1.5 s on this machine, paid by every rank of every
    launch). A command that builds a run turns it back on once the run is built, its start-up's
    objects frozen out of later collections (start.build_run), or before it streams a corpus to
    prepare (data.prepare.ensure_prepared); any other command before it runs.
    Everything a command writes is closed before `main` returns; the last freeze only skips
    collecting what the exit frees anyway."""
    gc.disable()
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    cli()
