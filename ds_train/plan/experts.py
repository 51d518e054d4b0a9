"""Expert parallelism (parallel.expert, DeepSpeed AutoEP): the mixture-of-experts models it takes (DeepSpeed's
presets), how many experts a model has, and what `parallel.expert` ranks per expert group ask of the model and
of the layout. AutoEP cuts its expert groups from the data-parallel ranks: the world size and the batch math
do not change. The ds_config section it renders is `expert_parallel` (engine.render_ds_config); the memory
plan counts a rank's share of the experts (plan/memory.py, expert_param_count).

What ds_train does not combine with experts yet is refused here, one line each, before anything is written:
sequence and tensor parallelism, LoRA and preference training (check_expert_run); the router loss where it
would not train (check_router_loss); RIPT (ds_train/ript) and moving a checkpoint to another layout
(ds_train/checkpoint/resume.py) refuse it where they are. Export gathers the experts into the model's own
layout (ds_train/checkpoint/experts.py).
"""

from __future__ import annotations

from ds_train.config import RunConfig
from ds_train.config.model import EXPERTS_EAGER
from ds_train.errors import UserError
from ds_train.plan.batch import choices, divisors


def _presets() -> dict:
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return PRESET_MODELS


def autoep_preset(hf_config) -> str | None:
    """The AutoEP preset of the model's type (DeepSpeed's registry), None when it has none."""
    model_type = getattr(hf_config, "model_type", None)
    return next((name for name, preset in _presets().items() if model_type in preset.hf_model_types), None)


def num_experts(hf_config) -> int | None:
    """The routed experts per MoE layer, as the model's preset names the config attribute."""
    preset = autoep_preset(hf_config)
    value = getattr(hf_config, _presets()[preset].num_experts_attr, None) if preset else None
    return value if isinstance(value, int) else None


def expert_param_count(model, hf_config) -> int:
    """Parameters of the routed experts (every MoE layer's experts module, as the model's AutoEP preset
    names them): what parallel.expert divides. 0 for a model without a preset."""
    import re

    if not any(name.endswith(".experts") for name, _ in model.named_modules()):
        return 0  # a dense model (and DeepSpeed's registry not imported for it)
    preset = autoep_preset(hf_config)
    if preset is None:
        return 0
    spec = _presets()[preset]
    pattern = re.compile(spec.moe_layer_pattern + r"\." + re.escape(spec.experts_pattern))
    return sum(p.numel() for name, module in model.named_modules() if pattern.fullmatch(name)
               for p in module.parameters())


def moe_mlp_width(model, hf_config) -> float:
    """What autograd keeps of a mixture-of-experts model's MLPs per token, in values, averaged over the
    layers (0 for a dense model: the planner's 4 x intermediate_size then). A token's k experts each keep
    its hidden state twice (gathered in, and their output before the routing weight), 4 x their width
    (gate, up, SiLU, product) and their weight and index; a shared expert 4 x its width; the router its
    logits and probabilities; a dense layer among them (DeepSeek's first ones) 4 x intermediate_size.
    Widths are read off the experts' parameters (3 matrices of hidden x width). Measured against what
    autograd keeps of Hugging Face's Qwen3-MoE blocks (top 2, 4, 8) and Mixtral's (tests/test_memory.py)."""
    import re

    preset = autoep_preset(hf_config)
    experts = num_experts(hf_config)
    if preset is None or not experts:
        return 0.0
    spec, hidden = _presets()[preset], hf_config.hidden_size
    k = int(getattr(hf_config, spec.top_k_attr, 1) or 1)
    pattern = re.compile(spec.moe_layer_pattern)
    widths = []
    for name, module in model.named_modules():
        block = getattr(module, spec.experts_pattern, None) if pattern.fullmatch(name) else None
        if block is None:  # not an MoE layer (Qwen3-MoE's mlp_only_layers are dense)
            continue
        routed = sum(p.numel() for p in block.parameters()) / (3 * hidden * experts)
        shared = getattr(module, spec.shared_experts_pattern or "", None) if spec.has_shared_experts else None
        shared_width = sum(p.numel() for p in shared.parameters()) / (3 * hidden) if shared is not None else 0
        widths.append(k * (2 * hidden + 4 * routed + 4) + 4 * shared_width + 2 * experts)
    dense = hf_config.num_hidden_layers - len(widths)
    return (sum(widths) + dense * 4 * getattr(hf_config, "intermediate_size", 4 * hidden)) / hf_config.num_hidden_layers


