"""LoRA (model.lora: rank 16 on every linear layer) beside full fine-tuning, ZeRO-2 on 2 processes:
the same model, data and global batch; per rank, the model-state bytes the engine holds
(parameters, gradients, optimizer states: ds_train.plan.memory.engine_state_bytes at a step boundary)
beside the memory plan's prediction, the peak resident memory of the rank, and tokens/s (the median
step after warm-up).

    python bench/lora.py [--steps 8] [--warmup 2] [--repeats 2] [--hidden 512] [--layers 4] \
        [--seq-len 256] [--rank 16] [--data DIR] [--out FILE.json]

Each side is a real `deepspeed --num_gpus 2` launch of this script's worker, which builds the run
through ds_train (build_run: the rendered ds_config, peft's adapters, the engine) and times
train_step; the sides take turns --repeats times and each keeps its best median, so that a noisy
machine hurts both alike. The model states are bookkeeping and hold on any device; the step time
on a CPU (fp32, the frozen base's weight gradients skipped, the adapters' small matmuls added)
does not predict a GPU's.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere, with or without `pip install -e`
    sys.path.insert(0, str(ROOT))

from bench import cli, sides  # noqa: E402

SIDES = {"full": 0, "lora": 16}  # model.lora.rank


def parse_args(argv: list[str] | None = None):
    return sides.parse_args(__doc__, argv, lambda p: p.add_argument(
        "--rank", type=int, default=16, help="LoRA rank of the lora side (default 16)"))


def run_config(args, side: str, out_dir: Path) -> dict:
    cfg = sides.run_config(args, out_dir)
    rank = args.rank if SIDES[side] else 0
    cfg["model"]["lora"] = {"rank": rank, "alpha": 2 * max(rank, 1)}
    return cfg


def figures(cfg, inputs, run, held: list[int]) -> dict:
    """Only the adapters train, so only they have gradients and optimizer states: the plan's
    prediction from that, beside the measured; and each rank's peak resident memory."""
    import resource

    from ds_train import dist
    from ds_train.plan.memory import model_shape, model_states

    shape = model_shape(inputs.source.hf_config, cfg.model.lora)
    predicted = model_states(shape.n_params, run.zero_stage, run.dtype, run.dims.data,
                             trainable=shape.trainable or None).held
    peak_rss = dist.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"params": shape.n_params, "trainable": shape.trainable or shape.n_params,
            "model_states_gib_per_rank": [b / sides.GiB for b in held],
            "peak_rss_gib_per_rank": [b / sides.GiB for b in peak_rss], "predicted_gib_per_rank": predicted / sides.GiB}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        side, result = args.worker
        return sides.worker(args, side, result, run_config, "zero2.json", figures)
    runs = sides.compare(args, __file__, SIDES, "ds_train_bench_lora_", ("--rank", str(args.rank)),
                         lambda r: f", peak RSS {max(r['peak_rss_gib_per_rank']) * 1024:,.0f} MiB")
    out = sides.results(args, argv, runs, "full", rank=args.rank)
    r = out["ratios"] = sides.ratios(out["sides"]["lora"], out["sides"]["full"], "lora_over_full",
                                     ("model_states", "peak_rss"))
    return sides.finish(args, out, f"results: LoRA r={args.rank} / full fine-tuning, ZeRO-2 on 2 processes: "
                        f"tokens/s x{r['tokens_per_s_lora_over_full']:.2f}, model states per rank "
                        f"x{r['model_states_lora_over_full']:.2f}, peak RSS per rank x{r['peak_rss_lora_over_full']:.2f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
