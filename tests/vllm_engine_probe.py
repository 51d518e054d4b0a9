"""One process outside a launcher (as bench/rollouts.py): a tiny Llama's (or MODEL_TYPE's) vLLM engine built through ds_train
(ds_train/ript/vllm_engine.py VllmRollouts), the global generators drawn from before and after the build, and
what vLLM's worker said of itself, the architectures of the config it was built from (the model's config, built
from a config, has none), and whether the policy still runs its forward, and a model of its class still
builds, after the engine (vLLM's Transformers backend decorates the class of a type it has none of its own
for); printed as JSON. tests/test_vllm_engine.py reads it.

    python tests/vllm_engine_probe.py [MODEL_TYPE]
"""

import json
import random
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import TINY_MODEL
from ds_train.config.posttrain import RiptConfig
from ds_train.ript.vllm_engine import VllmRollouts

torch.manual_seed(0)
config = AutoConfig.for_model(**{**TINY_MODEL, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 96,
                                 "model_type": sys.argv[1] if len(sys.argv) > 1 else "llama"})
model = AutoModelForCausalLM.from_config(config)
random.seed(5), np.random.seed(5), torch.manual_seed(5)
expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
random.seed(5), np.random.seed(5), torch.manual_seed(5)
said = []
engine = VllmRollouts(model, None,  # the tokenizer: for a policy's stop strings, not the build
                      RiptConfig(rollout_engine="vllm", rollout_contexts=1, rloo_batch_size=2), "fp32", seed=0,
                      rank=0, say=said.append)
got = (random.random(), float(np.random.rand()), torch.rand(1).item())
with open(f"{engine._dir}/config.json") as f:  # what vLLM picked its model class from
    architectures = json.load(f)["architectures"]
with torch.no_grad():
    runs = bool(torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all())
rebuilt = type(AutoModelForCausalLM.from_config(config)).__name__
print(json.dumps({"expected": expected, "got": got, "said": said, "architectures": architectures,
                  "model's": model.config.architectures, "runs": runs, "rebuilt": rebuilt}))
