"""A local web page to try a trained model: pick a class (by name), guidance, patch-grid averaging, steps,
scheduler and seed, and see the samples; for MoH models also a heatmap of which routed heads the tokens
used while sampling.

Gradio is an optional extra (``pip install "moh-dit[demo]"``); the page runs on this machine only.

    moh-dit demo runs/fashion_mnist_moh
    moh-dit demo pipelines/dit-xl-2 --port 7861 --device cuda
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from moh_dit.images import heatmap, make_grid
from moh_dit.objectives.noise import ddpm_timestep
from moh_dit.sampling.spec import TRAIN_TIMESTEPS, SamplingSpec

__all__ = [
    "build_demo",
    "api_endpoint",
    "generate",
    "page_sampling",
    "start_controls",
    "head_usage_heatmap",
    "ALL_CLASSES",
]

ALL_CLASSES = "(all classes)"  # one row per class, up to MAX_ROWS
MAX_ROWS = 16


def head_usage_heatmap(usage, model) -> Any | None:
    """Per layer and head, the share of tokens that used the head (shared heads always 1), as an image;
    ``None`` for models without routed heads."""
    if model.num_routed_layers == 0:
        return None
    widest = max(len(u) for u in usage)
    values = np.full((len(usage), widest), np.nan)
    for layer, u in enumerate(usage):
        values[layer, : len(u)] = u.numpy()
    rows = [f"layer {i} ({a.num_shared_heads} shared)" for i, a in enumerate(model.attention_layers)]
    return heatmap(values, rows, [str(h) for h in range(widest)], "share of tokens that used each head")


def start_controls(pipe) -> dict[str, Any]:
    """Where the page's controls start: the model's recorded sampling (``pipe.preview_sampling``), its guided noise
    levels as DiT timesteps, and a sampler of the model's objective."""
    recorded, last = pipe.preview_sampling, TRAIN_TIMESTEPS - 1
    first, to = recorded.guidance.interval or (0, last)
    if recorded.guidance.noise is not None:  # the recorded noise levels, as the sliders' DiT timesteps
        first, to = (round(ddpm_timestep(level)) for level in recorded.guidance.noise)
    samplers = list(pipe.objective.samplers)
    averaged = recorded.sampler.grid_averaging
    return dict(
        guidance=recorded.guidance.scale,
        steps=recorded.sampler.num_steps,
        scheduler=recorded.sampler.scheduler if recorded.sampler.scheduler in samplers else samplers[0],
        guided_from=first,
        guided_to=to,
        grid_averaging=averaged is not None,
        grid_averaging_to=100 if averaged is None else averaged,
    )


def page_sampling(
    pipe,
    guidance: float,
    steps: int,
    scheduler: str,
    guided_from: int = 0,
    guided_to: int | None = None,
    grid_averaging: int | None = None,
) -> SamplingSpec:
    """The spec a request asks for: the model's recorded sampling with what the page's controls set (scale, steps,
    sampler, grid averaging; the guided timesteps where they were moved from where they started). What the page does
    not show (the time shift, the guided channels, the rule, the guide, the cache) stays as recorded."""
    recorded, start = pipe.preview_sampling, start_controls(pipe)
    placed = (int(guided_from), TRAIN_TIMESTEPS - 1 if guided_to is None else int(guided_to))
    changes: dict[str, Any] = dict(
        scheduler=scheduler,
        num_inference_steps=int(steps),
        guidance_scale=float(guidance),
        grid_averaging=None if grid_averaging is None else int(grid_averaging),
    )
    if placed != (start["guided_from"], start["guided_to"]):
        changes.update(guidance_interval=placed, guidance_noise=None)
    return recorded.replace(**changes)


def generate(
    pipe,
    class_name: str | None,
    per_class: int,
    guidance: float,
    steps: int,
    scheduler: str,
    seed: int,
    guided_from: int = 0,
    guided_to: int | None = None,
    grid_averaging: int | None = None,
):
    """One request of the page: ``(grid image, head-usage heatmap or None, a line about what ran)``. Guidance
    applies at training timesteps ``guided_from..guided_to`` (default: all, or as recorded); the steps at timesteps up
    to ``grid_averaging`` average over shifted patch grids (default: none). See :func:`page_sampling`."""
    from moh_dit.sampling.grids import sample_grid

    conditional = pipe.transformer.config.num_classes > 0
    if not conditional:
        classes = []
    elif class_name == ALL_CLASSES:
        classes = list(range(min(pipe.transformer.config.num_classes, MAX_ROWS)))
    else:
        classes = [class_name]
    spec = page_sampling(pipe, guidance, steps, scheduler, guided_from, guided_to, grid_averaging)
    start = time.time()
    with pipe.transformer.recording_head_usage() as usage:
        images, names = sample_grid(pipe, classes, int(per_class), int(seed), spec)
    grid = make_grid(images, ncols=int(per_class), row_labels=names)
    source = (getattr(pipe, "provenance", None) or {}).get("source", "the model")
    info = f"{len(images)} images from {source} in {time.time() - start:.1f} s ({spec.describe()})"
    return grid, head_usage_heatmap(usage, pipe.transformer), info


