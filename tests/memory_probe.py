"""Run under the deepspeed launcher by tests/test_memory.py: for each ZeRO stage, and for ZeRO-1/2
under AutoTP (parallel.tensor=2), build the engine with ds_train, take one step, then measure what
the engine holds at the next step boundary (after the last backward, before engine.step) against
ds_train.plan.memory.model_states; for AutoTP and LoRA, against what `ds-train estimate` and `dry-run` report a rank
holds (run_estimate's row for the run: the model's config, not the engine, says what AutoTP splits),
and the activations autograd saves in one forward on a tensor rank against memory.activation_bytes."""

import json
import sys
from pathlib import Path

import torch

from ds_train import dist, topology
from ds_train.config.file import build_config
from ds_train.data.datasets import rank_micro_batches
from ds_train.estimate import run_estimate
from ds_train.inputs import check_inputs
from ds_train.model.build import count_params
from ds_train.plan.memory import GiB, activation_bytes, engine_state_bytes, model_shape, model_states
from ds_train.plan.planner import Target
from ds_train.start import build_run
from ds_train.train.loop import train_spec, train_step
from ds_train.train.losses import forward_loss

data_dir, out_dir, root = (Path(a) for a in [a for a in sys.argv[1:] if not a.startswith("--")])
env = topology.detect_env()
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
MOE = {**LLAMA, "model_type": "qwen3_moe", "moe_intermediate_size": 176, "num_experts": 4, "num_experts_per_tok": 2}
CASES = [(stage, dtype, 1, 0, 1) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
CASES += [(stage, "bf16", 1, 8, 1) for stage in (0, 2, 3)]  # LoRA rank 8: a frozen base
CASES += [(stage, "fp32", 1, 0, 2) for stage in (0, 1, 2, 3)]  # AutoEP: each rank 2 of the 4 experts
# AutoTP last: DeepSpeed keeps its tensor-parallel state in the process after the engine is gone
CASES += [(0, "fp32", 2, 0, 1)] + [(stage, dtype, 2, 0, 1) for stage in (1, 2) for dtype in ("fp32", "bf16")]
for stage, dtype, tensor, lora, expert in CASES:
    cfg = build_config({
        "output_dir": str(out_dir / f"z{stage}_{dtype}_tp{tensor}_lora{lora}_ep{expert}"), "seed": 1,
        "parallel": {"tensor": tensor, "expert": expert},
        "model": {"dtype": dtype, "lora": {"rank": lora}, "config": dict(MOE if expert > 1 else LLAMA)},
        "data": {"dir": str(data_dir)},
        "train": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 8, "seq_len": 64},
        "checkpoint": {"save_final": False, "resume": "none"},
        "log": {"progress": False, "sample_prompt": ""}})
    inputs = check_inputs(cfg, str(root / "ds_configs" / f"zero{stage}.json"))
    # keep_group: the next stage's run joins the same process group.
    with build_run(inputs, env, train_spec(cfg, keep_group=True)) as run:
        engine, n = run.engine, count_params(run.engine.module)
        data_rank, data = run.dims.data_rank(env.rank), run.dims.data
        train_step(engine, rank_micro_batches(inputs.data.train, 0, 8, 2, data_rank, data))
        for batch in rank_micro_batches(inputs.data.train, 1, 8, 2, data_rank, data):
            loss, tokens = forward_loss(engine, batch)
            engine.backward(loss / tokens)
            if engine.is_gradient_accumulation_boundary():
                measured = engine_state_bytes(engine)
            engine.step()
        if tensor > 1 or lora or expert > 1:  # what `ds-train estimate` and `dry-run` say a rank holds (the config's)
            rows = run_estimate(cfg, str(root / "ds_configs" / f"zero{stage}.json"),
                                Target(1, env.world_size, 80.0), None)["rows"]
            predicted = next(r for r in rows if r["given"])["model_states_gib"] * GiB
        else:
            predicted = model_states(n, stage, dtype, data).held
        print("PROBE " + json.dumps({"stage": stage, "dtype": dtype, "tensor": tensor, "lora": lora, "expert": expert,
                                     "rank": env.rank, "measured": measured, "predicted": predicted}), flush=True)
        if tensor > 1 and stage == 1:  # activations: the same forward as the single-process test's
            batch = rank_micro_batches(inputs.data.train, 2, 8, 2, data_rank, data)[0]  # (micro, seq_len + 1)
            saved = {}

            def pack(t):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            weights = {q.untyped_storage().data_ptr() for q in engine.module.parameters()}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                forward_loss(engine, batch)  # as the trainer does
            act = activation_bytes(model_shape(run.engine.module.config), batch.shape[0], batch.shape[1] - 1, dtype,
                                   False, tensor=tensor).saved
            print("ACTIVATIONS " + json.dumps({"dtype": dtype, "rank": env.rank, "predicted": act,
                                               "measured": sum(n for q, n in saved.items() if q not in weights)}),
                  flush=True)
        engine.destroy()
dist.release_shared_memory(env)
dist.shutdown()
