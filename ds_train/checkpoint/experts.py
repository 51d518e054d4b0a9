"""An expert-parallel (DeepSpeed AutoEP) checkpoint's weights in the model's own Hugging Face layout.

AutoEP replaces each mixture-of-experts block with its own layer: the router becomes `router.gate`
(aliased under the model's router name), the experts three grouped tensors `experts.w1/w2/w3`
(gate, down and up projections, [experts, out, in]). DeepSpeed's universal conversion gathers each
rank's share into the whole tensors; `hf_layout` puts them back where the model keeps them, as the
inverse of DeepSpeed's own repacking (deepspeed.moe.ep_repack), layer by layer from the specs AutoEP's
parser reads off the model (the same ones the run's engine was built from).
"""

from __future__ import annotations

from ds_train.errors import UserError


def autoep_specs(model, hf_config) -> list:
    """AutoEP's MoE layer specs of `model` (built on the meta device: shapes are all it reads)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    from ds_train.model.workarounds import output_capture_registry_takes_keys

    config = parse_autoep_config({"enabled": True, "autoep_size": 1})
    with output_capture_registry_takes_keys():
        return AutoEP(model, config).ep_parser()


def hf_layout(state: dict, specs: list, shapes: dict) -> dict:
    """`state` (a universal checkpoint's whole weights, AutoEP's names) with every MoE layer's router
    and experts under the model's own names and layout (`shapes`: the model's tensors' shapes, by name),
    every other tensor as it is."""
    import torch

    out = dict(state)
    for spec in specs:
        layer, router = spec.moe_module_name, spec.router_name
        grouped = [out.pop(f"{layer}.experts.{w}", None) for w in ("w1", "w2", "w3")]
        if any(w is None for w in grouped):
            raise UserError(f"export: the checkpoint has no AutoEP experts for {layer} (experts.w1/w2/w3); it was "
                            f"not trained with this model's AutoEP layout")
        w1, w2, w3 = grouped
        experts = f"{layer}.{spec.experts_name}"
        if spec.expert_storage == "module_list":
            for e in range(w1.shape[0]):
                out[f"{experts}.{e}.{spec.expert_w1_name}.weight"] = w1[e]
                out[f"{experts}.{e}.{spec.expert_w2_name}.weight"] = w2[e]
                if spec.expert_w3_name is not None:
                    out[f"{experts}.{e}.{spec.expert_w3_name}.weight"] = w3[e]
        elif spec.expert_w3_name is not None:
            out[f"{experts}.{spec.expert_w1_name}"], out[f"{experts}.{spec.expert_w2_name}"] = w1, w2
            out[f"{experts}.{spec.expert_w3_name}"] = w3
        else:  # gate and up fused, as the model has them: [E, 2F, H] (gate first), or [E, H, 2F]
            gate, down = f"{experts}.{spec.expert_w1_name}", f"{experts}.{spec.expert_w2_name}"
            layout = fused_layout(shapes, gate, down)
            gate_up = torch.cat([w1, w3], dim=1)
            if layout.needs_transpose:  # Transformers' other fused layout
                gate_up, w2 = gate_up.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
            out[gate], out[down] = gate_up, w2
        for key in [k for k in out if k.startswith(f"{layer}.router.")]:
            rest = key[len(f"{layer}.router."):]
            out.pop(f"{layer}.{router}.{rest}", None)  # AutoEP's alias of the router under the model's name
            out[f"{layer}.{router}.{rest.removeprefix('gate.')}"] = out.pop(key)
    return out


def fused_layout(shapes: dict, gate: str, down: str):
    """Which of the two fused gate/up layouts the model keeps, from both tensors' shapes, by DeepSpeed's own
    classifier (the one AutoEP repacked them with): one tensor alone is ambiguous when the hidden size is
    twice the expert width."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    layout = None
    if gate in shapes and down in shapes:
        layout = classify_fused_gate_up_layout(tuple(shapes[gate]), tuple(shapes[down]))
    if layout is None:
        raise UserError(f"export: {gate} {tuple(shapes.get(gate, ()))} and {down} {tuple(shapes.get(down, ()))} "
                        f"are neither fused gate/up layout AutoEP knows; this model's experts cannot be put back")
    return layout


def autoep_module_state_dict(tag_dir) -> dict:
    """The whole fp32 weights of a ZeRO-0 AutoEP checkpoint (no optimizer partitions, so no universal
    conversion): the module's tensors, and each MoE layer's experts stacked from the per-expert files
    DeepSpeed writes (layer_<L>_expert_<e>_mp_rank_00_model_states.pt, as its AutoEP layer list names them)."""
    import torch
    from deepspeed.checkpoint.constants import AUTOEP_LAYERS_KEY

    path = tag_dir / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise UserError(f"export: {str(path)!r} not found; {str(tag_dir)!r} is not a DeepSpeed checkpoint")
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    out = {k: v.float() if v.is_floating_point() else v for k, v in saved["module"].items()}
    for layer in saved.get(AUTOEP_LAYERS_KEY) or []:
        prefix, grouped = layer["expert_key_prefix"], {"w1": [], "w2": [], "w3": []}
        for e in range(layer["num_experts"]):
            part = tag_dir / f"layer_{layer['moe_layer_id']}_expert_{e}_mp_rank_00_model_states.pt"
            if not part.is_file():
                raise UserError(f"export: {str(part)!r} not found: the checkpoint lacks expert {e} of {prefix}")
            tensors = torch.load(part, map_location="cpu", weights_only=False)
            for w in grouped:
                grouped[w].append(tensors[f"{prefix}.{w}.{e}"].float())
        out.update({f"{prefix}.{w}": torch.stack(parts) for w, parts in grouped.items()})
    return out
