"""REPA's frozen encoders: torch-fidelity feature extractors with a ``patch_tokens`` feature, (N, T, D) from uint8
images, the mechanism evaluation extractors use. DINOv2 (``dinov2-vit-s/b/l/g``, and ``-reg`` with registers) is
built by timm from weights on disk and gets REPA's input exactly: uint8 -> [0, 1] -> ImageNet normalisation ->
bicubic resize (no antialiasing) to the encoder's resolution, with the position embedding resampled once at load time
from the weights' grid to that resolution's, by timm's antialiased bicubic resampling as REPA does. Other encoders
subclass :class:`PatchTokenEncoder` and register themselves with :func:`register_encoder`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from moh_dit.errors import ConfigError

__all__ = ["DINOV2", "PATCH_TOKENS", "PatchTokenEncoder", "register_encoder", "register_dinov2", "repa_input"]

# moh-dit's names of DINOv2 (Oquab et al. 2024) -> timm's architectures; the weights are DINOv2's own (torch hub's
# dinov2_vit*14[_reg4]_pretrain.pth) or timm's, read from disk
DINOV2 = {
    "dinov2-vit-s": "vit_small_patch14_dinov2",
    "dinov2-vit-b": "vit_base_patch14_dinov2",
    "dinov2-vit-l": "vit_large_patch14_dinov2",
    "dinov2-vit-g": "vit_giant_patch14_dinov2",
    "dinov2-vit-s-reg": "vit_small_patch14_reg4_dinov2",
    "dinov2-vit-b-reg": "vit_base_patch14_reg4_dinov2",
    "dinov2-vit-l-reg": "vit_large_patch14_reg4_dinov2",
    "dinov2-vit-g-reg": "vit_giant_patch14_reg4_dinov2",
}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PATCH_TOKENS = "patch_tokens"


def repa_input(images: torch.Tensor, resolution: int) -> torch.Tensor:
    """REPA's encoder input from uint8 (N, C, H, W) images (C = 1 is repeated): [0, 1], ImageNet mean and std,
    then bicubic resizing (without antialiasing, as REPA's) to ``resolution``; float32 (N, 3, R, R)."""
    x = images.float() / 255.0
    if x.shape[1] == 1:
        x = x.repeat(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).reshape(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).reshape(1, 3, 1, 1)
    x = (x - mean) / std
    return F.interpolate(x, size=(resolution, resolution), mode="bicubic", align_corners=False)


def _read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from safetensors or a plain-tensor torch file (``{"model": ...}`` / ``{"state_dict": ...}``
    unwrapped), read safely."""
    from moh_dit.files import read_safetensors, read_torch_file

    path = Path(path)
    if path.suffix == ".safetensors":
        return read_safetensors(path, "cpu")
    state = read_torch_file(path, ConfigError, "plain tensor state dict")
    for key in ("model", "state_dict", "teacher"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    return state


def load_dinov2(name: str, weights: str | Path, resolution: int) -> torch.nn.Module:
    """A DINOv2 encoder as REPA loads it: the architecture (timm), the weights from ``weights`` (DINOv2's own
    format or timm's), then the position embedding resampled to ``resolution``'s grid and the input size set."""
    try:
        import timm
        from timm.layers import resample_abs_pos_embed
        from timm.models.vision_transformer import checkpoint_filter_fn
    except ImportError:
        raise ConfigError(f"repa.encoder {name} needs timm: pip install 'moh-dit[repa]'") from None
    model = timm.create_model(DINOV2[name], pretrained=False, num_classes=0, dynamic_img_size=False)
    state = checkpoint_filter_fn(_read_weights(weights), model)  # DINOv2's hub layout -> timm's
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{weights} does not hold {name}'s weights: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    patch = model.patch_embed.patch_size[0]
    if resolution % patch:
        raise ConfigError(f"repa.encoder_resolution={resolution} is not a multiple of {name}'s patch {patch}")
    grid = resolution // patch
    old = model.patch_embed.grid_size[0]
    prefix = model.pos_embed.shape[1] - old * old  # the class token's position (registers have none)
    with torch.no_grad():  # REPA resamples once at load time, bypassing the model's own interpolation at run time
        pos = resample_abs_pos_embed(model.pos_embed, [grid, grid], old_size=[old, old], num_prefix_tokens=prefix)
    model.pos_embed = torch.nn.Parameter(pos, requires_grad=False)
    model.patch_embed.img_size = (resolution, resolution)
    model.patch_embed.grid_size = (grid, grid)
    model.patch_embed.num_patches = grid * grid
    return model.eval().requires_grad_(False)


class PatchTokenEncoder(FeatureExtractorBase):
    """A torch-fidelity feature extractor whose one feature is ``patch_tokens``: ``forward`` maps uint8 (N, C, H, W)
    images to a one-tuple of (N, T, D) tokens. Subclasses set ``dummy_input`` (a uint8 input torch-fidelity may
    probe) and write ``__init__`` and ``forward``; torch-fidelity's other questions have one answer for them all."""

    dummy_input: tuple[int, int, int] = (3, 224, 224)

    @staticmethod
    def get_provided_features_list() -> tuple[str]:
        return (PATCH_TOKENS,)

    @staticmethod
    def get_default_feature_layer_for_metric(metric: str) -> str:
        return PATCH_TOKENS

    @staticmethod
    def can_be_compiled() -> bool:
        return False

    @classmethod
    def get_dummy_input_for_compile(cls) -> torch.Tensor:
        return torch.zeros(1, *cls.dummy_input, dtype=torch.uint8)


def register_encoder(name: str, cls: type[PatchTokenEncoder]) -> str:
    """Register ``cls`` with torch-fidelity as ``name`` (once, so modules may be imported again); returns ``name``."""
    if name not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(name, cls)
    return name


class DINOv2Tokens(PatchTokenEncoder):
    """DINOv2's final-norm patch tokens (no class or register tokens) of REPA's input."""

    def __init__(self, name, features_list, feature_extractor_weights_path=None, resolution=224, **kwargs):
        super().__init__(name, features_list)
        if feature_extractor_weights_path is None:
            raise ConfigError(f"repa.encoder {name} needs repa.encoder_weights: nothing is downloaded here")
        self.resolution = resolution
        self.net = load_dinov2(name, feature_extractor_weights_path, resolution)

    def forward(self, x):
        tokens = self.net.forward_features(repa_input(x, self.resolution))
        return (tokens[:, self.net.num_prefix_tokens :],)


def register_dinov2() -> None:
    """Register the DINOv2 encoders with torch-fidelity (once)."""
    for name in DINOV2:
        register_encoder(name, DINOv2Tokens)
