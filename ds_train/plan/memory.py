"""Memory arithmetic: what one rank holds for a model under each ZeRO stage, and what it needs.

Pure functions of the model's shape and the run's numbers (no accelerator, no process group), plus
`engine_state_bytes`, which measures what a live DeepSpeed engine holds, to check them against.

Model states per parameter, per rank (Rajbhandari et al. 2020, "ZeRO", section 3, with K = 12 for
mixed-precision Adam), as DeepSpeed 0.19 allocates them; N is the data-parallel world size:

| stage | parameters | gradients | optimizer (fp32 master + Adam m, v) |
|---|---|---|---|
| 0 | p | p | (4 if mixed) + 8 |
| 1, 2 | p | p / N | (4 + 8) / N |
| 3 | p / N | p / N | (4 + 8) / N, master included as in 1-2 |

with p = 2 bytes (bf16/fp16) or 4 (fp32). ZeRO 1-3 keep an fp32 master partition even in fp32
training. `held` above is measured at the step boundary (tests/test_memory.py). ZeRO-1 also holds
full-size gradients through the micro-steps until the reduce at the accumulation boundary
(`accumulation`). The optimizer step adds `step_transient`: the gradient partition upcast to fp32
(4 - p bytes more per parameter of the partition: 18 bytes / N in all for bf16 ZeRO-3, DeepSpeed's
own figure). The step runs after the backward has freed the activations, so a rank's peak is the
larger of the two moments (`Estimate.gpu_peak`): measured on an H200, adding them overshot every
case by the transient (BENCHMARKS.md, "Memory plan against an H200"). Offloading the optimizer moves
the optimizer column (and its transient) to CPU memory; offloading parameters (stage 3) moves the
parameter partition too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_train.plan.experts import expert_param_count, moe_mlp_width, num_experts

GiB = 2**30


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank. `held` is what the engine keeps between steps plus gradients; `accumulation`
    what it holds on top through the micro-steps (ZeRO-1's full-size gradients); `peak` the states'
    own worst moment, the optimizer step, which adds the fp32 gradient copy (`step_transient`)."""

    params: float
    grads: float
    optimizer: float
    step_transient: float
    cpu: float  # offloaded to host memory, per rank
    accumulation: float = 0.0

    @property
    def held(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.held + self.accumulation + self.step_transient


def param_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def model_states(n_params: int, stage: int, dtype: str, world: int, offload_optimizer: bool = False,
                 offload_params: bool = False, trainable: float | None = None, experts: float = 0.0,
                 expert: int = 1) -> ModelStates:
    """Per-rank bytes for parameters, gradients and optimizer states (table in the module doc).
    `trainable`: the parameters that train (LoRA: the adapters), when not all of them do: a frozen
    parameter is held in the training dtype and has no gradient and no optimizer state. `experts`:
    the routed experts' parameters, split over `expert` ranks (AutoEP, parallel.expert): a rank holds
    1/expert of them, and ZeRO partitions those over the world / expert ranks that hold the same ones,
    so the partitioned columns are as without experts and the whole ones hold less."""
    p, n = param_bytes(dtype), n_params
    t = n if trainable is None else trainable
    away = experts * (1 - 1 / expert)  # held by the other ranks of this rank's expert group
    mixed = dtype != "fp32"
    upcast = 4 - p if mixed else 0  # the step's fp32 gradient replaces the low-precision one
    accumulation = 0.0
    if stage == 0:
        params, grads = p * (n - away), p * (t - away)
        optim = ((4 if mixed else 0) + 8) * (t - away)
        transient = upcast * (t - away)
    else:
        params = p * n / world if stage == 3 else p * (n - away)
        grads = p * t / world
        optim = 12 * t / world
        transient = upcast * t / world
        if stage == 1:  # ZeRO-1 accumulates full-size gradients until the boundary reduce
            accumulation = p * (t - away - t / world)
    cpu = 0.0
    if offload_optimizer and stage > 0:
        cpu += optim + transient
        optim, transient = 0.0, 0.0
    if offload_params and stage == 3:
        cpu += params
        params = 0.0
    return ModelStates(params, grads, optim, transient, cpu, accumulation)


def checkpoint_bytes(n_params: int, stage: int, dtype: str, world: int, ranks_here: int,
                     trainable: int | None = None) -> int:
    """Bytes one checkpoint tag takes on a file system holding `ranks_here` of the `world` ranks'
    files: the weights in the training dtype (one model-states file below ZeRO-3, partitioned in
    ZeRO-3) and 12 bytes a parameter of fp32 master weights and Adam moments, partitioned (fp32
    ZeRO-0: a plain torch optimizer, weights and moments in the one file). A frozen base (LoRA) is
    not saved: only the `trainable` parameters are."""
    p, n, share = param_bytes(dtype), n_params if trainable is None else trainable, ranks_here / world
    if stage == 0 and dtype == "fp32":
        return int(12 * n)
    weights = p * n * (share if stage == 3 else 1)
    return int(weights + 12 * n * share)


def engine_state_bytes(engine) -> int:
    """Bytes of the parameter, gradient and optimizer-state tensors a live engine holds on this rank
    (each storage counted once: flat buffers and the views into them are one allocation)."""
    import torch

    tensors = []
    for p in engine.module.parameters():
        tensors += [p.ds_tensor if hasattr(p, "ds_tensor") else p.data, p.grad]
    zero_opt = engine.optimizer
    inner = getattr(zero_opt, "optimizer", zero_opt)
    for group in inner.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad]
    for state in inner.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    # ZeRO's own partitions: fp32 masters (stage 3 hands them to the optimizer one sub-group at a
    # time) and the gradient partitions.
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "averaged_gradients",
                 "fp32_groups_gradient_flat_partition", "grad_partitions_flat_buffer"):
        value = getattr(zero_opt, name, None)
        values = list(value.values()) if isinstance(value, dict) else value
        if torch.is_tensor(values):
            values = [values]
        for v in values or []:
            if isinstance(v, (list, tuple)):
                tensors += list(v)
            else:
                tensors += [v, getattr(v, "grad", None)]
    storages = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def parameter_bytes_beside(module) -> int:
    """Bytes the parameters of every live torch module in this process other than `module` and its
    submodules hold on this rank, found through the garbage collector (what the process holds beyond
    the policy: a reference model built and kept anywhere counts, whatever the code says of it).
    ZeRO-3: a rank's partition of each parameter; each storage counted once."""
    import gc

    import torch

    gc.collect()  # a model built and dropped (a cycle) is not held
    own_modules = {id(m) for m in module.modules()}
    own = {id(p) for p in module.parameters()}
    storages = {}
    for obj in gc.get_objects():  # type(), not isinstance: a deprecated torch alias warns when asked its __class__
        if not issubclass(type(obj), torch.nn.Module) or id(obj) in own_modules:
            continue
        for p in obj.parameters(recurse=False):
            t = p if getattr(p, "ds_tensor", None) is None else p.ds_tensor
            if id(p) not in own and t.numel():
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class ModelShape:
    n_params: int
    n_layers: int
    hidden: int
    intermediate: int
    kv_hidden: int  # hidden size of the K and V projections (grouped-query attention)
    vocab: int
    largest_layer_params: int  # the biggest module's own parameters (what ZeRO-3 gathers at once)
    heads: int = 0  # attention heads (what Ulysses and AutoTP split); 0: unknown
    tensor_split: int = 0  # parameters of the modules AutoTP splits across the tensor ranks (tp_plan)
    kv_heads: int = 0  # key/value heads (AutoTP splits them too); 0: unknown
    trainable: int = 0  # LoRA: the adapters and modules_to_save copies (n_params counts them too); 0: all
    experts: int = 0  # the routed experts' parameters (what parallel.expert splits; plan/experts.py)
    routed: int = 0  # routed experts per MoE layer (what parallel.expert must divide); 0: none or unknown
    mlp_width: float = 0.0  # values a token's MLPs keep per layer (an MoE's: plan/experts.py); 0: 4 x intermediate
    q_hidden: int = 0  # width of the query projection (heads x head_dim; Qwen3's exceeds hidden); 0: hidden
    qk_norm: bool = False  # RMSNorms on the query and key heads (Qwen3): they keep their inputs too
    # decoder layers whose MLP train.mlp_tile_positions tiles (model/tiled_mlp.py's rule: a module named `mlp`,
    # its class ending in MLP, no dropout; an MoE block, Jamba's or LFM2's `feed_forward` stay whole); None: all
    tiled_mlp_layers: int | None = None

    def rank_params(self, tensor: int) -> float:
        """Parameters one rank holds under parallel.tensor (the split modules' share, the rest whole)."""
        return self.n_params - self.tensor_split * (1 - 1 / tensor)


