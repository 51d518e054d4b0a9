"""LoRA with peft (model.lora): which modules get adapters, checked on the model's config before
anything is built; the adapters put on the built model (ZeRO-3: on its partitioned base, before
DeepSpeed wraps it, which partitions the new adapter weights with the rest); the quantised base
(QLoRA) where bitsandbytes and a CUDA GPU are present.

Only the adapters (and modules_to_save) require grad, so only they reach the optimizer: a frozen
base holds no gradients and no optimizer states (ds_train.plan.memory counts it that way).
"""

from __future__ import annotations

from ds_train.config.model import LoraConfig
from ds_train.errors import UserError

ALL_LINEAR = "all-linear"


def base_model(model):
    """A PEFT model's base model (the Hugging Face one, its adapters inside); any other model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enabled(lora: LoraConfig) -> bool:
    return lora.rank > 0


def _meta_model(hf_config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def linear_names(hf_config) -> tuple[list[str], str]:
    """The model's linear layers by their last name (q_proj, ...), and the output head's, from a
    model built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    head = model.get_output_embeddings()
    names, head_name = [], ""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            last = name.rsplit(".", 1)[-1]
            if module is head:
                head_name = last
            elif last not in names:
                names.append(last)
    return names, head_name


def module_names(hf_config) -> list[str]:
    """Every module's last name (for modules_to_save)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name})


def check_lora(lora: LoraConfig, hf_config, library: bool = True) -> None:
    """Before anything is built or written: every target module names a linear layer of this model
    (peft matches a name or a name's last parts), every module to save exists, and (`library`: on the
    machine that trains) a quantised base has its GPU library. One line for all problems."""
    if not enabled(lora):
        return
    problems = []
    if lora.load_in != "none" and library:
        problems += quantisation_problems(lora.load_in)
    linears, head = linear_names(hf_config)
    kind = getattr(hf_config, "model_type", "this")
    targets = [t for t in lora.target_modules if t != ALL_LINEAR]
    if ALL_LINEAR in lora.target_modules and len(lora.target_modules) > 1:
        problems.append(f"model.lora.target_modules: {ALL_LINEAR} already names every linear layer; give it alone "
                        f"or list modules")
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in linears + [head]]
    refused = peft_refuses(_meta_model(hf_config), [t.rsplit(".", 1)[-1] for t in targets if t not in missing])
    if refused:
        problems.append(f"model.lora.target_modules: peft puts no LoRA on {', '.join(map(repr, refused))} of a {kind} "
                        f"model ({next(iter(refused.values()))[:120]}); choose from "
                        f"{', '.join(n for n in linears if n not in refused)}, or {ALL_LINEAR} (which leaves them out)")
    if missing:
        problems.append(f"model.lora.target_modules: {', '.join(map(repr, missing))} match no linear layer of this "
                        f"{kind} model; choose from {', '.join(linears)}" + (f" (or {head}, the output head)" if head
                                                                             else "") + f", or {ALL_LINEAR}")
    if lora.modules_to_save:
        names = module_names(hf_config)
        unknown = [m for m in lora.modules_to_save if m.rsplit(".", 1)[-1] not in names]
        if unknown:
            problems.append(f"model.lora.modules_to_save: {', '.join(map(repr, unknown))} name no module of this "
                            f"{kind} model; for example {', '.join(n for n in names if 'embed' in n or n == head)}")
    if problems:
        raise UserError("; ".join(problems))


BNB_ON_CPU = "0.50"  # the bitsandbytes whose CPU backend QLoRA was tested with (tests/test_lora.py)


def quantisation_problems(load_in: str) -> list[str]:
    import importlib.util

    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        return [f"model.lora.load_in={load_in} (QLoRA) needs bitsandbytes, which is not installed (pip install "
                f"'bitsandbytes>={BNB_ON_CPU}'); or set model.lora.load_in=none"]
    from importlib.metadata import version

    from packaging.version import Version

    if not torch.cuda.is_available() and Version(version("bitsandbytes")) < Version(BNB_ON_CPU):
        return [f"model.lora.load_in={load_in} (QLoRA) on a CPU needs bitsandbytes >= {BNB_ON_CPU} (its CPU "
                f"backend; {version('bitsandbytes')} is installed): pip install -U bitsandbytes, or set "
                f"model.lora.load_in=none"]
    return []


def quantisation_config(lora: LoraConfig):
    """transformers' BitsAndBytesConfig for a quantised base (None: full precision)."""
    if lora.load_in == "none":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if lora.load_in == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
    return BitsAndBytesConfig(load_in_8bit=True)