def build_demo(pipe, title: str = "MoH-DiT"):
    """The Gradio page around ``pipe``."""
    import gradio as gr

    names = list(pipe.id2label.values()) or [str(i) for i in range(pipe.transformer.config.num_classes)]
    names = [ALL_CLASSES, *names] if names else names
    conditional = pipe.transformer.config.num_classes > 0
    active, total = pipe.transformer.head_counts()
    start = start_controls(pipe)  # the controls start where the model's own previews were drawn
    last = TRAIN_TIMESTEPS - 1
    with gr.Blocks(title=title) as page:
        gr.Markdown(f"## {title}\n{active} of {total} heads active per token. Pick a class and press Generate.")
        with gr.Row():
            with gr.Column(scale=1):
                label = gr.Dropdown(
                    names,
                    value=names[1] if len(names) > 1 else None,
                    label="class",
                    elem_id="class",
                    visible=conditional,
                    filterable=True,
                    allow_custom_value=True,  # a typed name in any case; an unknown one answers with suggestions
                )
                guidance = gr.Slider(
                    1.0, 10.0, value=start["guidance"], step=0.25, label="guidance", elem_id="guidance"
                )
                # noise levels as DiT's DDPM timesteps: the same levels for a flow model (docs/sampling.md)
                guided_from = gr.Slider(
                    0,
                    last,
                    value=start["guided_from"],
                    step=1,
                    label="guided from noise level (DiT timestep)",
                    elem_id="guided-from",
                )
                guided_to = gr.Slider(
                    0,
                    last,
                    value=start["guided_to"],
                    step=1,
                    label="guided to noise level (DiT timestep)",
                    elem_id="guided-to",
                )
                averaged = gr.Checkbox(
                    value=start["grid_averaging"],
                    label="average shifted patch grids at low noise (fainter patch seams)",
                    elem_id="grid-averaging",
                )
                averaged_to = gr.Slider(
                    0,
                    last,
                    value=start["grid_averaging_to"],
                    step=1,
                    label="... at timesteps up to",
                    elem_id="grid-averaging-last",
                )
                # one step upward: MeanFlow and distilled students sample in one
                steps = gr.Slider(1, 250, value=start["steps"], step=1, label="steps", elem_id="steps")
                scheduler = gr.Dropdown(  # the samplers of the model's objective
                    list(pipe.objective.samplers), value=start["scheduler"], label="scheduler", elem_id="scheduler"
                )
                seed = gr.Number(value=0, precision=0, label="seed", elem_id="seed")
                per_class = gr.Slider(1, 16, value=8, step=1, label="images", elem_id="count")
                button = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                grid = gr.Image(label="samples", type="pil", elem_id="grid")
                usage = gr.Image(label="routed heads used", type="pil", elem_id="heads")
                info = gr.Markdown(elem_id="info")
        button.click(
            api_endpoint(pipe),
            [label, per_class, guidance, steps, scheduler, seed, guided_from, guided_to, averaged, averaged_to],
            [grid, usage, info],
            api_name="generate",  # a script calls it as client.predict(..., api_name="/generate")
        )
    return page


def api_endpoint(pipe):
    """The page's one endpoint, ``/generate``, with named parameters (Gradio names them from this signature, so a
    script's ``gradio_client`` call reads as the page does). Bad input (an unknown class, a step count out of
    range, an interval the wrong way round) answers with one clear line (a ``gradio.Error``), not a traceback."""
    import gradio as gr

    from moh_dit.errors import one_line

    start = start_controls(pipe)  # a script's call with no settings samples the model as it records

    def generate_images(
        class_name: str,
        images: int = 8,
        guidance: float = start["guidance"],
        steps: int = start["steps"],
        scheduler: str = start["scheduler"],
        seed: int = 0,
        guided_from: int = start["guided_from"],
        guided_to: int = start["guided_to"],
        grid_averaging: bool = start["grid_averaging"],
        grid_averaging_to: int = start["grid_averaging_to"],
    ):
        try:
            if not 1 <= int(images) <= MAX_ROWS:
                raise ValueError(f"images must be between 1 and {MAX_ROWS} per class, got {images}")
            averaging = int(grid_averaging_to) if grid_averaging else None
            return generate(
                pipe, class_name, images, guidance, steps, scheduler, seed, guided_from, guided_to, averaging
            )
        except (ValueError, KeyError, TypeError) as err:  # ConfigError is a ValueError
            raise gr.Error(one_line(err)) from None

    return generate_images
