"""AutoTP tensor parallelism (parallel.tensor=2, ZeRO-1) beside ZeRO-3 on 2 processes: the same
model, data and global batch; per rank, the model-state bytes the engine holds (parameters,
gradients, optimizer states: ds_train.plan.memory.engine_state_bytes at a step boundary) beside the
memory plan's prediction, and tokens/s (the median step after warm-up).

    python bench/tensor_parallel.py [--steps 8] [--warmup 2] [--repeats 2] [--hidden 512] \
        [--layers 4] [--seq-len 256] [--data DIR] [--out FILE.json]

Each side is a real `deepspeed --num_gpus 2` launch of this script's worker, which builds the run
through ds_train (build_run: the rendered ds_config, the TP groups, the engine) and times
train_step; the sides take turns --repeats times and each keeps its best median, so that a noisy
machine hurts both alike. On a CPU the figures say how the model states divide (exact: it is
bookkeeping) and how the step time of the two compares when every collective goes through shared
memory on one host; they do not predict a GPU's, where TP's per-layer all-reduces run on NVLink
and ZeRO-3's per-layer all-gathers too (bench/gpu/ for those).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere, with or without `pip install -e`
    sys.path.insert(0, str(ROOT))

from bench import cli, sides  # noqa: E402

SIDES = {"zero3": ("zero3.json", 1), "tp2_zero1": ("zero1.json", 2)}


def run_config(args, side: str, out_dir: Path) -> dict:
    return {**sides.run_config(args, out_dir), "parallel": {"tensor": SIDES[side][1]}}


def figures(cfg, inputs, run, held: list[int]) -> dict:
    """A rank holds 1/tensor of each parameter TP splits, whose states ZeRO then divides over the
    data-parallel ranks: the plan's prediction from that, beside the measured."""
    from ds_train.plan.memory import model_shape, model_states

    dims = run.dims
    shape = model_shape(inputs.source.hf_config)
    predicted = model_states(shape.rank_params(dims.tensor), run.zero_stage, run.dtype,
                             dims.data * dims.sequence).held
    return {"parallel": dims.record(), "params": shape.n_params, "rank_params": shape.rank_params(dims.tensor),
            "model_states_gib_per_rank": [b / sides.GiB for b in held], "predicted_gib_per_rank": predicted / sides.GiB}


def main(argv: list[str] | None = None) -> int:
    args = sides.parse_args(__doc__, argv)
    if args.worker:
        side, result = args.worker
        return sides.worker(args, side, result, run_config, SIDES[side][0], figures)
    runs = sides.compare(args, __file__, SIDES, "ds_train_bench_tp_")
    out = sides.results(args, argv, runs, "zero3")
    r = out["ratios"] = sides.ratios(out["sides"]["tp2_zero1"], out["sides"]["zero3"], "tp2_over_zero3",
                                     ("model_states",))
    return sides.finish(args, out, f"results: TP=2 + ZeRO-1 / ZeRO-3 on 2 processes: tokens/s "
                        f"x{r['tokens_per_s_tp2_over_zero3']:.2f}, model states per rank "
                        f"x{r['model_states_tp2_over_zero3']:.2f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
