"""Model cards: the ``README.md`` of every saved pipeline folder (what it is, how it was made, how well it
does, how to use it), in the Hugging Face Hub's format, and the upload of a pipeline folder to the Hub."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moh_dit.logs import plural
from moh_dit.manifests import short
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.vae import LatentNormalization, space_of

__all__ = [
    "render_card",
    "write_card",
    "record_evaluation",
    "push_folder",
    "draw_quality_curve",
    "EVALUATIONS_FILE",
    "QUALITY_CURVE_FILE",
]

EVALUATIONS_FILE = "evaluations.json"
QUALITY_CURVE_FILE = "quality_curve.png"  # the picture of the evaluations during training, beside the card
# the scores a card's quality curve shows, and their names
QUALITY_KEYS = (("kid", "KID"), ("fid", "FID"), ("precision", "precision"), ("recall", "recall"))
_CITATION = """@article{jin2024moh,
  title   = {MoH: Multi-Head Attention as Mixture-of-Head Attention},
  author  = {Jin, Peng and Zhu, Bo and Yuan, Li and Yan, Shuicheng},
  journal = {arXiv preprint arXiv:2410.11842},
  year    = {2024}
}
@inproceedings{peebles2023dit,
  title     = {Scalable Diffusion Models with Transformers},
  author    = {Peebles, William and Xie, Saining},
  booktitle = {ICCV},
  year      = {2023}
}"""


def _heads_table(config: dict) -> list[str]:
    """Per-layer heads as runs of equal layers: ``layers 0-8: 8 heads, 8 shared, top-0``."""
    from moh_dit.model.architecture import per_layer

    depth = config["depth"]
    heads = per_layer("num_heads", config["num_heads"], depth)
    if config.get("attention_type") == "mha":
        rows = [(h, h, 0) for h in heads]
    else:
        shared = [
            s if s is not None else h for s, h in zip(per_layer("shared", config["num_shared_heads"], depth), heads)
        ]
        rows = list(zip(heads, shared, per_layer("top_k", config["top_k"], depth)))
    lines, start = [], 0
    for i in range(1, depth + 1):
        if i == depth or rows[i] != rows[start]:
            h, s, k = rows[start]
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            routed = f"top-{k} of {h - s} routed" if k else "no routed heads"
            lines.append(f"| {span} | {h} | {s} | {routed} |")
            start = i
    return ["| layers | heads | shared | routed |", "|---|---|---|---|", *lines]


def _class_weights_row(weights: dict | None, id2label: dict) -> list[str]:
    """The card's line on ``data.class_weights`` (none when every class was drawn as often as the data holds it)."""
    changed = {int(c): w for c, w in (weights or {}).items() if w != 1}
    if not changed:
        return []
    named = ", ".join(f"{id2label.get(c, c)} x{w:.3g}" for c, w in sorted(changed.items()))
    return [f"| class weights | {named} per epoch; every other class x1 (`data.class_weights`) |"]


def _folded_row(folded: dict | None, step: int | None) -> list[str]:
    """Whether the guidance the model records was folded into its training, and from which step."""
    if not folded:
        return []
    if folded.get("from_step") is None:
        return [f"| guidance folded in | **no**: training stopped at step {step}, before its warm-up of "
                f"{folded.get('warmup')} steps ended; sample it with CFG (`--cfg-scale`) |"]  # fmt: skip
    return [f"| guidance folded in | from step {folded['from_step']} |"]


def _lead_row(lead: dict | None) -> list[str]:
    """The lead a generator's later steps were trained after (``distill.dmd_input: lead``), and how to sample it."""
    if not lead:
        return []
    return [f"| hand-off | its later steps trained on the first step of `{lead['model']}` (weights "
            f"`{str(lead['sha256'])[:12]}`): sample two steps with `--lead-model {lead['model']}` |"]  # fmt: skip


def _spent_row(spent: dict | None) -> list[str]:
    """What training spent: each network's updates where several trained (DMD2's generator and fake score), and the
    network evaluations (a forward 1, its backward 2), the teacher's apart."""
    if not spent:
        return []
    updates = [f"{n:,} {key.removesuffix('_updates').replace('_', '-')} updates" for key, n in spent.items()
               if key.endswith("_updates")]  # fmt: skip
    evaluations = f"{spent.get('network_evaluations', 0):,.0f} network evaluations of the networks trained"
    if spent.get("teacher_evaluations"):
        evaluations += f", {spent['teacher_evaluations']:,} of the teacher"
    return [f"| spent | {'; '.join([*updates, evaluations])} |"]