def peft_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    targets = ALL_LINEAR if ALL_LINEAR in lora.target_modules else list(lora.target_modules)
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                          modules_to_save=list(lora.modules_to_save) or None, task_type="CAUSAL_LM")


def apply_lora(model, lora: LoraConfig, seed: int):
    """The model with peft's adapters on it. Seeded: every rank, every ZeRO stage and world size
    starts from the same adapter weights (lora_A random, lora_B zero: the adapted model starts as
    the base)."""
    import torch
    from peft import get_peft_model, prepare_model_for_kbit_training

    if lora.load_in != "none":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    config = peft_config(lora)
    if config.target_modules == ALL_LINEAR:
        # all-linear: every linear layer peft adapts on this model but its routers, named (peft's own
        # all-linear takes PhiMoE's router, an nn.Linear that returns a tuple, and Mamba's out_proj, which
        # it then refuses)
        plain = linears_of(model)
        refused = peft_refuses(model, plain)
        if refused or len(plain) < len(linears_of(model, plain_only=False)):
            config.target_modules = [n for n in plain if n not in refused]
    try:
        adapted = get_peft_model(model, config)
    finally:
        torch.random.set_rng_state(state)
    adapted.register_state_dict_post_hook(_drop_frozen)
    return adapted


def linears_of(model, plain_only: bool = True) -> list[str]:
    """The last names of the model's linear layers but its output head, in order; `plain_only`: not the
    model's routers (PhiMoE's is an nn.Linear that returns a tuple, which peft's layer cannot wrap)."""
    import torch

    from ds_train.model.routers import router_class

    head, routers, names = model.get_output_embeddings(), router_class(model) if plain_only else None, []
    for name, module in model.named_modules():
        router = routers not in (None, torch.nn.Linear) and isinstance(module, routers)  # Jamba's: a plain Linear
        router |= plain_only and not computes_linear(module)  # Llama 4's router, DeepSeek-V4's grouped projection
        if isinstance(module, torch.nn.Linear) and not router and module is not head and \
                name.rsplit(".", 1)[-1] not in names:
            names.append(name.rsplit(".", 1)[-1])
    return names


def computes_linear(module) -> bool:
    """Whether a layer LoRA would adapt computes x W^T + b, as peft's adapter assumes: measured, on two rows, for
    a modeling file's own nn.Linear with its own forward (Falcon's does; Llama 4's router returns a tuple and
    DeepSeek-V4's grouped projection splits its input). A plain nn.Linear, another library's (bitsandbytes' of a
    quantised base) and a layer whose weight is not here (partitioned by ZeRO-3) are taken as peft takes them."""
    import torch

    if not isinstance(module, torch.nn.Linear) or type(module).forward is torch.nn.Linear.forward or \
            not type(module).__module__.startswith("transformers.models.") or module.weight.numel() == 0 or \
            module.weight.device.type == "meta":
        return True
    w = module.weight
    x = torch.linspace(-1, 1, 2 * module.in_features, dtype=w.dtype, device=w.device).reshape(2, -1)
    try:
        with torch.no_grad():
            out = module(x)
    except Exception:  # noqa: BLE001 - a forward that cannot take rows of its input width is not x W^T + b
        return False
    with torch.no_grad():
        want = torch.nn.functional.linear(x, w, module.bias)
    return torch.is_tensor(out) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-3, atol=1e-5)


def peft_refuses(model, names: list[str]) -> dict[str, str]:
    """The layer names among `names` that peft will not put LoRA on in this model, with peft's reason:
    its own check, asked name by name (peft 0.18: out_proj and conv1d of Mamba-based models)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:  # another peft: its get_peft_model says it, at build
        return {}
    config, refused = PeftLoraConfig(r=1, target_modules=["q_proj"]), {}
    for name in names:
        try:
            check(config, model, name)
        except ValueError as e:
            refused[name] = " ".join(str(e).split())
    return refused


def _drop_frozen(module, state_dict, prefix, local_metadata) -> None:
    """The adapted model's state_dict is what trains: DeepSpeed's exclude_frozen_parameters drops the
    frozen base by its parameter names, which miss a tied weight's second name (lm_head.weight tied
    to the embedding), so a checkpoint would carry the whole embedding."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            state_dict.pop(prefix + name, None)
