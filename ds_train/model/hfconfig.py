"""The model's Hugging Face config, checked before anything is written: model.config (its model type,
misspelt keys, values transformers rejects) or model.path's config.json (and its weights, through
ds_train.model.weights), the sequence length against the positions it has, and that transformers
can build the architecture (on the meta device: no memory)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from ds_train.config.model import ModelConfig
from ds_train.errors import UserError
from ds_train.model.weights import REFETCH, check_weights, json_object

# What transformers raises for a config or an architecture it rejects (its strict-dataclass
# validators raise huggingface_hub's StrictDataclassError, which is none of these: added below).
HF_REJECTS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, ImportError)

def said(e: BaseException, limit: int = 300) -> str:
    """What transformers said, on one line: the validator's own error rather than its wrapper."""
    cause = e.__cause__ if type(e).__name__.startswith("StrictDataclass") and e.__cause__ else e
    said = " ".join(str(cause).split()).rstrip(".")
    if not isinstance(cause, ValueError) or not said:  # KeyError('gelux') says only 'gelux'
        said = f"{type(cause).__name__}: {said}" if said else type(cause).__name__
    return said if len(said) <= limit else said[:limit] + "..."


def _rejects() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import StrictDataclassError

    return (*HF_REJECTS, StrictDataclassError)


def config_class(model_type: str):
    """transformers' config class of `model_type`; an unknown one suggests the closest types."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
                "use one of transformers' model types, for example llama, mistral, qwen2 or gpt2")
        raise UserError(f"model.config.model_type: {model_type!r} is not a Hugging Face model type; {hint}")
    return CONFIG_MAPPING[model_type]


def check_causal_lm(model_type: str, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{where}: model_type {model_type!r} has no causal LM in transformers "
                        f"(AutoModelForCausalLM); choose a decoder model type, for example llama")


def unknown_config_keys(model_type: str, given: dict, built) -> list[str]:
    """The keys of `given` that `built` (its config) kept as stray attributes: keys the default
    config of `model_type` does not have. transformers accepts any key, so a misspelt one
    (hidden_sizee) would be silently unused. Keys it consumes (rope_theta, torch_dtype) are not kept."""
    default = config_class(model_type)()
    known = set(default.to_dict()) | set(default.attribute_map)
    stored = set(built.to_dict())
    return [key for key in given if key not in known and key in stored]


def keys_read(hf, attn_implementation: str = "sdpa") -> set[str]:
    """The config attributes the model reads when it is built and run once on the meta device: what its
    modeling code uses, declared by its config class or not (the pinned Qwen3-MoE attention reads head_dim
    with getattr). What the forward reads before a meta kernel it cannot run is counted."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    read: set[str] = set()

    class Reading(type(hf)):
        def __getattribute__(self, name):
            read.add(name)
            return super().__getattribute__(name)

    watched = copy.deepcopy(hf)
    watched.__class__ = Reading
    model_class = AutoModelForCausalLM._model_mapping[type(hf)]
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), torch.no_grad():
            model = model_class._from_config(watched, attn_implementation=attn_implementation)
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    except Exception:  # noqa: BLE001 - what was read until then counts; check_buildable reports a failure
        pass
    return read


def check_config_keys(model_type: str, given: dict, built, attn_implementation: str = "sdpa") -> None:
    """A UserError naming every misspelt model.config key with the closest valid key: a key its config
    class does not declare and its model does not read when built and run (keys_read)."""
    import inspect

    unknown = unknown_config_keys(model_type, given, built)
    read = keys_read(built, attn_implementation) if unknown else set()
    unknown = [key for key in unknown if key not in read]
    if not unknown:
        return
    cls = config_class(model_type)
    default = cls()
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
    valid = sorted({*default.to_dict(), *default.attribute_map, *params, *(r for r in read if r.islower())}
                   - {"model_type"})
    valid = [k for k in valid if not k.startswith("_")]
    problems = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        fix = f" (did you mean {close[0]!r}?)" if close else "; remove it"
        problems.append(f"model.config.{key}: unknown key for {cls.__name__} (model_type {model_type}), "
                        f"which Hugging Face would leave unused{fix}")
    raise UserError("; ".join(problems))