# The config attributes Hugging Face's mixture-of-experts models give their routed experts per layer under
# (Mixtral, Qwen2/3-MoE, OLMoE: num_experts / num_local_experts; DeepSeek: n_routed_experts; ERNIE: moe_num_experts).
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_expert_model(expert: int, hf_config) -> None:
    """A model AutoEP can split into `expert` groups: one of its presets' types, its experts divisible."""
    if expert == 1:
        return
    model_type = getattr(hf_config, "model_type", "?")
    if not any(isinstance(getattr(hf_config, a, None), int) and getattr(hf_config, a) > 0 for a in EXPERT_COUNTS):
        raise UserError(f"parallel.expert={expert}: model type {model_type!r} has no experts (a dense model: no "
                        f"mixture-of-experts layers to split over ranks); set parallel.expert=1")
    if autoep_preset(hf_config) is None:
        types = sorted({t for preset in _presets().values() for t in preset.hf_model_types})
        raise UserError(f"parallel.expert={expert}: model type {model_type!r} has no DeepSpeed AutoEP preset, so its "
                        f"experts cannot be split; AutoEP takes {', '.join(types)}; for this model use "
                        f"parallel.expert=1")
    experts = num_experts(hf_config)
    if experts is not None and experts % expert:
        raise UserError(f"parallel.expert={expert} does not divide the model's {experts} experts per layer; choose "
                        f"{choices(divisors(experts))}")


def check_router_loss(cfg: RunConfig, hf_config) -> None:
    """The router's auxiliary (load-balancing) loss, asked for by the model config (output_router_logits),
    trains in pretraining and SFT (ds_train/train/losses.py), per micro-batch as in Hugging Face; where
    ds_train's loss would leave it out, or a rank would see part of a micro-batch's tokens, refused."""
    if getattr(hf_config, "output_router_logits", False) is not True:
        return
    where = ("data.format=preference: the DPO loss does not add it yet" if cfg.data.format == "preference" else
             f"parallel.sequence={cfg.parallel.sequence}: each rank routes part of a sequence, and the loss is "
             f"computed per micro-batch" if cfg.parallel.sequence > 1 else "")
    if where:
        raise UserError(f"model.config.output_router_logits=true with {where}; set it to false (the loss is then the "
                        f"language-modelling loss alone, as with the model's default)")


def check_expert_data(expert: int, data: int) -> None:
    """Expert groups are cut from the data-parallel ranks: `expert` must divide them."""
    if expert > 1 and data % expert:
        raise UserError(f"parallel.expert={expert} does not divide the {data} data-parallel rank(s) (AutoEP cuts its "
                        f"expert groups from them); choose {choices(divisors(data))}, or launch a multiple of {expert} "
                        f"data-parallel ranks")


def check_expert_run(cfg: RunConfig) -> None:
    """What ds_train does not combine with expert parallelism yet (every problem, one line)."""
    ep = cfg.parallel.expert
    if ep == 1:
        return
    problems = []
    for key in ("sequence", "tensor"):
        size = getattr(cfg.parallel, key)
        if size > 1:
            problems.append(f"parallel.expert={ep} with parallel.{key}={size}: ds_train does not combine expert "
                            f"parallelism with {key} parallelism yet; choose one")
    if cfg.model.lora.rank:
        problems.append(f"parallel.expert={ep} with LoRA (model.lora.rank={cfg.model.lora.rank}): AutoEP replaces the "
                        f"MoE blocks peft would put adapters on; ds_train does not combine them yet")
    if cfg.model.compile is True:
        problems.append(f"model.compile=true with parallel.expert={ep}: {EXPERTS_EAGER}; leave model.compile at "
                        f"auto (eager layers under expert parallelism)")
    if problems:
        raise UserError("; ".join(problems))


def expert_section(cfg: RunConfig, hf_config) -> dict | None:
    """The ds_config's `expert_parallel` section the run owns (None without expert parallelism)."""
    if cfg.parallel.expert == 1:
        return None
    return {"enabled": True, "autoep_size": cfg.parallel.expert, "preset_model": autoep_preset(hf_config)}


def check_autoep_section(ds: dict, world: int, source: str) -> None:
    """The rendered `expert_parallel` section as DeepSpeed's AutoEP reads and validates it inside
    deepspeed.initialize, after the run directory is written, where a wrong value was a traceback and a
    misspelt key silently ignored: here, before anything is written, one line naming the file and key."""
    import dataclasses
    import difflib

    section = ds.get("expert_parallel")
    if not isinstance(section, dict) or not section.get("enabled"):
        return
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig, parse_autoep_config, validate_autoep_config

    keys = [f.name for f in dataclasses.fields(AutoEPConfig) if not f.name.startswith("_")]
    for key in section:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{source}: expert_parallel.{key}: not a key DeepSpeed's AutoEP reads{hint}; it would be "
                            f"ignored")
    zero = ds.get("zero_optimization") or {}
    offloaded = [(zero.get(k) or {}).get("device") in ("cpu", "nvme") for k in ("offload_optimizer", "offload_param")]
    tensor = int((ds.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    try:
        validate_autoep_config(parse_autoep_config(section), world, 1, tensor, 1, zero_stage=int(zero.get("stage", 0)),
                               zero_offload_optimizer=offloaded[0], zero_offload_param=offloaded[1])
    except (ValueError, TypeError) as e:
        raise UserError(f"{source}: expert_parallel: {e}") from None

