"""The parallel dimensions of a run, as one object (torchtitan's ParallelDims): data x sequence x
tensor = world. Built once from the config and the world size; asked by the batch plan, the data
loader, the loss reduction, the memory plan, the resume agreement and the checkpoint marker.
Nobody else does rank arithmetic.

Ranks are laid out as DeepSpeed lays out its groups: tensor innermost (AutoTP's groups are runs of
consecutive ranks), then sequence (Ulysses' groups likewise), then data. The sequence and tensor
ranks of one data-parallel group read the same batch; the ranks that hold different tokens (the
data and sequence ranks of one tensor rank) are the ones a token count is summed over. Expert
parallelism (AutoEP, ds_train/plan/experts.py) groups data ranks and is not a factor of the world.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_train.config import ParallelConfig, RunConfig
from ds_train.errors import UserError
from ds_train.plan.batch import BatchPlan, choices, divisors, plan_batch, sample_rows
from ds_train.plan.experts import check_expert_data, check_expert_model, check_expert_run, check_router_loss
from ds_train.plan.memory import tp_plan


@dataclass(frozen=True)
class ParallelDims:
    data: int
    sequence: int = 1
    tensor: int = 1
    expert: int = 1  # AutoEP's groups, cut from the data ranks: not a factor of the world

    @property
    def world(self) -> int:
        return self.data * self.sequence * self.tensor

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(data, sequence, tensor) rank of a global rank."""
        return rank // (self.sequence * self.tensor), rank // self.tensor % self.sequence, rank % self.tensor

    def data_rank(self, rank: int) -> int:
        """Which slice of every global batch `rank` reads."""
        return self.coords(rank)[0]

    def token_groups(self) -> list[list[int]]:
        """Groups of ranks whose tokens together are the global batch's, once each (the ranks that
        share a tensor coordinate; tensor ranks compute the same tokens): what a token count or a
        summed loss is reduced over. One group, the world, when tensor = 1."""
        return [[r for r in range(self.world) if r % self.tensor == t] for t in range(self.tensor)]

    def gradient_ranks(self, zero_stage: int) -> int:
        """How many ranks DeepSpeed divides a summed gradient by: the data-parallel ones (stages 0-2
        sum over the sequence ranks), but ZeRO-3's reduce-scatter averages over its whole partition
        group, data x sequence (DeepSpeed 0.19.8)."""
        return self.data * (self.sequence if zero_stage == 3 else 1)

    def derivation(self) -> str:
        """How the data-parallel size comes from the world size ('' when it is the world size)."""
        if self.sequence == self.tensor == 1:
            return ""
        return f"world size {self.world} / (parallel.sequence {self.sequence} x parallel.tensor {self.tensor})"

    def describe(self) -> str:
        experts = f" (experts split over {self.expert} of the data ranks)" if self.expert > 1 else ""
        return (f"parallel: data {self.data} x sequence {self.sequence} x tensor {self.tensor} = world "
                f"{self.world}{experts}")

    def record(self) -> dict:
        """What env.json, results and every checkpoint marker record of the layout."""
        return {"data": self.data, "sequence": self.sequence, "tensor": self.tensor} | (
            {"expert": self.expert} if self.expert > 1 else {})

    @classmethod
    def from_record(cls, record: dict | None, world_size: int) -> "ParallelDims":
        """A marker's layout; one written before layouts were recorded is all data-parallel."""
        if not isinstance(record, dict):
            return cls(world_size)
        return cls(int(record["data"]), int(record.get("sequence", 1)), int(record.get("tensor", 1)),
                   int(record.get("expert", 1)))