def check_buildable(hf, attn_implementation: str, where: str) -> None:
    """Build the model on the meta device (no memory, ~0.1 s even for 70B) so that an architecture
    transformers cannot build fails here, before anything is written, naming `where` it came from."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    check_causal_lm(hf.model_type, where)
    if is_deepspeed_zero3_enabled():  # a live HfDeepSpeedConfig would build it inside zero.Init
        return

    def build(impl: str) -> BaseException | None:
        try:
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(hf, attn_implementation=impl)
        except _rejects() as e:
            return e
        return None

    error = build(attn_implementation)
    if error is None:
        check_forward(hf, attn_implementation, where)
        return
    if attn_implementation != "eager" and build("eager") is None:
        raise UserError(f"model.attn_implementation: {attn_implementation!r} cannot be used here "
                        f"({said(error, 150)}); use sdpa or eager")
    raise UserError(f"{where}: Hugging Face cannot build the {hf.model_type} model from it ({said(error)}); "
                    f"fix it")


SIZE_KEY = re.compile(r"(^|_)(size|dim|heads|layers|experts|embd)$|^(num|n)_")  # a count or a width
CONFIRM_PARAMS = 50_000_000  # a model this small is built for real to confirm what the meta device says
SHAPE_ERROR = re.compile(r"size|shape|dimension|mat1|mat2|invalid for input|must match|must divide|expected .* got",
                         re.I)


def _key(key: str, where: str) -> str:
    return f"model.config.{key}" if where == "model.config" else f"{key} in {where}"


def nonpositive_sizes(values: dict, model_type: str, where: str) -> list[str]:
    """Sizes and counts (hidden_size, intermediate_size, num_*_heads, head_dim, ...) that are not
    positive where the model type's default is a positive number or unset."""
    default = config_class(model_type)()
    errs = []
    for key, value in values.items():
        if (isinstance(value, int) and not isinstance(value, bool) and value <= 0 and SIZE_KEY.search(key)
                and (getattr(default, key, None) is None or (isinstance(getattr(default, key), int)
                                                              and getattr(default, key) > 0))):
            errs.append(f"{_key(key, where)}: {value} must be positive (the {model_type} model's "
                        f"default is {getattr(default, key, None)})")
    return errs


def _size_hint(hf, where: str) -> str:
    """Which sizes of `hf` to look at: a relation it breaks, else every size it sets."""
    get = lambda k: getattr(hf, k, None)  # noqa: E731
    heads, kv, hidden = get("num_attention_heads"), get("num_key_value_heads"), get("hidden_size")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        return (f"{_key('num_attention_heads', where)}={heads}, num_key_value_heads={kv}: the attention heads "
                f"must be a multiple of the key-value heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads and not get("head_dim"):
        return (f"{_key('hidden_size', where)}={hidden}, num_attention_heads={heads}: the hidden size must be "
                f"a multiple of the attention heads, or set head_dim")
    sizes = {k: v for k, v in hf.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)
             and SIZE_KEY.search(k)}
    return "check " + ", ".join(f"{_key(k, where) if i == 0 else k}={v}" for i, (k, v) in enumerate(sizes.items()))


def check_forward(hf, attn_implementation: str, where: str) -> None:
    """Run the architecture once, as training will use it, on the meta device (shapes only, no
    memory): sizes that contradict each other (heads that do not divide, a head_dim the projections
    do not have) fail here, before anything is written, not at the first step. What the meta device
    cannot run (some fused kernels) is confirmed on a real small model, or passed for a large one
    unless it is a shape error."""
    import torch
    from transformers import AutoModelForCausalLM

    limit = getattr(hf, "max_position_embeddings", None)
    tokens = min(8, limit) if isinstance(limit, int) and limit > 0 else 8  # XLNet's -1: no limit

    def forward(device: str, dtype=None) -> tuple[BaseException | None, int]:
        """(what the forward pass raised, the model's parameter count)."""
        params = 0
        try:
            with torch.random.fork_rng(devices=[]), torch.device(device), torch.no_grad():
                model = AutoModelForCausalLM.from_config(hf, attn_implementation=attn_implementation, dtype=dtype)
                params = sum(p.numel() for p in model.parameters())
                ids = torch.zeros(1, tokens, dtype=torch.long)
                try:  # with its KV cache, as generation runs it
                    model(input_ids=ids)
                except (*_rejects(), AssertionError, NotImplementedError) as e:
                    if SHAPE_ERROR.search(str(e)):
                        raise
                    # a cache the model cannot start without a prompt's past (Jamba's, HRM's): as training runs it
                    model(input_ids=ids, use_cache=False)
        except (*_rejects(), AssertionError, NotImplementedError) as e:
            return e, params
        return None, params

    error, params = forward("meta")
    if error is not None and "dtype" in str(error):  # a meta kernel that takes bf16 only (MoE experts' grouped_mm)
        error, params = forward("meta", torch.bfloat16)
    if error is None:
        return
    if params and params <= CONFIRM_PARAMS:
        error, _ = forward("cpu")
    elif not SHAPE_ERROR.search(str(error)):
        return
    if error is not None:
        raise UserError(f"{where}: the {hf.model_type} model's sizes contradict each other: a forward pass "
                        f"fails ({said(error, 150)}); {_size_hint(hf, where)}")


