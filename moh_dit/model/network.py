"""MoH-DiT: a class-conditional Diffusion Transformer (adaLN-Zero) with Mixture-of-Head attention.

The network is DiT (Peebles & Xie, 2023) with every attention layer replaced by :class:`MoHAttention`.
With ``attention_type="mha"`` it is exactly DiT, which is how the DiT presets are built. Every
architecture argument, including the per-layer head tables, lives in the diffusers config, so
``save_pretrained`` / ``from_pretrained`` round-trip a model with nothing else stated.

Shapes: N batch, C channels, H x W image (or latent), p patch size, T = H*W/p**2 tokens, D width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from torch import nn

from moh_dit.model.alignment import AlignmentProjector
from moh_dit.model.architecture import IntOrList, attention_of, check_architecture, per_layer
from moh_dit.model.attention import MoHAttention
from moh_dit.model.block import BlockOptions, BlocksTrace, DiTBlock, FinalLayer
from moh_dit.model.embeddings import LabelEmbedder, PatchEmbedder, TimestepEmbedder, sincos_pos_embed_2d
from moh_dit.model.head_usage import recording_head_usage
from moh_dit.model.token_routing import KeptRotary, TokenRoute

__all__ = ["MoHDiT", "MoHDiTOutput", "BlocksTrace", "DiTBlock", "FinalLayer"]  # the blocks live in model/block.py


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
        end_time_blocks: with two time inputs, Decoupled MeanFlow's split (Lee et al. 2025, arXiv:2510.24474): the
            second time input is the end time ``r``, embedded by the same timestep embedding; the last this-many blocks
            and the final layer are conditioned on it, the others on the start time (no second embedding, no new
            parameters: with ``r = t`` the network is the one-time network). 0: none.
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
        end_time_blocks: int = 0,
    ) -> None:
        super().__init__()
        options = BlockOptions.from_config(block)
        if block is not None:  # recorded in full (DiT's block spelt out is None), so that equal blocks compare equal
            self.register_to_config(block=options.record())
        check_architecture(dict(self.config))
        heads = per_layer("num_heads", num_heads, depth)
        shared = per_layer("num_shared_heads", num_shared_heads, depth)
        topks = per_layer("top_k", top_k, depth)
        if attention_type == "mha" and (any(s is not None for s in shared) or any(k for k in topks)):
            raise ValueError("attention_type='mha' has no routing: leave num_shared_heads=None and top_k=0")

        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        grid = sample_size // patch_size
        self.num_tokens = grid * grid

        self.x_embedder = PatchEmbedder(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size, freq_shift=timestep_freq_shift)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob) if num_classes > 0 else None
        # A frozen parameter (not a buffer) as in DiT, so it is saved and counted like the reference.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, hidden_size), requires_grad=False)

        self.blocks = nn.ModuleList(
            DiTBlock(
                hidden_size,
                attention_of(layer, hidden_size, h, h_s, k, head_dim, qkv_bias, attention_type, options),
                mlp_ratio=mlp_ratio,
                norm_eps=norm_eps,
                mlp_norm_eps=norm_eps if mlp_norm_eps is None else mlp_norm_eps,
                options=options,
            )
            for layer, (h, h_s, k) in enumerate(zip(heads, shared, topks))
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm_eps=norm_eps, options=options)
        # MeanFlow's second time input (the interval t - r) has its own embedding; created after the blocks, so that
        # the others' initialisation draws the numbers it always drew
        interval = time_inputs == 2 and not end_time_blocks
        self.h_embedder = TimestepEmbedder(hidden_size, freq_shift=timestep_freq_shift) if interval else None
        # 2-D RoPE's tables (persistent buffers, as LightningDiT keeps them), kept beside the sin-cos table
        self.feat_rope = options.rotary([b.attn.head_dim for b in self.blocks], grid)
        self.projectors = (  # REPA's alignment heads: only in models that train with it (created last: the others'
            # initialisation draws the same numbers as before they existed)
            nn.ModuleList(AlignmentProjector(hidden_size, repa_projector_dim, d) for d in repa_dims)
            if repa_dims
            else None
        )
        self.gradient_checkpointing = False
        self._token_route: TokenRoute | None = None  # TREAD's route of the training pass under way (routed_tokens)
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
        """Predict noise (and variance values), a velocity or an average velocity, as the objective says.

        Args:
            x: (N, C, H, W) noisy input.
            t: (N,) time input (or a scalar for the whole batch); a model of two time inputs takes a pair ``(t, h)``
                (MeanFlow: the time and the interval averaged over).
            y: (N,) integer class labels; index ``num_classes`` is the null class. ``None`` when ``num_classes == 0``.
            force_drop_ids: (N,) 1 where the label must be replaced by the null class.
            return_head_masks: also return which heads each token used, per layer.
            return_aligned: run REPA's projectors on block ``repa_depth``'s tokens (default: in training mode).
        """
        self._check_inputs(x, y)
        h = self.x_embedder(x) + self.pos_embed.to(x.dtype)  # (N, T, D) tokens
        c, c_end = self.condition(t, y, force_drop_ids, x)  # (N, D) each: the time input(s) and the label
        h, trace = self.run_blocks(h, self.block_conditions(c, c_end), return_head_masks, return_aligned)
        out = self.unpatchify(self.final_layer(h, c_end))  # (N, C_out, H, W)
        aux_loss = torch.stack(trace.losses).mean() if trace.losses else out.new_zeros((), dtype=torch.float32)
        head_masks = tuple(trace.masks) if return_head_masks else None
        if not return_dict:
            return (out, aux_loss, head_masks) if return_head_masks else (out, aux_loss)
        return MoHDiTOutput(sample=out, aux_loss=aux_loss, head_masks=head_masks, aligned=trace.aligned)

    def condition(
        self, t: torch.Tensor | float | int | tuple, y: torch.Tensor | None, drop: torch.Tensor | None, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """adaLN's conditioning (N, D): the time embedding (plus the interval's, MeanFlow's second time input) plus the
        label's (dropped to the null class at random in training, or where ``drop`` says); and that of the end time
        where the blocks are split between the two times (``end_time_blocks``), else the same tensor."""
        n = x.shape[0]
        times = t if isinstance(t, (tuple, list)) else (t,)
        if len(times) != self.config.get("time_inputs", 1):
            raise ValueError(f"this model takes {self.config.get('time_inputs', 1)} time input(s), got {len(times)}")
        times = [torch.as_tensor(s, device=x.device) for s in times]
        times = [s.expand(n) if s.ndim == 0 else s for s in times]
        c = self.t_embedder(times[0])  # (N, D)
        if self.h_embedder is not None:
            c = c + self.h_embedder(times[1])
        label = self.y_embedder(y, self.training, drop) if self.y_embedder is not None else None
        c = c + label if label is not None else c
        if not self.config.get("end_time_blocks", 0):
            return c, c
        c_end = self.t_embedder(times[1])
        return c, c_end + label if label is not None else c_end

    def block_conditions(self, c: torch.Tensor, c_end: torch.Tensor) -> list[torch.Tensor]:
        """Each block's conditioning: the start time's, and the end time's for the last ``end_time_blocks`` blocks."""
        split = len(self.blocks) - self.config.get("end_time_blocks", 0)
        return [c if index < split else c_end for index in range(len(self.blocks))]

    def run_blocks(
        self,
        h: torch.Tensor,
        conditions: list[torch.Tensor],
        return_head_masks: bool = False,
        return_aligned: bool | None = None,
    ) -> tuple[torch.Tensor, BlocksTrace]:
        """The tokens (N, T, D) through every block, each conditioned on its ``conditions``; what the blocks report
        (MoH's load-balance losses and head masks, in training or when asked: sampling gets one tensor per block, the
        form diffusers' caches hook) and REPA's projections of block ``repa_depth``'s tokens."""
        trace = BlocksTrace()
        align = self.projectors is not None and (self.training if return_aligned is None else return_aligned)
        report = self.training or return_head_masks
        route, full, rope = self._token_route, None, self.feat_rope
        for index, (block, c) in enumerate(zip(self.blocks, conditions)):
            if route is not None and index == route.start:  # TREAD: the routed tokens wait out the span
                full, h = h, route.gather(h)
                rope = KeptRotary(self.feat_rope, route.kept) if self.feat_rope is not None else None
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                h, aux = self._gradient_checkpointing_func(block, h, c, rope, return_head_masks)
            elif report:
                h, aux = block(h, c, rope, return_head_masks)
            else:
                h, aux = block(h, c, rope, False, False), None
            trace.add(aux, return_head_masks)
            if full is not None and index + 1 == route.stop:  # and rejoin, as they were, after it
                h, full, rope = route.scatter(full, h), None, self.feat_rope
            if align and index + 1 == self.config.repa_depth:  # counted from 1, as REPA's encoder_depth
                trace.aligned = tuple(projector(h) for projector in self.projectors)
        return h, trace

    @contextlib.contextmanager
    def routed_tokens(self, route: TokenRoute | None) -> Iterator[None]:
        """Within the block, the passes of this network route tokens as ``route`` says (TREAD, training only; None:
        every token everywhere): the trainer opens it around one micro-batch's losses, so that every pass of the
        objective (MeanFlow's JVP, a finite difference's shifted passes) takes the same route."""
        previous, self._token_route = self._token_route, route
        try:
            yield
        finally:
            self._token_route = previous

    def routed_rows(self, index: torch.Tensor) -> contextlib.AbstractContextManager:
        """Within the block, a pass over the samples ``index`` of the routed batch routes each as the batch's route
        does (every token where none is open): the objectives' passes over part of a batch open it."""
        return self.routed_tokens(None if self._token_route is None else self._token_route.rows(index))

    def _check_inputs(self, x: torch.Tensor, y: torch.Tensor | None) -> None:
        if x.ndim != 4 or x.shape[1] != self.in_channels or tuple(x.shape[2:]) != (self.config.sample_size,) * 2:
            size = self.config.sample_size
            raise ValueError(f"x must have shape (N, {self.in_channels}, {size}, {size}), got {tuple(x.shape)}")
        self._check_labels(y, x.shape[0])
