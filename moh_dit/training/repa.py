"""REPA, representation alignment (Yu et al., ICLR 2025, arXiv:2410.06940): while the network learns its objective,
the tokens after one early block are projected (``moh_dit.model.alignment``) toward a frozen vision encoder's patch
features of the same (clean) images, by maximising their cosine similarity:

    loss_repa = - mean over encoders, images and tokens of cos(normalize(encoder features), normalize(projection))

added to the objective's loss with weight ``repa.coeff`` (REPA's 0.5). It works the same for either objective and
beside MoH's load-balance loss.

The encoders (``moh_dit.training.encoders``) are torch-fidelity feature extractors with a ``patch_tokens`` feature:
DINOv2 at ``224 * (image_size // 256)`` (or ``repa.encoder_resolution``), or any a user module registers
(``repa.encoder_module``). The encoder's token grid must match the model's one to one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moh_dit.errors import ConfigError
from moh_dit.training.frozen import FrozenModel

__all__ = ["Alignment", "alignment_loss"]


def alignment_loss(projected: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """REPA's loss: minus the cosine similarity of each projected token and the encoder's token at the same place,
    averaged over tokens, images and encoders; normalised in float32 (in float16 REPA's turned NaN, REPA#46)."""
    total = 0.0
    for z_hat, z in zip(projected, targets):
        if z_hat.shape != z.shape:
            raise ValueError(
                f"a projection {tuple(z_hat.shape)} does not match its encoder's features {tuple(z.shape)}"
            )
        cos = (F.normalize(z.float(), dim=-1) * F.normalize(z_hat.float(), dim=-1)).sum(dim=-1)  # (N, T)
        total = total - cos.mean()
    return total / len(targets)


class Alignment(FrozenModel):
    """A run's frozen encoders (a model beside the student, role ``repa_encoder``): ``features`` of the clean images,
    which REPA's loss compares with the model's projections. Made before the model's projectors, which take the
    encoders' widths (``dims``)."""

    role = "repa_encoder"

    def __init__(
        self,
        encoders: Sequence[str],
        weights: Sequence[str],
        module: str | None,
        resolution: int,
        tokens: int,
        image_size: int,
        device: torch.device | str,
    ) -> None:
        from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
        from torch_fidelity.utils import create_feature_extractor

        from moh_dit.evaluation.features import check_plain_tensor_file, import_extractor_module
        from moh_dit.training.encoders import DINOV2, PATCH_TOKENS, register_dinov2

        register_dinov2()
        import_extractor_module(module, "repa.encoder_module")
        side = round(tokens**0.5)
        if resolution <= 0 and any(name in DINOV2 for name in encoders):
            raise ConfigError(
                f"repa.encoder_resolution: REPA's 224 * (image_size // 256) is 0 for {image_size} px images; set it to "
                f"the encoder's patch times the model's {side} tokens per side (DINOv2: {14 * side})"
            )
        if weights and len(weights) != len(encoders):
            raise ConfigError(f"repa.encoder_weights gives {len(weights)} files for {len(encoders)} encoders")
        self.device, self.nets, self.dims, self.names = torch.device(device), [], [], list(encoders)
        self.weights, self.resolution = list(weights), resolution
        for i, name in enumerate(encoders):
            if name not in FEATURE_EXTRACTORS_REGISTRY:
                raise ConfigError(
                    f"repa.encoder {name!r} is not known: DINOv2 ({', '.join(DINOV2)}) or an encoder registered by "
                    f"repa.encoder_module (a torch-fidelity feature extractor with a {PATCH_TOKENS} feature)"
                )
            kwargs = {"resolution": resolution} if resolution > 0 else {}  # other encoders choose their own size
            if weights:
                check_plain_tensor_file(weights[i], f"repa.encoder_weights of {name}")  # before any loader sees it
                kwargs["feature_extractor_weights_path"] = str(weights[i])
            net = create_feature_extractor(name, [PATCH_TOKENS], cuda=False, verbose=False, **kwargs)
            net = net.to(self.device).eval().requires_grad_(False)
            with torch.no_grad():
                probe = net(torch.zeros(1, 3, image_size, image_size, dtype=torch.uint8, device=self.device))[0]
            if probe.ndim != 3 or probe.shape[1] != tokens:
                grid = round(probe.shape[1] ** 0.5) if probe.ndim == 3 else "?"
                raise ConfigError(
                    f"repa.encoder {name} gives {probe.shape[1] if probe.ndim == 3 else tuple(probe.shape)} tokens "
                    f"({grid} x {grid}) at its input resolution {resolution}, the model {tokens} ({side} x {side}): "
                    f"the grids must match one to one; set repa.encoder_resolution to the encoder's patch times {side} "
                    f"(DINOv2: {14 * side})"
                )
            self.nets.append(net)
            self.dims.append(int(probe.shape[-1]))

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Each encoder's patch tokens (N, T, D_j) of uint8 images (N, C, H, W)."""
        images = images.to(self.device)
        return [net(images)[0].float() for net in self.nets]

    def describe(self) -> str:
        return ", ".join(f"{name} ({dim}-d)" for name, dim in zip(self.names, self.dims))

    def modules(self) -> list[torch.nn.Module]:
        return list(self.nets)

    def identity(self) -> dict:
        """The encoders by name, their weights' fingerprint and input resolution."""
        from moh_dit.manifests import fingerprint_tensors

        tensors = [(f"{i}.{k}", v) for i, net in enumerate(self.nets) for k, v in net.state_dict().items()]
        return {"name": "+".join(self.names), "sha256": fingerprint_tensors(tensors), "resolution": self.resolution}
