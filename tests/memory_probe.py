"""Run under the deepspeed launcher by tests/test_memory.py: for each ZeRO stage, build the engine
with ds_train, take one step, then measure what the engine holds at the next step boundary
(after the last backward, before engine.step) against ds_train.memory.model_states."""

import json
import sys
from pathlib import Path

from ds_train import dist
from ds_train.configfile import build_config
from ds_train.data.datasets import rank_micro_batches
from ds_train.inputs import check_inputs
from ds_train.losses import forward_loss
from ds_train.memory import engine_state_bytes, model_states
from ds_train.model.build import count_params
from ds_train.run import build_run
from ds_train.trainer import train_spec, train_step

data_dir, out_dir, root = (Path(a) for a in [a for a in sys.argv[1:] if not a.startswith("--")])
env = dist.detect_env()
for stage in (0, 1, 2, 3):
    for dtype in ("fp32", "bf16"):
        cfg = build_config({
            "output_dir": str(out_dir / f"z{stage}_{dtype}"), "seed": 1,
            "model": {"dtype": dtype, "config": {
                "model_type": "llama", "hidden_size": 128, "intermediate_size": 352,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 128, "tie_word_embeddings": False}},
            "data": {"dir": str(data_dir)},
            "train": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 8, "seq_len": 64},
            "checkpoint": {"save_final": False, "resume": "none"},
            "log": {"progress": False, "sample_prompt": ""}})
        inputs = check_inputs(cfg, str(root / "ds_configs" / f"zero{stage}.json"))
        # keep_group: the next stage's run joins the same process group.
        with build_run(inputs, env, train_spec(cfg, keep_group=True)) as run:
            engine, n = run.engine, count_params(run.engine.module)
            train_step(engine, rank_micro_batches(inputs.data.train, 0, 8, 2, env.rank, env.world_size))
            for batch in rank_micro_batches(inputs.data.train, 1, 8, 2, env.rank, env.world_size):
                loss, tokens = forward_loss(engine, batch)
                engine.backward(loss / tokens)
                if engine.is_gradient_accumulation_boundary():
                    measured = engine_state_bytes(engine)
                engine.step()
            predicted = model_states(n, stage, dtype, env.world_size).held
            print("PROBE " + json.dumps({"stage": stage, "dtype": dtype, "rank": env.rank,
                                         "measured": measured, "predicted": predicted}), flush=True)
            engine.destroy()
dist.release_shared_memory(env)
dist.shutdown()