def tp_plan(hf_config) -> dict:
    """The Hugging Face tensor-parallel plan DeepSpeed's AutoTP shards a model by (the config
    class's `base_model_tp_plan`, then the causal-LM class's `_tp_plan`, as DeepSpeed merges them):
    module-name pattern -> style; {} for a model type without one."""
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or {})
    if not plan:
        return plan
    try:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except (ImportError, KeyError):
        return plan
    return {**plan, **(getattr(model_class, "_tp_plan", None) or {})}


def tensor_split_params(model, plan: dict) -> int:
    """Parameters of the modules `plan` splits. A weight tied to one it keeps whole (the embedding
    an output head shares) stays whole: DeepSpeed keeps a tied head replicated (ds_train turns its
    vocabulary-parallel head off)."""
    import re

    patterns = [re.compile(re.escape(k).replace(r"\*", r"[^.]+")) for k in plan]
    prefix = getattr(model, "base_model_prefix", "model") + "."
    split = 0
    for name, p in model.named_parameters():  # a tied weight once, under its first name
        module = name.rsplit(".", 1)[0]
        if any(r.fullmatch(module) or r.fullmatch(module.removeprefix(prefix)) for r in patterns):
            split += p.numel()
    return split


def lora_params(model, lora) -> tuple[int, int]:
    """(adapter parameters, modules_to_save copies) peft adds for `lora` (model.lora): rank x (in +
    out) for each targeted linear layer (all-linear: all but the output head), and a trainable copy
    of each module to save."""
    import torch

    head = model.get_output_embeddings()
    targets = list(lora.target_modules)
    adapters = copies = 0
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and (("all-linear" in targets and module is not head)
                                                    or any(name == t or name.endswith("." + t) for t in targets)):
            adapters += lora.rank * (module.in_features + module.out_features)
        if name and last in lora.modules_to_save:
            copies += sum(p.numel() for p in module.parameters())
    return adapters, copies


