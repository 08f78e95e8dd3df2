"""MoH-DiT: a class-conditional Diffusion Transformer (adaLN-Zero) with Mixture-of-Head attention.

The network is DiT (Peebles & Xie, 2023) with every attention layer replaced by :class:`MoHAttention`.
With ``attention_type="mha"`` it is exactly DiT, which is how the DiT presets are built. Every
architecture argument, including the per-layer head tables, lives in the diffusers config, so
``save_pretrained`` / ``from_pretrained`` round-trip a model with nothing else stated.

Shapes: N batch, C channels, H x W image (or latent), p patch size, T = H*W/p**2 tokens, D width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from torch import nn

from moh_dit.model.alignment import AlignmentProjector
from moh_dit.model.attention import MoHAttention
from moh_dit.model.block import BlockOptions, DiTBlock, FinalLayer
from moh_dit.model.embeddings import LabelEmbedder, PatchEmbedder, TimestepEmbedder, sincos_pos_embed_2d
from moh_dit.model.head_usage import recording_head_usage

__all__ = ["MoHDiT", "MoHDiTOutput", "DiTBlock", "FinalLayer"]  # the blocks live in model/block.py

IntOrList = int | Sequence[int]


def _per_layer(name: str, value: IntOrList | None, depth: int) -> list[int | None]:
    """Expand an int (or None) to one value per layer; check a list has exactly ``depth`` entries."""
    if value is None or isinstance(value, int):
        return [value] * depth
    values = list(value)
    if len(values) != depth:
        raise ValueError(f"{name} has {len(values)} entries but depth is {depth}: give one value per layer")
    if not all(isinstance(v, int) for v in values):
        raise ValueError(f"{name} must contain integers, got {values}")
    return values


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------
@dataclass
class MoHDiTOutput(BaseOutput):
    """Output of :class:`MoHDiT`.

    Attributes:
        sample: (N, out_channels, H, W) prediction; with learned sigma the first ``in_channels`` channels
            are the noise prediction and the rest the variance interpolation values.
        aux_loss: scalar MoH load-balance loss, the mean over layers with routed heads (training mode
            only); zero when there are none. Not yet multiplied by the loss coefficient.
        head_masks: when requested, one (N, T, h_l) boolean tensor per layer: the heads each token used.
        aligned: in a model with REPA's alignment heads, when training or asked: one (N, T, Z_j) tensor per encoder,
            the projection of block ``repa_depth``'s output tokens.
    """

    sample: torch.Tensor = None
    aux_loss: torch.Tensor = None
    head_masks: tuple[torch.Tensor, ...] | None = None
    aligned: tuple[torch.Tensor, ...] | None = None


class MoHDiT(ModelMixin, ConfigMixin, CacheMixin):
    """Diffusion Transformer with Mixture-of-Head attention (DiT when ``attention_type="mha"``). ``CacheMixin`` takes
    diffusers' sampling caches (``enable_cache``; moh-dit applies them per batch composition:
    :mod:`moh_dit.sampling.caches`).

    Args:
        sample_size: input height and width (latent size for latent diffusion, e.g. 32 for 256 px).
        patch_size: patch size p.
        in_channels: input channels C.
        hidden_size: model width D.
        depth: number of blocks L.
        num_heads: heads per layer, an int or one per layer.
        head_dim: size of each head (int, all layers); defaults to ``hidden_size // num_heads``.
        num_shared_heads: always-on heads per layer (int or list); defaults to all heads (dense layers).
        top_k: routed heads each token uses, per layer (int or list); 0 for layers with no routed heads.
        attention_type: ``"moh"`` (Mixture-of-Head) or ``"mha"`` (plain multi-head attention, i.e. DiT).
        mlp_ratio: MLP hidden width over D.
        class_dropout_prob: probability of replacing a label by the null class in training (CFG).
        num_classes: number of classes; 0 for an unconditional model.
        learn_sigma: predict the variance too (``out_channels = 2 * in_channels``).
        qkv_bias: bias on the Q/K/V projection.
        norm_eps: LayerNorm epsilon.
        mlp_norm_eps: epsilon of the LayerNorm before the MLP, if different from ``norm_eps`` (diffusers'
            DiT port uses its configurable ``norm_eps`` there and 1e-6 elsewhere).
        timestep_freq_shift: frequency shift of the timestep sinusoid; 0 in DiT, 1 in diffusers' port.
        objective: the training objective the weights are for, as ``moh_dit.objectives`` records it (what the
            time input means, what the output predicts); ``None`` is DiT's DDPM, as every model of moh-dit 0.3. The
            network does not use it: samplers and the trainer read it, so the weights carry how to sample them.
        repa_depth: REPA's alignment (training only): the block, counted from 1, whose output tokens the
            projectors map to the encoders' feature spaces; ``None``: no alignment head.
        repa_dims: the feature width of each encoder aligned to (one projector each).
        repa_projector_dim: the projectors' hidden width (REPA's 2048).
        block: the block's options (:class:`~moh_dit.model.block.BlockOptions`: norm, MLP, QK-norm, 2-D RoPE), as
            its ``record()``; ``None`` is DiT's block, as every model of moh-dit 0.4 and earlier.
        time_inputs: how many times the network is conditioned on: 1 (a diffusion or flow time), or 2 (MeanFlow:
            the time and the interval ``t - r`` it averages over, each through its own timestep embedding, added).
    """

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: IntOrList = 16,
        head_dim: int | None = None,
        num_shared_heads: IntOrList | None = None,
        top_k: IntOrList = 0,
        attention_type: str = "moh",
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        qkv_bias: bool = True,
        norm_eps: float = 1e-6,
        mlp_norm_eps: float | None = None,
        timestep_freq_shift: float = 0.0,
        objective: dict | None = None,
        repa_depth: int | None = None,
        repa_dims: list[int] | None = None,
        repa_projector_dim: int = 2048,
        block: dict | None = None,
        time_inputs: int = 1,
    ) -> None:
        super().__init__()
        options = BlockOptions.from_config(block)
        if block is not None:  # recorded in full (DiT's block spelt out is None), so that equal blocks compare equal
            self.register_to_config(block=options.record())
        if (repa_depth is None) != (not repa_dims):
            raise ValueError("repa_depth and repa_dims go together: the block to align and the encoders' widths")
        if repa_depth is not None and not 1 <= repa_depth <= depth:
            raise ValueError(f"repa_depth counts blocks from 1 to {depth}, got {repa_depth}")
        if objective is not None and not (isinstance(objective, dict) and isinstance(objective.get("name"), str)):
            raise ValueError(f"objective must be None or a record such as {{'name': 'flow', ...}}, got {objective!r}")
        if attention_type not in ("moh", "mha"):
            raise ValueError(f"attention_type must be 'moh' or 'mha', got {attention_type!r}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if patch_size < 1 or sample_size % patch_size:
            raise ValueError(f"sample_size={sample_size} is not divisible by patch_size={patch_size}")
        if hidden_size % 4:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by 4 (2D sin-cos position embedding)")
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        if not 0.0 <= class_dropout_prob < 1.0:
            raise ValueError(f"class_dropout_prob must be in [0, 1), got {class_dropout_prob}")

        heads = _per_layer("num_heads", num_heads, depth)
        shared = _per_layer("num_shared_heads", num_shared_heads, depth)
        topks = _per_layer("top_k", top_k, depth)
        if attention_type == "mha" and (any(s is not None for s in shared) or any(k for k in topks)):
            raise ValueError("attention_type='mha' has no routing: leave num_shared_heads=None and top_k=0")

        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        grid = sample_size // patch_size
        self.num_tokens = grid * grid

        self.x_embedder = PatchEmbedder(patch_size, in_channels, hidden_size)
        if time_inputs not in (1, 2):
            raise ValueError(f"time_inputs must be 1 or 2 (MeanFlow's time and interval), got {time_inputs}")
        self.t_embedder = TimestepEmbedder(hidden_size, freq_shift=timestep_freq_shift)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob) if num_classes > 0 else None
        # A frozen parameter (not a buffer) as in DiT, so it is saved and counted like the reference.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, hidden_size), requires_grad=False)

        blocks = []
        for layer, (h, h_s, k) in enumerate(zip(heads, shared, topks)):
            try:
                attn = MoHAttention(
                    hidden_size,
                    h,
                    head_dim=head_dim,
                    num_shared_heads=h_s,
                    top_k=k or 0,
                    qkv_bias=qkv_bias,
                    attention_type=attention_type,
                    qk_norm=options.qk_norm_layer(),
                )
            except ValueError as err:
                raise ValueError(f"layer {layer}: {err}") from None
            blocks.append(
                DiTBlock(
                    hidden_size,
                    attn,
                    mlp_ratio=mlp_ratio,
                    norm_eps=norm_eps,
                    mlp_norm_eps=norm_eps if mlp_norm_eps is None else mlp_norm_eps,
                    options=options,
                )
            )
        self.blocks = nn.ModuleList(blocks)
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm_eps=norm_eps, options=options)
        # MeanFlow's second time input (the interval t - r) has its own embedding; created after the blocks, so that
        # the others' initialisation draws the numbers it always drew
        self.h_embedder = TimestepEmbedder(hidden_size, freq_shift=timestep_freq_shift) if time_inputs == 2 else None
        # 2-D RoPE's tables (persistent buffers, as LightningDiT keeps them), kept beside the sin-cos table
        self.feat_rope = options.rotary([b.attn.head_dim for b in blocks], grid)
        self.projectors = (  # REPA's alignment heads: only in models that train with it (created last: the others'
            # initialisation draws the same numbers as before they existed)
            nn.ModuleList(AlignmentProjector(hidden_size, repa_projector_dim, d) for d in repa_dims)
            if repa_dims
            else None
        )
        self.gradient_checkpointing = False
        self.initialize_weights()

    # ------------------------------------------------------------------------------------------------
    # Initialisation (DiT): xavier linears with zero bias, N(0, 0.02) embeddings, zeroed adaLN and output
    # ------------------------------------------------------------------------------------------------
    def initialize_weights(self) -> None:
        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)  # routers included: they start like any linear
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        grid = int(self.num_tokens**0.5)
        with torch.no_grad():
            pos = sincos_pos_embed_2d(self.config.hidden_size, grid)
            self.pos_embed.copy_(pos.float().unsqueeze(0).to(self.pos_embed.device))

        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as a linear map of the flattened patch
        nn.init.zeros_(self.x_embedder.proj.bias)

        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)

        for block in self.blocks:  # adaLN-Zero: every block starts as the identity
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)
        if self.h_embedder is not None:  # as the time embedding (MeanFlow's JAX DiT initialises both alike)
            nn.init.normal_(self.h_embedder.mlp[0].weight, std=0.02)
            nn.init.normal_(self.h_embedder.mlp[2].weight, std=0.02)

    # ------------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------------
    @property
    def attention_layers(self) -> list[MoHAttention]:
        return [block.attn for block in self.blocks]

    def set_attention_execution(self, mode: str) -> None:
        """``"auto"`` (default: the faster of dense and sparse per layer and shape, by the calibrated cost
        model), ``"dense"`` (reference semantics) or ``"sparse"`` (exact head skipping). Results agree."""
        for attn in self.attention_layers:
            attn.set_execution(mode)  # a processor per layer: auto keeps its choices per layer

    @property
    def block_options(self) -> BlockOptions:
        """What the blocks are made of (norm, MLP, QK-norm, RoPE; see :mod:`moh_dit.model.block`)."""
        return BlockOptions.from_config(self.config.get("block"))

    @property
    def num_routed_layers(self) -> int:
        return sum(attn.has_routed_heads for attn in self.attention_layers)

    def head_counts(self) -> tuple[int, int]:
        """(active heads per token summed over layers, total heads): e.g. (403, 448) for MoH-DiT-XL/2-90."""
        layers = self.attention_layers
        return sum(a.num_active_heads for a in layers), sum(a.num_heads for a in layers)

    @property
    def null_class_id(self) -> int | None:
        """Label index of the null class used for classifier-free guidance, or None if there is none."""
        if self.y_embedder is None or not self.y_embedder.has_null_class:
            return None
        return self.config.num_classes

    def recording_head_usage(self) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Within the context, every forward pass adds up which heads its tokens used (see
        :func:`moh_dit.model.head_usage.recording_head_usage`)."""
        return recording_head_usage(self.attention_layers)

    def with_num_classes(self, num_classes: int, mode: str = "resize", seed: int = 0) -> tuple[MoHDiT, dict]:
        """A copy of this model for ``num_classes`` classes (0: unconditional), for fine-tuning on data with
        another class count. Every weight but the label table is kept. ``resize`` keeps the rows of the
        classes both have (ids below the smaller count) and the null-class row; ``reinit`` starts a new table.
        New rows are drawn as DiT initialises the table, N(0, 0.02). Returns the model and a report of what
        was kept and what is new."""
        if mode not in ("resize", "reinit"):
            raise ValueError(f"mode must be 'resize' or 'reinit', got {mode!r}")
        config = {k: v for k, v in self.config.items() if not k.startswith("_")}
        torch.manual_seed(seed)
        target = type(self)(**dict(config, num_classes=num_classes)).to(self.pos_embed.device)
        source = self.state_dict()
        table = "y_embedder.embedding_table.weight"
        kept = {k: v for k, v in source.items() if k != table}
        missing = target.load_state_dict(kept, strict=False).missing_keys
        report = {"kept": sorted(kept), "new": sorted(missing), "classes": [self.config.num_classes, num_classes]}
        if mode == "resize" and table in source and target.y_embedder is not None:
            old, new = source[table], target.y_embedder.embedding_table.weight
            shared = min(self.config.num_classes, num_classes)
            with torch.no_grad():
                new[:shared] = old[:shared]
                if self.null_class_id is not None and target.null_class_id is not None:
                    new[target.null_class_id] = old[self.null_class_id]
            report["label_rows_kept"] = list(range(shared)) + (["null"] if self.null_class_id is not None else [])
        return target, report

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------
    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, p*p*C) -> (N, C, H, W)."""
        p, c = self.patch_size, self.out_channels
        g = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], g, g, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, g * p, g * p)

    def _check_labels(self, y: torch.Tensor | None, batch: int) -> None:
        if self.y_embedder is None:
            if y is not None:
                raise ValueError("this model is unconditional (num_classes=0): pass y=None")
            return
        if y is None:
            raise ValueError(f"class labels y are required (num_classes={self.config.num_classes})")
        if y.shape != (batch,):
            raise ValueError(f"y must have shape ({batch},), got {tuple(y.shape)}")
        if y.dtype.is_floating_point or y.dtype == torch.bool:
            raise ValueError(f"y must hold integer class ids, got dtype {y.dtype}")
        high = self.y_embedder.num_embeddings - 1
        if y.device.type != "cpu" or torch.compiler.is_compiling():
            # no host synchronisation on accelerators: a device-side assertion instead of reading y back
            torch._assert_async(((y >= 0) & (y <= high)).all(), f"class labels must be in [0, {high}]")
            return
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi > high:
            null = f" (index {self.config.num_classes} is the null class)" if self.null_class_id is not None else ""
            raise ValueError(f"class labels must be in [0, {high}]{null}; got values in [{lo}, {hi}]")

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor | float | int,
        y: torch.Tensor | None = None,
        force_drop_ids: torch.Tensor | None = None,
        return_head_masks: bool = False,
        return_dict: bool = True,
        return_aligned: bool | None = None,
    ) -> MoHDiTOutput | tuple:
        """Predict noise (and variance values) for noisy inputs.

        Args:
            x: (N, C, H, W) noisy input.
            t: (N,) diffusion timesteps (or a scalar for the whole batch); a model of two time inputs takes a pair
                ``(t, h)`` (MeanFlow: the time and the interval averaged over).
            y: (N,) integer class labels; index ``num_classes`` is the null class. ``None`` when
                ``num_classes == 0``.
            force_drop_ids: (N,) 1 where the label must be replaced by the null class.
            return_head_masks: also return which heads each token used, per layer.
            return_aligned: run REPA's projectors on block ``repa_depth``'s tokens (default: in training mode).
        """
        n = x.shape[0]
        if x.ndim != 4 or x.shape[1] != self.in_channels or tuple(x.shape[2:]) != (self.config.sample_size,) * 2:
            size = self.config.sample_size
            raise ValueError(f"x must have shape (N, {self.in_channels}, {size}, {size}), got {tuple(x.shape)}")
        self._check_labels(y, n)
        times = t if isinstance(t, (tuple, list)) else (t,)
        if len(times) != self.config.get("time_inputs", 1):
            raise ValueError(f"this model takes {self.config.get('time_inputs', 1)} time input(s), got {len(times)}")
        times = [torch.as_tensor(s, device=x.device) for s in times]
        times = [s.expand(n) if s.ndim == 0 else s for s in times]

        h = self.x_embedder(x) + self.pos_embed.to(x.dtype)  # (N, T, D)
        c = self.t_embedder(times[0])  # (N, D)
        if self.h_embedder is not None:
            c = c + self.h_embedder(times[1])
        if self.y_embedder is not None:
            c = c + self.y_embedder(y, self.training, force_drop_ids)

        losses, masks, aligned = [], [], None
        align = self.projectors is not None and (self.training if return_aligned is None else return_aligned)
        rope = self.feat_rope
        # the blocks report (MoH's load-balance loss, head masks) only in training or when asked: sampling gets one
        # tensor per block, the form diffusers' caches hook
        report = self.training or return_head_masks
        for index, block in enumerate(self.blocks):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                h, aux = self._gradient_checkpointing_func(block, h, c, rope, return_head_masks)
            elif report:
                h, aux = block(h, c, rope, return_head_masks)
            else:
                h, aux = block(h, c, rope, False, False), None
            if aux is not None and aux.load_balance_loss is not None:
                losses.append(aux.load_balance_loss)
            if return_head_masks:
                masks.append(aux.head_mask)
            if align and index + 1 == self.config.repa_depth:  # counted from 1, as REPA's encoder_depth
                aligned = tuple(projector(h) for projector in self.projectors)

        out = self.unpatchify(self.final_layer(h, c))  # (N, C_out, H, W)
        aux_loss = torch.stack(losses).mean() if losses else out.new_zeros((), dtype=torch.float32)
        head_masks = tuple(masks) if return_head_masks else None
        if not return_dict:
            return (out, aux_loss, head_masks) if return_head_masks else (out, aux_loss)
        return MoHDiTOutput(sample=out, aux_loss=aux_loss, head_masks=head_masks, aligned=aligned)

    def with_alignment(self, depth: int, dims: list[int], projector_dim: int = 2048) -> MoHDiT:
        """This model with REPA's alignment heads after block ``depth`` (from 1), one per encoder width in ``dims``:
        itself when it has these heads already (a run continued from a REPA checkpoint), else a copy of its weights
        with new heads (initialised as DiT initialises linears)."""
        wanted = dict(repa_depth=depth, repa_dims=list(dims), repa_projector_dim=projector_dim)
        if all(self.config.get(k) == v for k, v in wanted.items()):
            return self
        config = {k: v for k, v in self.config.items() if not k.startswith("_")}
        aligned = type(self)(**dict(config, **wanted))
        kept = {k: v for k, v in self.state_dict().items() if not k.startswith("projectors.")}
        missing = aligned.load_state_dict(kept, strict=False).missing_keys
        if any(not k.startswith("projectors.") for k in missing):
            raise ValueError(f"with_alignment lost weights: {missing[:4]}")
        return aligned.to(self.pos_embed.device).train(self.training)

    def without_alignment(self) -> MoHDiT:
        """This model without REPA's alignment heads (what sampling and exported pipelines use), its weights copied;
        itself when it has none."""
        if self.projectors is None:
            return self
        config = {k: v for k, v in self.config.items() if not k.startswith("_")}
        bare = type(self)(**dict(config, repa_depth=None, repa_dims=None, repa_projector_dim=2048))
        kept = {k: v for k, v in self.state_dict().items() if not k.startswith("projectors.")}
        bare.load_state_dict(kept)
        return bare.to(self.pos_embed.device).train(self.training)