def plan_dims(p: ParallelConfig, world_size: int) -> ParallelDims:
    """The layout of `world_size` ranks: sequence x tensor must divide it (one line naming the
    numbers and the sizes that do)."""
    model = p.sequence * p.tensor
    if world_size % model:
        raise UserError(f"parallel.sequence={p.sequence} x parallel.tensor={p.tensor} = {model} does not divide "
                        f"the world size {world_size}; choose sizes whose product is {choices(divisors(world_size))}, "
                        f"or launch a multiple of {model} ranks")
    check_expert_data(p.expert, world_size // model)
    return ParallelDims(world_size // model, p.sequence, p.tensor, p.expert)


def check_heads(dims: ParallelDims, hf_config, where: str = "the model") -> None:
    """Ulysses splits the attention heads across the sequence ranks, AutoTP across the tensor ranks:
    each size must divide the heads it splits (one line naming the numbers and the choices)."""
    heads = getattr(hf_config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    problems = []
    for key, size in (("sequence", dims.sequence), ("tensor", dims.tensor)):
        if size == 1:
            continue
        if heads % size:
            problems.append(f"parallel.{key}={size} does not divide {where}'s {heads} attention heads; choose "
                            f"{choices(divisors(heads))}")
        # Ulysses replicates key/value heads when there are fewer than ranks; AutoTP cannot.
        elif key == "tensor" and kv % size or key == "sequence" and kv % size and size % kv:
            fits = [d for d in divisors(heads) if kv % d == 0 or (key == "sequence" and d % kv == 0)]
            problems.append(f"parallel.{key}={size} does not divide {where}'s {kv} key/value heads; choose "
                            f"{choices(fits)}")
    if problems:
        raise UserError("; ".join(problems))


def packs_under_sequence(attn_implementation: str) -> bool:
    """Whether Ulysses' attention keeps packed examples apart: flash attention reads them from the
    gathered position ids, sdpa runs per example (ds_train/model/ulysses.py); the others get one
    causal mask over the whole sequence."""
    return attn_implementation == "sdpa" or "flash_attention" in attn_implementation


def check_window(dims: ParallelDims, hf_config, attn_implementation: str, seq_len: int) -> None:
    """A sliding-window model under Ulysses: the window lives in the attention mask, which Ulysses
    drops for sdpa and flex attention (flash attention takes the window itself)."""
    window = getattr(hf_config, "sliding_window", None)
    if dims.sequence == 1 or "flash_attention" in attn_implementation or not isinstance(window, int):
        return
    layer_types = getattr(hf_config, "layer_types", None) or []
    if window < seq_len and (not layer_types or "sliding_attention" in layer_types):
        raise UserError(f"the model attends within a sliding window of {window} tokens, which "
                        f"model.attn_implementation={attn_implementation!r} loses under parallel.sequence="
                        f"{dims.sequence} (Ulysses drops its mask); use flash_attention_2, train.seq_len <= {window}, "
                        f"or parallel.sequence=1")


def check_tensor_model(dims: ParallelDims, hf_config) -> None:
    """A model AutoTP can shard, and what it shards divisible by parallel.tensor (one line naming
    the model type or the numbers, and the choices). The heads: check_heads."""
    if dims.tensor == 1:
        return
    model_type = getattr(hf_config, "model_type", "?")
    plan = tp_plan(hf_config)
    if not plan:
        raise UserError(f"parallel.tensor={dims.tensor}: model type {model_type!r} has no Hugging Face tensor-parallel "
                        f"plan, so AutoTP cannot shard it; tensor parallelism trains the model types whose config "
                        f"has one (llama, mistral, qwen2, qwen3, gemma, ...); for this one use "
                        f"parallel.tensor=1 and ZeRO-3 (ds_configs/zero3.json)")
    from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES

    unsupported = sorted({style for style in plan.values() if style.lower() not in SUPPORTED_STYLES})
    if unsupported:  # DeepSpeed rejects the whole plan inside deepspeed.initialize, after the run directory
        raise UserError(f"parallel.tensor={dims.tensor}: {model_type}'s Hugging Face tensor-parallel plan uses "
                        f"{', '.join(map(repr, unsupported))}, which DeepSpeed's AutoTP does not take (it takes "
                        f"{', '.join(sorted(SUPPORTED_STYLES))}); for this model use parallel.tensor=1 and ZeRO-3 "
                        f"(ds_configs/zero3.json)")
    sharded = {"intermediate_size": any(k.endswith(("gate_proj", "up_proj", "fc1", "c_fc")) for k in plan),
               "vocab_size": "lm_head" in plan or any(v.startswith("embedding") for v in plan.values())}
    problems = []
    for key, split in sharded.items():
        size = getattr(hf_config, key, None)
        if split and isinstance(size, int) and size % dims.tensor:
            fits = [d for d in divisors(size) if d <= 64]
            problems.append(f"parallel.tensor={dims.tensor} does not divide the model's {key} {size} (AutoTP splits "
                            f"it); choose {choices(fits)}")
    if problems:
        raise UserError("; ".join(problems))


def check_model(dims: ParallelDims, hf_config, attn_implementation: str, seq_len: int) -> None:
    """The model's shape against the layout: the heads each size splits, a sliding window, what
    AutoTP shards."""
    check_heads(dims, hf_config)
    check_window(dims, hf_config, attn_implementation, seq_len)
    check_tensor_model(dims, hf_config)


def _zero(template: dict) -> dict:
    """The DeepSpeed JSON's zero_optimization section ({} when missing or not a mapping)."""
    zero = template.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


# The DeepSpeed versions the workarounds in this module were proven on (pyproject.toml declares the
# same range): what each relies on, for a run outside it.
DEEPSPEED_PROVEN = ("0.19.8", "0.20")
TIED_TO_DEEPSPEED = {
    "sequence": "the loss divisor under Ulysses (ZeRO-3 averages gradients over data x sequence ranks, ZeRO 0-2 "
                "over data ranks) and the refusal of zero_optimization.reduce_scatter=false",
    "tensor": "the AutoTP process groups made before deepspeed.initialize and the refusals of ZeRO-0 in bf16/fp16 "
              "and of AutoTP with Ulysses",
    "expert": "AutoEP's use of transformers' output-capture registry (ds_train/model/workarounds.py) and of the "
              "checkpoint's client state",
}


def deepspeed_range_note(cfg: RunConfig, version: str) -> str | None:
    """One line when `version` (DeepSpeed's) is outside DEEPSPEED_PROVEN and the run relies on a
    workaround tied to it (parallel.sequence, tensor or expert > 1); None otherwise."""
    from packaging.version import Version

    low, high = DEEPSPEED_PROVEN
    if Version(low) <= Version(version) < Version(high):
        return None
    used = [TIED_TO_DEEPSPEED[k] for k in ("sequence", "tensor", "expert") if getattr(cfg.parallel, k) > 1]
    if not used:
        return None
    return (f"DeepSpeed {version} is outside the range ds_train's parallel workarounds were proven on (>={low}, "
            f"<{high}): check {'; and '.join(used)} with `ds-train parity` before trusting the losses")


@dataclass(frozen=True)
class Layout:
    """A run's layout at its world size: who holds what (dims) and the batch math over the data ranks."""

    dims: ParallelDims
    batch: BatchPlan


def check_layout(cfg: RunConfig, template: dict, world_size: int | None, hf_config=None) -> Layout | None:
    """The one check of a run's layout, before anything is written or launched, for the run, the dry
    run and the estimate, `launch --check` / `slurm`, and parity: at `world_size`, that the sizes
    divide it (plan_dims), the batch math over the data ranks (plan_batch), and the model's heads,
    window, what AutoTP shards and what AutoEP splits (check_model, check_expert_model; `hf_config`
    None: not checked); then what the sizes cannot take with this DeepSpeed JSON (check_parallel).
    `world_size` None (the check step, before the world is known): the last part alone, and None."""
    layout = None
    if world_size is not None:
        dims = plan_dims(cfg.parallel, world_size)
        t = cfg.train
        batch = plan_batch(t.global_batch_size, t.micro_batch_size, dims.data, t.seq_len, dims.derivation(),
                           sample_rows(cfg.data.format))
        if hf_config is not None and dims.sequence * dims.tensor > 1:
            check_model(dims, hf_config, cfg.model.attn_implementation, t.seq_len)
        if hf_config is not None:
            check_expert_model(dims.expert, hf_config)
            check_router_loss(cfg, hf_config)
        layout = Layout(dims, batch)
    check_parallel(cfg, template)
    return layout


def check_parallel(cfg: RunConfig, template: dict) -> None:
    """What the model-parallel sizes cannot take, from the run config and the DeepSpeed JSON alone
    (before anything is written; every problem, one line)."""
    check_sequence(cfg, template)
    check_expert_run(cfg)
    tp = cfg.parallel.tensor
    if tp == 1:
        return
    stage = int(_zero(template).get("stage", 0))
    problems = []
    if stage == 3:
        problems.append(f"parallel.tensor={tp} with ZeRO-3: ds_train trains AutoTP with ZeRO 0-2 (TP splits each "
                        f"layer's weights across a tensor group, ZeRO-1/2 the optimizer states across the data "
                        f"ranks); use ds_configs/zero1.json or zero2.json, or parallel.tensor=1 to shard everything "
                        f"with ZeRO-3")
    if stage == 0 and cfg.model.dtype != "fp32":
        auto = " (bf16 on a GPU)" if cfg.model.dtype == "auto" else ""
        problems.append(f"parallel.tensor={tp} with ZeRO-0 and model.dtype={cfg.model.dtype}{auto}: DeepSpeed 0.19.8's "
                        f"ZeRO-0 bf16/fp16 optimizer measures the gradient norm it clips by from tensor rank 0's "
                        f"shards alone under AutoTP (it filters gradients by a mark only the parameters carry); "
                        f"set model.dtype=fp32, or use ds_configs/zero1.json or zero2.json")
    if cfg.model.lora.rank:
        problems.append(f"parallel.tensor={tp} with LoRA (model.lora.rank={cfg.model.lora.rank}): AutoTP replaces "
                        f"the linear layers peft puts its adapters on; ds_train does not combine them: use ZeRO-3 "
                        f"with parallel.tensor=1 for a base that does not fit one GPU")
    if cfg.parallel.sequence > 1:
        problems.append(f"parallel.tensor={tp} with parallel.sequence={cfg.parallel.sequence}: DeepSpeed 0.19.8's "
                        f"AutoTP replaces the Ulysses process groups with its own, so the two do not combine; "
                        f"choose one")
    if problems:
        raise UserError("; ".join(problems))


def check_sequence(cfg: RunConfig, template: dict) -> None:
    """What Ulysses sequence parallelism (parallel.sequence) cannot take, found before anything is
    written (every problem, one line); `template`: the DeepSpeed JSON."""
    zero = _zero(template)
    stage = int(zero.get("stage", 0))
    sp = cfg.parallel.sequence
    if sp == 1:
        return
    problems = []
    seq_len = cfg.train.seq_len
    if seq_len % sp:
        near = sorted({seq_len // sp * sp or sp, (seq_len // sp + 1) * sp})
        problems.append(f"train.seq_len={seq_len} is not divisible by parallel.sequence={sp} (each sequence rank "
                        f"holds seq_len / {sp} positions); choose {choices(near)}")
    if cfg.model.attn_implementation in ("eager", "paged|eager"):
        problems.append(f"model.attn_implementation={cfg.model.attn_implementation!r} cannot run under "
                        f"parallel.sequence={sp} (it needs the whole seq_len x seq_len mask on every rank); use sdpa "
                        f"or flash_attention_2")
    if stage == 3 and zero.get("reduce_scatter", True) is False:
        problems.append(f"zero_optimization.reduce_scatter=false with parallel.sequence={sp}: ZeRO-3 then averages "
                        f"some gradient buckets over the data ranks and others over data x sequence (DeepSpeed "
                        f"0.19.8); remove the key (true is the default)")
    if cfg.data.format == "sft" and cfg.data.pack is True and not packs_under_sequence(cfg.model.attn_implementation):
        problems.append(f"data.pack=true with parallel.sequence={sp} and model.attn_implementation="
                        f"{cfg.model.attn_implementation!r}: its Ulysses attention is causal over the whole sequence, "
                        f"so packed examples would attend to each other; use sdpa or flash_attention_2, or set "
                        f"data.pack=false")
    if problems:
        raise UserError("; ".join(problems))