def _changes_row(changes: list[dict] | None) -> list[str]:
    """The settings a resume changed (from the run's manifest), step by step; train.max_steps alone is no change of
    recipe and is left out."""
    said = []
    for change in changes or []:
        keys = [f"`{k}` {short(a)} -> {short(b)}" for k, (a, b) in change["changed"].items() if k != "train.max_steps"]
        if keys:
            said.append(f"at step {change['step']}: {', '.join(keys)}")
    return [f"| resumed with other settings | {'; '.join(said)} |"] if said else []


def _quality_section(training: dict, curve_image: str | None) -> list[str]:
    """The card's quality curve: the evaluations during training (``log.eval_every``), as a picture and a table."""
    points, protocol = training.get("quality_curve") or [], training.get("quality_protocol") or {}
    if not points:
        return []
    spec = SamplingSpec.from_record(protocol.get("sampling"))
    how = f"{spec.describe()}, " if spec else ""
    lines = [
        "## Quality during training",
        "",
        f"Scored while the model trained (`log.eval_every`): {how}class-balanced samples of the EMA weights, "
        f"features `{protocol.get('extractor', '?')}` against `{protocol.get('reference', '?')}`. `moh-dit evaluate "
        f"--model <checkpoint>` with the same settings gives the same numbers.",
        "",
    ]
    if curve_image:
        lines += [f"![quality during training]({curve_image})", ""]
    shown = [(k, label) for k, label in QUALITY_KEYS if any(k in p for p in points)]
    lines += [
        "| step | samples | " + " | ".join(label for _, label in shown) + " |",
        "|---" * (2 + len(shown)) + "|",
    ]
    for p in points:
        cells = [(f"{p[k]:.5g}" if k == "kid" else f"{p[k]:.3f}") if k in p else "-" for k, _ in shown]
        lines.append(f"| {p['step']:,} | {p.get('num_samples', 0):,} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def draw_quality_curve(training: dict, path: str | os.PathLike) -> bool:
    """Draw the quality curve of a training summary (``quality_curve``) as a PNG; returns whether it drew (there
    are points, and matplotlib is installed)."""
    from moh_dit.images import plot_curves

    points = training.get("quality_curve") or []
    return bool(points) and plot_curves(points, QUALITY_KEYS, path, "quality during training")


def render_card(
    pipe,
    manifest: dict,
    evaluations: list[dict] | None = None,
    name: str | None = None,
    curve_image: str | None = None,
) -> str:
    """The card of a pipeline: architecture, parameters and active heads, data and training, the quality curve
    of the training (``curve_image``: its picture's file name beside the card), metrics where known, usage,
    provenance and citation."""
    from huggingface_hub import ModelCard, ModelCardData

    from moh_dit import __version__

    transformer = pipe.transformer
    config = {k: v for k, v in dict(transformer.config).items() if not k.startswith("_")}
    source = manifest.get("source") or {}
    training = source.get("training") or {}
    moh = config.get("attention_type") == "moh"
    active, total = transformer.head_counts()
    params = sum(p.numel() for p in transformer.parameters())
    names = list(pipe.id2label.values())
    preset = training.get("preset") or source.get("preset")
    title = name or (f"{preset} (moh-dit)" if preset else "MoH-DiT pipeline (moh-dit)")
    vae = source.get("vae") or {}
    space = (
        f"{config['in_channels']} x {config['sample_size']} x {config['sample_size']} latents of the "
        f"{space_of(vae)['kind'] if vae else 'autoencoder'} `{vae.get('spec') or 'in vae/'}` "
        f"({LatentNormalization.of(vae).describe() if vae.get('scaling_factor') else 'as saved'})"
        if pipe.config.get("latent_space")
        else f"{config['in_channels']} x {config['sample_size']} x {config['sample_size']} pixels"
    )
    classes = (
        f"{config['num_classes']}"
        + (f": {', '.join(names[:12])}" + (f" and {len(names) - 12} more" if len(names) > 12 else "") if names else "")
        if config["num_classes"]
        else "none (unconditional)"
    )
    lines = [
        f"# {title}",
        "",
        ("A class-conditional " if config["num_classes"] else "An unconditional ")
        + ("Diffusion Transformer with Mixture-of-Head attention (MoH-DiT)" if moh else "Diffusion Transformer (DiT)")
        + f", saved by moh-dit {__version__} as a diffusers `DiffusionPipeline` "
        "(`MoHDiTPipeline`). In MoH attention a few shared heads are always on and every token picks its top-k "
        "routed heads; head outputs are summed with learned per-token weights.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {'MoH-DiT' if moh else 'DiT'}{f' (preset `{preset}`)' if preset else ''}, width "
        f"{config['hidden_size']}, depth {config['depth']}, patch {config['patch_size']} |",
        f"| block | {transformer.block_options.describe()} |",
        f"| parameters | {params:,} |",
        f"| heads active per token | {active} of {total} ({100 * active / total:.0f}%) |",
        f"| input | {space} |",
        f"| classes | {classes} |",
        f"| objective | {pipe.objective.describe()} |",
        f"| learned variance | {'yes' if config.get('learn_sigma') else 'no'} |",
        "",
        *_heads_table(config),
        "",
    ]
    if training:
        optim, ema = training.get("optim", {}), training.get("ema", {})
        data = training.get("data", {})
        fingerprint = f" (fingerprint `{str(data['fingerprint'])[:12]}`)" if data.get("fingerprint") else ""
        lines += [
            "## Training",
            "",
            "| | |",
            "|---|---|",
            f"| data | {data.get('name', '?')}, {data.get('count', 0):,} images{fingerprint} |",
            *_class_weights_row(data.get("class_weights"), pipe.id2label),
            f"| steps | {source.get('step')} of global batch {training.get('global_batch_size')} |",
            f"| optimizer | AdamW, lr {optim.get('lr')}, betas {tuple(optim.get('betas') or (0.9, 0.999))}, warm-up {optim.get('warmup_steps')} steps, weight decay "
            f"{optim.get('weight_decay')}, gradient clipping {optim.get('grad_clip') or 'off'} |",
            f"| EMA | decay {ema.get('decay')}{' with warm-up' if ema.get('warmup') else ''}; these are the EMA weights |",
            f"| loss | {training.get('loss') or pipe.objective.describe_loss()} + {training.get('moh_loss_coeff')} x MoH load "
            "balance |",
            f"| precision | {training.get('mixed_precision', 'no')} mixed precision |",
            *_folded_row(training.get("folded_guidance"), source.get("step")),
            *_lead_row(training.get("lead")),
            *_spent_row(training.get("spent")),
            *_changes_row(training.get("changed_on_resume")),
            "",
            *_quality_section(training, curve_image),
        ]
    elif source.get("converted_from"):
        lines += [
            "## Origin",
            "",
            f"Converted from `{source['converted_from']}` ({source.get('format')})"
            + (", then turned from multi-head DiT into MoH-DiT for continued training" if source.get("to_moh") else "")
            + ".",
            "",
        ]
    lines += ["## Evaluation", ""]
    if evaluations:
        lines += [
            "| samples | FID | sFID | IS | KID | precision | recall | features | reference | sampler |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in evaluations:
            m = e["metrics"]
            cell = lambda k, f="{:.3f}": f.format(m[k]) if k in m else "-"  # noqa: E731
            lines.append(
                f"| {e['num_samples']:,} | {cell('fid', '{:.2f}')} | {cell('sfid', '{:.2f}')} | "
                f"{cell('inception_score', '{:.2f}')} | {cell('kid', '{:.4f}')} | {cell('precision')} | {cell('recall')} | "
                f"{e['extractor']} | {e['reference']} | {e['sampler']} |"
            )
    else:
        lines.append("Not evaluated yet: `moh-dit evaluate --model <this folder> --reference ...` adds a row here.")
    example = ", ".join(repr(n) for n in names[:2]) if names else "0, 1"
    spec = SamplingSpec.from_record(manifest.get("sampling"))
    shown = spec or SamplingSpec()
    scale, interval, averaging = shown.guidance.scale, shown.guidance.interval, shown.sampler.grid_averaging
    banded = f", guidance_interval=({interval[0]}, {interval[1]})" if interval else ""
    banded += f", guidance_noise={shown.guidance.noise!r}" if shown.guidance.noise else ""
    banded += f", grid_averaging={averaging}" if averaging is not None else ""
    banded += f", time_shift={shown.sampler.time_shift!r}" if shown.sampler.time_shift != 1.0 else ""
    call = (
        f"pipe([{example}], guidance_scale={float(scale)!r}{banded}, num_inference_steps=250)"
        if config["num_classes"]
        else "pipe(num_images=4)"
    )
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from moh_dit import MoHDiTPipeline  # pip install moh-dit",
        "",
        'pipe = MoHDiTPipeline.from_pretrained("<this folder or hub repo>")',
        f"images = {call}.images",
        "```",
        "",
        "```bash",
        "moh-dit sample <this folder> --per-class 8 --out grid.png  # with the guidance recorded below",
        "moh-dit evaluate --model <this folder> --reference ref.npz --num-samples 50000",
        "```",
        "",
        "## Provenance",
        "",
        f"- transformer weights: SHA-256 `{manifest.get('transformer_sha256')}`",
        f"- VAE weights: {('SHA-256 `' + manifest['vae_sha256'] + '`') if manifest.get('vae_sha256') else 'none (pixel space)'}",
        f"- source: {source.get('run') or source.get('converted_from') or 'in memory'}"
        + (f", step {source['step']}" if source.get("step") is not None else ""),
        "- sampling it was shown with (the default of `moh-dit sample` and the demo): "
        + (
            f"{spec.describe_guidance()}, {spec.sampler.scheduler} {plural(spec.sampler.num_steps, 'step')}"
            if spec
            else "not recorded"
        ),
        f"- made by moh-dit {manifest.get('code', {}).get('moh_dit', __version__)}"
        + (f" (commit {manifest['code']['git_commit']})" if manifest.get("code", {}).get("git_commit") else ""),
        "",
        "## Citation",
        "",
        "```bibtex",
        _CITATION,
        "```",
    ]
    data = ModelCardData(
        license="apache-2.0",
        library_name="diffusers",
        tags=[
            "moh-dit",
            "mixture-of-head-attention" if moh else "dit",
            "diffusion-transformer",
            "image-generation",
            "class-conditional" if config["num_classes"] else "unconditional",
        ],
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def write_card(folder: str | os.PathLike, pipe, manifest: dict) -> Path:
    """(Re)write ``folder/README.md`` from the pipeline, its manifest and its recorded evaluations."""
    folder = Path(folder)
    evaluations_file = folder / EVALUATIONS_FILE
    evaluations = json.loads(evaluations_file.read_text()) if evaluations_file.is_file() else []
    curve = QUALITY_CURVE_FILE if (folder / QUALITY_CURVE_FILE).is_file() else None
    (folder / "README.md").write_text(render_card(pipe, manifest, evaluations, curve_image=curve))
    return folder / "README.md"


def record_evaluation(folder: str | os.PathLike, pipe, manifest: dict, result: dict) -> Path:
    """Add an evaluation of this pipeline's own weights to ``evaluations.json`` and to its card."""
    folder = Path(folder)
    identity = (result.get("samples") or {}).get("manifest", {}).get("identity", {})
    entry = {
        "metrics": result["metrics"],
        "num_samples": result["num_samples"],
        "extractor": result["extractor"],
        "reference": Path(result["reference"]["reference"]).name,
        "sampler": f"{identity.get('scheduler', {}).get('name', '?')} {plural(identity.get('num_inference_steps'), 'step')}, "
        + SamplingSpec.create(
            scheduler=None,
            guidance_scale=identity.get("guidance_scale"),
            guidance_interval=identity.get("guidance_interval"),
            grid_averaging=identity.get("grid_averaging"),
            guidance_noise=identity.get("guidance_noise"),
        ).describe_guidance(),
    }
    file = folder / EVALUATIONS_FILE
    entries = json.loads(file.read_text()) if file.is_file() else []
    file.write_text(json.dumps(entries + [entry], indent=2))
    return write_card(folder, pipe, manifest)


def push_folder(folder: str | os.PathLike, repo_id: str, private: bool = False, token: str | None = None) -> Any:
    """Upload a saved pipeline folder (weights, card, manifest) to a Hugging Face Hub model repository.

    diffusers' own ``push_to_hub`` saves the pipeline again and writes a generic card over this one, so the
    folder is uploaded as it is instead."""
    from huggingface_hub import create_repo, upload_folder

    folder = Path(folder)
    if not (folder / "model_index.json").is_file():
        from moh_dit.errors import ArtifactError

        raise ArtifactError(f"{folder} is not a saved pipeline folder (no model_index.json)")
    create_repo(repo_id, private=private, token=token, exist_ok=True, repo_type="model")
    return upload_folder(
        repo_id=repo_id, folder_path=str(folder), token=token, commit_message="Upload MoH-DiT pipeline (moh-dit)"
    )