def model_shape(hf_config, lora=None) -> ModelShape:
    """Count parameters on the meta device: no memory, no accelerator, any size. `lora`: model.lora,
    when on (its rank > 0): the adapters peft adds, the only parameters that train."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    trainable = 0
    if lora is not None and lora.rank > 0:
        adapters, copies = lora_params(model, lora)
        n_params, trainable = n_params + adapters + copies, adapters + copies
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    split = tensor_split_params(model, tp_plan(hf_config))
    text = hf_config.get_text_config()  # a multimodal config's language model (Gemma 3, Mllama): the layers
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    qk_norm = any(name.endswith(".q_norm") for name, _ in model.named_modules())
    return ModelShape(n_params, text.num_hidden_layers, hidden,
                      getattr(text, "intermediate_size", 4 * hidden), kv_heads * head_dim,
                      text.vocab_size, largest, heads, split, kv_heads, trainable,
                      expert_param_count(model, hf_config), num_experts(hf_config) or 0,
                      moe_mlp_width(model, hf_config), heads * head_dim, qk_norm,
                      tiled_mlp_layers(model, hidden, text.num_hidden_layers))


def tiled_mlp_layers(model, hidden: int, n_layers: int) -> int:
    """The decoder layers whose MLP the tiled MLP tiles: the modules model/tiled_mlp.py's `tiled_mlps` takes (named
    `mlp`, their class's name ending in MLP, no dropout) that read the text model's hidden states (a vision tower's
    MLPs are of another width), but for a mixture of experts' block so named, whose tiles the start-up probe
    refuses. Module names and class names only: tests/test_models_matrix.py keeps the rule equal to what a run
    tiles (tiled_mlps where the probe keeps it), on the full-size configs of bench/configs/."""
    import torch

    n = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "mlp" or not type(module).__name__.endswith("MLP"):
            continue
        if any(type(m).__name__.startswith("Dropout") and m.p for m in module.modules()):
            continue
        if any(n.rsplit(".", 1)[-1] == "experts" for n, _ in module.named_modules()):  # an MoE block named ...MLP
            continue  # (GPT-OSS's): its forward returns the router's scores too, and the probe refuses its tiles
        first = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        n += first is not None and first.in_features == hidden
    return min(n, n_layers)


@dataclass(frozen=True)
class Activations:
    saved: float  # what autograd keeps from forward until backward
    transient: float  # on top, at the worst moment: the logits' copies, a recomputed layer

    @property
    def peak(self) -> float:
        return self.saved + self.transient


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, dtype: str,
                     checkpointing: bool, tile_tokens: int = 0, mlp_tile_positions: int = 0,
                     tensor: int = 1, fused_loss: bool = False, fused_kernels: bool = False) -> Activations:
    """Activation memory of one micro-batch for a Llama-style decoder with SDPA attention (no
    s x s score matrix is stored) and ds_train's fp32 loss over the logits.

    Per layer and token autograd keeps about 8h + 3kv + 4f values: the block input, the RMSNorm
    inputs and outputs, the residual, Q/K/V (h + 2kv) and rotated Q/K (h + kv), the attention output,
    and the MLP's gate, up, SiLU(gate) and product (4f); in mixed precision the two RMSNorms keep
    fp32 copies of their input too. With activation checkpointing only each layer's input (and the
    rotary tables) is kept, and one layer's full set exists again while it is recomputed. The loss
    keeps an fp32 log-softmax over the vocabulary, the final norm and lm_head their inputs; the logits
