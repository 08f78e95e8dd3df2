"""Any checkpoint a user has (official ``.pt``, diffusers folder, moh-dit folder) as a moh-dit model."""

from __future__ import annotations

import json
from pathlib import Path

from moh_dit.interop.diffusers_dit import from_diffusers
from moh_dit.interop.official import load_reference_checkpoint
from moh_dit.interop.sit import FLOW_FORMATS, load_flow_checkpoint
from moh_dit.model.network import MoHDiT


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def load_any(
    src: str | Path, fmt: str = "dit", flow_path: str = "linear", repa_depth: int | None = None, **hints
) -> tuple[MoHDiT, object | None, dict, dict]:
    """(model, vae, id2label, report) from a checkpoint file (``fmt``: ``dit`` for DiT / MoH-DiT reference
    checkpoints, ``sit`` or ``repa`` for flow models on ``flow_path``), a diffusers DiT pipeline or transformer
    folder, or one of our run / checkpoint / pipeline / transformer folders."""
    src = Path(src)
    if src.is_file() and fmt in FLOW_FORMATS:
        flow = {k: hints[k] for k in ("num_heads", "num_classes", "prefer_ema", "sample_size") if k in hints}
        model, report = load_flow_checkpoint(src, fmt, flow_path, **flow, repa_depth=repa_depth)
        return model, None, {}, report
    hints.pop("sample_size", None)
    if src.is_file():
        model, report = load_reference_checkpoint(src, **hints)
        return model, None, {}, report
    index = src / "model_index.json"
    if index.is_file() and json.loads(index.read_text()).get("_class_name") == "DiTPipeline":
        from diffusers import AutoencoderKL, DiTTransformer2DModel

        meta = json.loads(index.read_text())
        model = from_diffusers(DiTTransformer2DModel.from_pretrained(src, subfolder="transformer"))
        vae = AutoencoderKL.from_pretrained(src, subfolder="vae") if (src / "vae").is_dir() else None
        id2label = {int(k): v for k, v in (meta.get("id2label") or {}).items()}
        return model, vae, id2label, {"source": str(src), "format": "diffusers DiTPipeline"}
    cfg_file = src / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()).get("_class_name") == "DiTTransformer2DModel":
        from diffusers import DiTTransformer2DModel

        return (
            from_diffusers(DiTTransformer2DModel.from_pretrained(src)),
            None,
            {},
            {"source": str(src), "format": "diffusers"},
        )
    from moh_dit.sampling.loading import load_pipeline

    pipe = load_pipeline(src, device="cpu")
    return (
        pipe.transformer,
        pipe.vae,
        pipe.id2label,
        {"source": str(src), "format": "moh-dit", "provenance": pipe.provenance},
    )
