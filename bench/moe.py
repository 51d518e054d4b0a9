"""Expert parallelism (parallel.expert=2, DeepSpeed AutoEP) beside every rank holding every expert
(parallel.expert=1), both ZeRO-2 on 2 processes: the same Qwen3-MoE model (8 experts a layer, top 2),
data and global batch; per rank, the model-state bytes the engine holds (parameters, gradients,
optimizer states: ds_train.plan.memory.engine_state_bytes at a step boundary) beside the memory plan's
prediction, and tokens/s (the median step after warm-up).

    python bench/moe.py [--steps 8] [--warmup 2] [--repeats 2] [--hidden 512] [--layers 4] \
        [--experts 8] [--seq-len 256] [--data DIR] [--out FILE.json]

Each side is a real `deepspeed --num_gpus 2` launch of this script's worker (bench/sides.py), which
builds the run through ds_train (the rendered expert_parallel section, AutoEP's layers, the engine)
and times train_step; the sides take turns --repeats times and each keeps its best median. Under
ZeRO-2 gradients and optimizer states are partitioned over the ranks either way: what EP 2 saves is
the other half of the experts' parameters, whole on every rank at EP 1. On a CPU the step time says
what AutoEP's token exchange (two all-to-alls a layer, through shared memory on one host) costs
beside computing every expert locally; a GPU's (NVLink, grouped GEMMs) is not measured here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere, with or without `pip install -e`
    sys.path.insert(0, str(ROOT))

from bench import cli, sides  # noqa: E402

SIDES = {"ep1": ("zero2.json", 1), "ep2": ("zero2.json", 2)}


def add_options(p) -> None:
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer (default 8; top 2)")


def run_config(args, side: str, out_dir: Path) -> dict:
    """sides.run_config's run, its model a Qwen3-MoE of the same width and depth."""
    cfg = sides.run_config(args, out_dir)
    h = args.hidden
    cfg["model"]["config"] = {
        "model_type": "qwen3_moe", "hidden_size": h, "intermediate_size": h * 11 // 4,
        "moe_intermediate_size": h * 11 // 8, "num_hidden_layers": args.layers, "num_attention_heads": 8,
        "num_key_value_heads": 8, "num_experts": args.experts, "num_experts_per_tok": 2,
        "max_position_embeddings": args.seq_len, "tie_word_embeddings": False}
    return {**cfg, "parallel": {"expert": SIDES[side][1]}}


def figures(cfg, inputs, run, held: list[int]) -> dict:
    """A rank holds 1/expert of the routed experts whole; ZeRO partitions the rest as the stage says:
    the plan's prediction from that, beside the measured."""
    from ds_train.plan.memory import model_shape, model_states

    dims = run.dims
    shape = model_shape(inputs.source.hf_config)
    predicted = model_states(shape.n_params, run.zero_stage, run.dtype, dims.data, experts=shape.experts,
                             expert=dims.expert).held
    return {"parallel": dims.record(), "params": shape.n_params, "expert_params": shape.experts,
            "model_states_gib_per_rank": [b / sides.GiB for b in held], "predicted_gib_per_rank": predicted / sides.GiB}


def main(argv: list[str] | None = None) -> int:
    args = sides.parse_args(__doc__, argv, add_options)
    if args.worker:
        side, result = args.worker
        return sides.worker(args, side, result, run_config, SIDES[side][0], figures)
    runs = sides.compare(args, __file__, SIDES, "ds_train_bench_moe_", forward=("--experts", str(args.experts)))
    out = sides.results(args, argv, runs, "ep1", experts=args.experts)
    r = out["ratios"] = sides.ratios(out["sides"]["ep2"], out["sides"]["ep1"], "ep2_over_ep1", ("model_states",))
    return sides.finish(args, out, f"results: parallel.expert 2 / 1, ZeRO-2 on 2 processes: tokens/s "
                        f"x{r['tokens_per_s_ep2_over_ep1']:.2f}, model states per rank "
                        f"x{r['model_states_ep2_over_ep1']:.2f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
