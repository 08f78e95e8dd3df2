"""Checkpoint surgery: a model's weights in another architecture that keeps them (another class count, REPA's
alignment heads added or left out). Each returns a new model (or the same one when nothing changes) and never edits
the one it is given."""

from __future__ import annotations

import torch

from moh_dit.model.network import MoHDiT

__all__ = ["with_num_classes", "with_alignment", "without_alignment", "first_output_channels"]


def with_num_classes(model: MoHDiT, num_classes: int, mode: str = "resize", seed: int = 0) -> tuple[MoHDiT, dict]:
    """A copy of ``model`` for ``num_classes`` classes (0: unconditional), for fine-tuning on data with
    another class count. Every weight but the label table is kept. ``resize`` keeps the rows of the
    classes both have (ids below the smaller count) and the null-class row; ``reinit`` starts a new table.
    New rows are drawn as DiT initialises the table, N(0, 0.02). Returns the model and a report of what
    was kept and what is new."""
    if mode not in ("resize", "reinit"):
        raise ValueError(f"mode must be 'resize' or 'reinit', got {mode!r}")
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    torch.manual_seed(seed)
    target = type(model)(**dict(config, num_classes=num_classes)).to(model.pos_embed.device)
    source = model.state_dict()
    table = "y_embedder.embedding_table.weight"
    kept = {k: v for k, v in source.items() if k != table}
    missing = target.load_state_dict(kept, strict=False).missing_keys
    report = {"kept": sorted(kept), "new": sorted(missing), "classes": [model.config.num_classes, num_classes]}
    if mode == "resize" and table in source and target.y_embedder is not None:
        old, new = source[table], target.y_embedder.embedding_table.weight
        shared = min(model.config.num_classes, num_classes)
        with torch.no_grad():
            new[:shared] = old[:shared]
            if model.null_class_id is not None and target.null_class_id is not None:
                new[target.null_class_id] = old[model.null_class_id]
        report["label_rows_kept"] = list(range(shared)) + (["null"] if model.null_class_id is not None else [])
    return target, report


def with_alignment(model: MoHDiT, depth: int, dims: list[int], projector_dim: int = 2048) -> MoHDiT:
    """``model`` with REPA's alignment heads after block ``depth`` (from 1), one per encoder width in ``dims``:
    ``model`` ``model`` itself when it has these heads already (a run continued from a REPA checkpoint), else a copy of its weights
    with new heads (initialised as DiT initialises linears)."""
    wanted = dict(repa_depth=depth, repa_dims=list(dims), repa_projector_dim=projector_dim)
    if all(model.config.get(k) == v for k, v in wanted.items()):
        return model
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    aligned = type(model)(**dict(config, **wanted))
    kept = {k: v for k, v in model.state_dict().items() if not k.startswith("projectors.")}
    missing = aligned.load_state_dict(kept, strict=False).missing_keys
    if any(not k.startswith("projectors.") for k in missing):
        raise ValueError(f"with_alignment lost weights: {missing[:4]}")
    return aligned.to(model.pos_embed.device).train(model.training)


def without_alignment(model: MoHDiT) -> MoHDiT:
    """``model`` without REPA's alignment heads (what sampling and exported pipelines use), its weights copied;
    ``model`` ``model`` itself when it has none."""
    if model.projectors is None:
        return model
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    bare = type(model)(**dict(config, repa_depth=None, repa_dims=None, repa_projector_dim=2048))
    kept = {k: v for k, v in model.state_dict().items() if not k.startswith("projectors.")}
    bare.load_state_dict(kept)
    return bare.to(model.pos_embed.device).train(model.training)


def first_output_channels(state: dict[str, torch.Tensor], linear: torch.nn.Linear, channels: int) -> dict:
    """The output layer ``final_layer.linear`` of ``state`` (``channels`` output channels per pixel) cut to the first
    channels that ``linear`` (the new layer) has room for: a learned-sigma DiT's noise prediction without its variance.
    Its rows are ordered (patch row, patch column, channel), the channel fastest (:meth:`MoHDiT.unpatchify`). Empty
    when ``state`` has no such layer or it already fits."""
    weight, bias = state.get("final_layer.linear.weight"), state.get("final_layer.linear.bias")
    if weight is None or weight.shape == linear.weight.shape or weight.shape[1] != linear.in_features:
        return {}
    pixels = weight.shape[0] // channels
    kept = linear.out_features // pixels
    if pixels * channels != weight.shape[0] or pixels * kept != linear.out_features or not 0 < kept < channels:
        return {}
    rows = (torch.arange(weight.shape[0]) % channels) < kept
    cut = {"final_layer.linear.weight": weight[rows]}
    return cut | ({"final_layer.linear.bias": bias[rows]} if bias is not None else {})
