"""A vLLM engine loaded from a Hugging Face directory, as a separate process (vLLM binds its CPU threads):
greedy completions of the prompts given as JSON on stdin, printed as JSON. tests/test_ript_vllm.py compares
a resumed run's first rollouts with them.

    python tests/vllm_probe.py MODEL_DIR < [{"ids": [...], "max_tokens": 6, "stop": [12]}, ...]
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from ds_train.ript.vllm_engine import cpu_linear_keeps_its_weight  # noqa: E402

cpu_linear_keeps_its_weight()  # as the run's engines multiply (not vLLM's packed CPU kernels)
requests = json.load(sys.stdin)
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", distributed_executor_backend="uni",
          enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=64 << 20, seed=0)
outs = llm.generate([TokensPrompt(prompt_token_ids=r["ids"]) for r in requests],
                    [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], stop_token_ids=r["stop"],
                                    ignore_eos=True, detokenize=False) for r in requests], use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