and their fp32 copy are transient. The fused loss in tiles (train.fused_loss) keeps the gradient of
    lm_head's input in its place, and the head's weight gradient (vocab x hidden values) from the
    loss's forward to the head's backward.
    Under AutoTP (`tensor` ranks) what the column-split projections produce is split too: Q and
    rotated Q, the attention output, K/V and the MLP's 4f (3h + 3kv + 4f of the 8h + 3kv + 4f); the
    block input, the norms and the residual, and the gathered logits, stay whole.
    Checked against the tensors autograd actually saves in tests/test_memory.py (on a tensor rank of
    an AutoTP engine too, in tests/memory_probe.py).
    Under Ulysses (parallel.sequence) the caller passes a rank's seq_len / sequence positions: every
    term divides (recipes/long_context.yaml at 8,192 tokens: autograd saved 749.3 MiB at
    sequence 1 and 374.5 MiB on each rank at 2). Not counted: the all-to-all's copies of one layer's
    Q/K/V and attention output while they are in flight, 2% of the peak at 16,384 tokens there. On
    the CPU, glibc's malloc may keep freed activations resident (bench/long_context.py's doc).
    """
    p = param_bytes(dtype)
    tokens = micro_batch * seq_len
    # The MLP in tiles (train.mlp_tile_positions): it keeps only its input (already counted as the
    # norm's output); one tile's 4f values exist while it is recomputed (counted as the untiled MLP's
    # are), beside the gradient of its whole input.
    # Only the layers whose MLP it tiles (shape.tiled_mlp_layers: an MoE block stays whole, and so does every MLP of
    # a model whose MLPs it does not take), each a dense MLP of 4 x intermediate values a token.
    mlp_tiled = bool(mlp_tile_positions) and seq_len > mlp_tile_positions
    # Fused kernels (model.compile, model.liger_kernels) keep only the MLP's gate and up (SiLU and the
    # product recomputed in the backward) and no fp32 copy of an RMSNorm's input.
    width = shape.mlp_width or 4 * shape.intermediate  # a mixture of experts': its k experts, router and shared one
    tiled_width = width if shape.tiled_mlp_layers is None else \
        min(width, 4 * shape.intermediate * min(shape.tiled_mlp_layers, shape.n_layers) / max(shape.n_layers, 1))
    kept = width - tiled_width if mlp_tiled else width  # averaged over the layers, as width is
    mlp_tiled = mlp_tiled and tiled_width > 0
    mlp = (kept / 2 if fused_kernels else kept) / tensor
    norm_fp32 = 2 * shape.hidden * (4 - p) if p < 4 and not fused_kernels else 0
    tile_width = width if shape.tiled_mlp_layers is None else 4 * shape.intermediate  # one tiled layer's
    mlp_transient = (micro_batch * mlp_tile_positions * tile_width / tensor + tokens * shape.hidden) * p if mlp_tiled \
        else 0
    q, kv = shape.q_hidden or shape.hidden, shape.kv_hidden
    split = (3 * q + 3 * kv + (2 * (q + kv) if shape.qk_norm else 0)) / tensor  # Qwen3's Q/K norms: input, output
    if shape.qk_norm and p < 4 and not fused_kernels:
        norm_fp32 += (q + kv) * (4 - p) / tensor
    layer_full = tokens * (p * (5 * shape.hidden + split + mlp) + norm_fp32)
    # The loss in tiles (train.loss_tile_tokens): only a tile's logits and log-softmax, recomputed
    # in the backward, ever exist.
    loss_tokens = min(tokens, tile_tokens) if tile_tokens and tokens > tile_tokens else tokens
    log_softmax = (0 if loss_tokens < tokens else tokens) * shape.vocab * 4
    # The fused loss's gradient of the head's weight: made in the forward, freed by the head's backward
    # (the backward's first step). With checkpointing the peak comes later, in a layer's recomputation.
    fused = shape.vocab * shape.hidden * p / tensor if fused_loss and loss_tokens < tokens else 0
    head = tokens * (3 * shape.hidden * p + (4 * shape.hidden if p < 4 else 0))  # final norm, lm_head input
    logits_transient = loss_tokens * shape.vocab * (p + (4 if p < 4 else 0)) + (
        loss_tokens * shape.vocab * 4 if loss_tokens < tokens else 0)  # a tile's log-softmax, while it lives
    if checkpointing:
        layer_inputs = shape.n_layers * tokens * p * shape.hidden
        return Activations(layer_inputs + head + log_softmax,
                           max(layer_full + mlp_transient + logits_transient, fused + logits_transient))
    return Activations(shape.n_layers * layer_full + head + log_softmax + fused, max(logits_transient, mlp_transient))


def buffer_bytes(zero: dict, stage: int, dtype: str, shape: ModelShape) -> float:
    """DeepSpeed's communication buffers from the ds_config's bucket sizes (in elements)."""
    p = param_bytes(dtype)
    if stage == 0:
        return 0.0
    copies = 2 if zero.get("overlap_comm") else 1  # double-buffered when communication overlaps
    if stage in (1, 2):  # contiguous gradient buckets: fp32 accumulators in ZeRO-1, p bytes in ZeRO-2
        if not zero.get("contiguous_gradients", True):
            return 0.0
        return float(zero.get("reduce_bucket_size", 5e8)) * copies * (4 if stage == 1 else p)
    reduce = float(zero.get("reduce_bucket_size", 5e8)) * p * copies
    prefetch = float(zero.get("stage3_prefetch_bucket_size", 5e7)) * p
    return reduce + prefetch + shape.largest_layer_params * p  # the gathered layer in use


@dataclass(frozen=True)
class Estimate:
    stage: int
    states: ModelStates
    activations: Activations
    buffers: float

    @property
    def gpu_peak(self) -> float:
        """The worse of the two moments: the backward (activations at their peak) and the optimizer
        step (activations freed, the fp32 gradient partition made)."""
        s = self.states
        return s.held + s.accumulation + self.buffers + max(self.activations.peak, s.step_transient)

    @property
    def cpu(self) -> float:
        return self.states.cpu


def estimate(shape: ModelShape, stage: int, dtype: str, world: int, micro_batch: int, seq_len: int,
             checkpointing: bool, zero: dict, tile_tokens: int = 0, mlp_tile_positions: int = 0,
             tensor: int = 1, fused_loss: bool = False, fused_kernels: bool = False, expert: int = 1) -> Estimate:
    """One rank's memory: `world` the ranks ZeRO partitions over, `tensor` the AutoTP size (each
    rank's model states are its share, ZeRO-partitioned over `world`), `expert` the AutoEP size."""
    offload_opt = zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme")
    offload_par = zero.get("offload_param", {}).get("device") in ("cpu", "nvme")
    return Estimate(stage, model_states(shape.rank_params(tensor), stage, dtype, world, offload_opt, offload_par,
                                        shape.trainable or None, shape.experts, expert),
                    activation_bytes(shape, micro_batch, seq_len, dtype, checkpointing, tile_tokens,
                                     mlp_tile_positions, tensor, fused_loss, fused_kernels),
                    buffer_bytes(zero, stage, dtype, shape))