def build_hf_config(model_cfg: ModelConfig, vocab_size: int, seq_len: int, weights: bool = True):
    """The transformers config, with vocab_size `vocab_size` unless model.config sets it.

    Everything about the model that can fail is checked here, once, before anything is written:
    the config's keys and values, that the architecture builds, and (`weights`: model.path holds
    them, as a Hugging Face directory does and a ds_train run's hf_model/ does not) that every
    weights file is whole and finite."""
    from transformers import AutoConfig

    if model_cfg.path:
        config_json = Path(model_cfg.path) / "config.json"
        where = f"model.path: {str(config_json)!r}"
        json_object(config_json)
        try:
            hf = AutoConfig.from_pretrained(model_cfg.path)
        except _rejects() as e:
            raise UserError(f"{where}: Hugging Face rejects it ({said(e)}); fix it, or {REFETCH}") from None
        bad = nonpositive_sizes(hf.to_dict(), hf.model_type, where)
        if bad:
            raise UserError("; ".join(bad))
    else:
        where = "model.config"
        kwargs = dict(model_cfg.config)
        model_type = kwargs.pop("model_type")
        config_class(model_type)
        check_causal_lm(model_type, "model.config")
        bad = nonpositive_sizes(kwargs, model_type, "model.config")
        if bad:
            raise UserError("; ".join(bad))
        kwargs.setdefault("vocab_size", vocab_size)
        try:
            hf = AutoConfig.for_model(model_type, **kwargs)
        except _rejects() as e:
            raise UserError(f"model.config: Hugging Face rejects it: {said(e)}; fix model.config") from None
        check_config_keys(model_type, model_cfg.config, hf, model_cfg.attn_implementation)
    own_vocab = bool(model_cfg.path) or "vocab_size" in model_cfg.config
    if own_vocab:
        check_padding_id(hf, model_cfg, where)
    elif isinstance(getattr(hf, "vocab_size", None), int):  # a stand-in until the tokenizer is known (with_vocab
        hf.vocab_size = max(hf.vocab_size, _padding_id(hf) + 1)  # checks it then): the build must not trip on it
    max_pos = getattr(hf, "max_position_embeddings", None)  # XLNet's -1: no limit (relative positions)
    if isinstance(max_pos, int) and 0 < max_pos < seq_len:
        raise UserError(f"train.seq_len={seq_len} exceeds the model's max_position_embeddings="
                        f"{max_pos}; lower train.seq_len or raise model.config.max_position_embeddings")
    check_buildable(hf, model_cfg.attn_implementation, where)
    if model_cfg.path and weights:
        check_weights(Path(model_cfg.path))
    return hf


def with_vocab(hf_config, model_cfg: ModelConfig, vocab_size: int):
    """The config of a model trained from scratch takes its vocabulary size from the tokenizer, known
    once the data is prepared (unless model.config sets it): the one attribute set after the checks,
    which do not depend on it."""
    if not model_cfg.path and "vocab_size" not in model_cfg.config:
        hf_config.vocab_size = vocab_size
        check_padding_id(hf_config, model_cfg, "model.config")
    return hf_config


def _padding_id(hf) -> int:
    """The largest padding token id of the config and of its text model's (-1: none)."""
    ids = [getattr(part, "pad_token_id", None) for part in (hf, hf.get_text_config())]
    return max((i for i in ids if isinstance(i, int) and not isinstance(i, bool)), default=-1)


def check_padding_id(hf, model_cfg: ModelConfig, where: str) -> None:
    """The padding token id the model builds its embedding with (nn.Embedding's padding_idx) is an id of the
    vocabulary ds_train gives it: a model type's default (Phi-3's 32000) under a smaller tokenizer's
    vocabulary is otherwise an AssertionError at the model's build. One line naming the id, where it comes
    from and the fix. (Ids model.config sets are inputs.check_token_ids'.)"""
    vocab = getattr(hf, "vocab_size", None)
    pad = _padding_id(hf)
    if not isinstance(vocab, int) or pad < vocab:
        return
    size = ("model.config.vocab_size" if "vocab_size" in model_cfg.config else
            "its config's vocab_size" if model_cfg.path else "the tokenizer's size")
    if "pad_token_id" in model_cfg.config:  # as inputs.check_token_ids says it, before the build trips on it
        raise UserError(f"model.config.pad_token_id: {pad!r} is not a token id of the vocabulary (0 to {vocab - 1}, "
                        f"{size}); give an id in that range, or null")
    origin = f"{where}: its pad_token_id {pad}" if model_cfg.path else (
        f"model.config: the {hf.model_type} model type's default pad_token_id {pad}")
    key = "its pad_token_id" if model_cfg.path else "model.config.pad_token_id"
    raise UserError(f"{origin} is not a token id of the vocabulary (0 to {vocab - 1}, {size}), so its embedding "
                    f"cannot be built; set {key} to an id in that range, or null")