@dataclass(frozen=True)
class ScoringMemory:
    """Rank 0's memory for one lm-eval scoring inside a run (ds_train/train/benchmarks.py), beside what training
    holds: `host` bytes at its peak (the walked weights kept whole, in the run's dtype, and the model transformers
    builds from them while it loads: 2x the model), `device` bytes on rank 0's GPU (the scored model moved there
    beside the rank's ZeRO shards: 1x; 0 off GPUs, where the host's copy is scored)."""

    host: float
    device: float


def scoring_bytes(n_params: int, dtype: str, on_gpu: bool) -> ScoringMemory:
    model = float(n_params) * param_bytes(dtype)
    return ScoringMemory(2 * model, model if on_gpu else 0.0)


def scoring_refusal(need: ScoringMemory, host_available: float | None, device_free: float | None) -> str | None:
    """Why rank 0's scoring cannot fit (None: it fits, or the free memory is unknown): what it needs against what
    rank 0's host and device have free, in GiB."""
    short = []
    if host_available is not None and need.host > host_available:
        short.append(f"{need.host / GiB:.2f} GiB of host memory (2x the model) with {host_available / GiB:.2f} GiB "
                     f"available")
    if device_free is not None and need.device > device_free:
        short.append(f"{need.device / GiB:.2f} GiB on its GPU (a whole copy beside its shards) with "
                     f"{device_free / GiB:.2f} GiB free")
    return " and ".join(short) or None
