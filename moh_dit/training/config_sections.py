"""The sections of a training config and their defaults: one dataclass per section (``model``, ``objective``,
``data``, ``optim``, ``train``, ``ema``, ``log``, ``preview``, ``repa``) and :class:`Config`, which holds them.

Reading a YAML file with overrides is :func:`moh_dit.training.config.load_config`; checking every value is
:func:`moh_dit.training.config_checks.validate`.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from moh_dit.sampling.spec import CONFIG_KEYS, SamplingSpec

__all__ = ["Config", "ModelSection", "ObjectiveSection", "DataSection", "OptimSection", "TrainSection", "EMASection",
           "LogSection", "EvalSamplingSection", "PreviewSection", "RepaSection", "DistillSection"]  # fmt: skip


@dataclass
class ModelSection:
    preset: str = "MoH-DiT-Ti/4-75"
    overrides: dict[str, Any] = field(default_factory=dict)  # any MoHDiT config key, e.g. num_classes
    init_from: str | None = None  # a run, checkpoint, pipeline or transformer folder to start from
    # with init_from and data of another class count: strict (an error), resize (keep the shared label rows
    # and the null row) or reinit (a new label table); every other weight is kept
    init_classes: str = "strict"


@dataclass
class ObjectiveSection:
    """What the network learns (moh_dit.objectives, docs/objective.md): DiT's DDPM or flow matching (SiT). ``null``
    means the default (ddpm, linear, moh-dit) for a new model, and what the weights were trained with for
    ``model.init_from``, whose objective a run keeps."""

    name: str | None = None  # ddpm | flow | meanflow | distill
    path: str | None = None  # flow: linear (SiT's Linear) | gvp (SiT's GVP, the cosine path)
    # flow: the network's time input and output: moh-dit (1000 s, v), repa (s, v) or sit (1 - s, -v); sit and repa
    # models export to those projects' code (moh-dit convert --to sit | repa)
    convention: str | None = None
    # flow: what the network outputs: velocity | x (JiT's x-prediction: the clean image, the loss on the velocity)
    prediction: str | None = None
    # flow and meanflow: how times are drawn; null: the objective's default (flow: uniform, 0, 1 as SiT; meanflow:
    # logit-normal, -0.4, 1 as the paper). flow: uniform | logit-normal (SD3) | lognormal (REPA's option);
    # meanflow: logit-normal | uniform
    time_sampling: str | None = None
    time_mean: float | None = None  # the normal of logit-normal and lognormal time sampling
    time_std: float | None = None
    cosine_loss: float = 0.0  # flow: weight of LightningDiT's velocity-direction loss (1 - cosine; its recipe: 1)
    # ddpm, flow and meanflow: guidance folded into training (Model Guidance; MeanFlow's), recorded with the model
    # (null: none, or what init_from's weights record): omega, kappa (the share of the network's own conditional
    # prediction; Model Guidance's w with omega 1) and the guided flow times
    guidance_scale: float | None = None
    guidance_mix: float | None = None
    guidance_times: list[float] | None = None  # [first, last] flow times (1 = noise); null: every time
    # ddpm, flow and meanflow: the steps before folded guidance starts (its predictions are noise until the network has
    # learned something), and whose predictions it uses: model (the weights being trained) | ema (their EMA)
    guidance_warmup: int | None = None
    guidance_source: str | None = None
    equal_times: float = 0.75  # meanflow: the share of each batch with r = t (plain flow matching there)
    adaptive_power: float = 1.0  # meanflow: p of the adaptive loss weight 1 / (L + c)^p (0: plain squared error)
    adaptive_eps: float = 0.01  # meanflow: c
    jvp_autocast: bool = False  # meanflow: the JVP in the run's mixed precision (default float32, as the authors')


@dataclass
class DataSection:
    name: str = "fashion-mnist"  # fashion-mnist | folder | latents
    path: str | None = None  # folder of class folders, IDX folder, or pre-extracted latents (.npy)
    image_size: int = 28
    channels: int = 1
    split: str = "train"
    download: bool = False
    num_workers: int = 0
    random_flip: bool = True
    max_bad_fraction: float = 0.01
    subset_per_class: int = 0  # > 0: use only the first N images of every class (smoke runs, tests)
    # how often each class is drawn per epoch, relative to its share of the data: {Sandal: 2, Bag: 2} (names
    # or ids), or "balanced" (every class equally often); {} draws every image once per epoch
    class_weights: Any = field(default_factory=dict)
    vae: str = "none"  # none | hub id (stabilityai/sd-vae-ft-ema) | local folder


@dataclass
class OptimSection:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    warmup_steps: int = 0  # linear LR warm-up
    schedule: str = "constant"  # after warm-up: constant (DiT) or cosine (decays to min_lr at train.max_steps)
    min_lr: float = 0.0  # the end of the cosine schedule
    # the learning rate of the tensors a run did not take from its teacher or init_from (a new output head, a new time
    # input), as a multiple of lr; the schedule applies to both groups alike
    new_lr_scale: float = 1.0


@dataclass
class TrainSection:
    output_dir: str = "runs/default"
    global_batch_size: int = 256
    grad_accum_steps: int = 1
    max_steps: int = 400_000
    time_limit_minutes: float = 0.0  # > 0: stop (and checkpoint) after this long
    seed: int = 0
    mixed_precision: str = "no"  # no | fp16 | bf16
    allow_tf32: bool = True
    gradient_checkpointing: bool = False
    compile: bool = False
    moh_loss_coeff: float = 0.01
    snr_gamma: float | None = None  # Min-SNR-gamma weighting of the noise MSE (e.g. 5); None: DiT's loss
    checkpoint_every: int = 50_000
    keep_last: int = 3
    resume: str | None = None  # latest | PATH
    # resume on another number of processes or accumulation steps (same global batch): the data of every step is
    # kept, the per-process random draws are not, so the run does not continue exactly as it would have
    elastic_resume: bool = False
    # the spike guard (moh_dit/training/spike_guard.py): > 0 skips an update whose loss exceeds this multiple of
    # the median loss of the last spike_window steps; spike_patience spikes in a row, or a non-finite loss, roll
    # back to the newest checkpoint, at most max_rollbacks times. 0: off (a non-finite loss stops the run)
    spike_guard: float = 0.0
    spike_window: int = 50
    spike_patience: int = 3
    max_rollbacks: int = 3
    overwrite: bool = False  # clear an earlier run in output_dir (what moh-dit wrote there) before starting
    push_to_hub: str | None = None  # a Hub repo id: upload the exported pipeline (with its card) at the end


@dataclass
class EMASection:
    decay: float = 0.9999
    warmup: bool = False  # diffusers' EMA warm-up (decay ramps up from 0); DiT uses a constant decay
    inv_gamma: float = 1.0
    power: float = 2.0 / 3.0
    update_every: int = 1
    # post-hoc EMA (EDM2; docs/training.md#post-hoc-ema): power-function EMAs of these relative widths, tracked in
    # training images, with a snapshot of each every posthoc_every images (a multiple of train.global_batch_size;
    # 0: off); `moh-dit ema RUN --sigma-rel S` rebuilds an EMA of any width afterwards
    posthoc_every: int = 0
    posthoc_sigma_rels: tuple[float, ...] = (0.05, 0.10)
    posthoc_dtype: str = "float32"  # of the snapshots: float16 halves their size and adds ~5e-4 relative error


@dataclass
class DistillSection:
    """A distillation's teacher and student (``objective.name: distill``; moh_dit/objectives/distill/meanflow.py,
    docs/objective.md#distillation): the trained model whose velocity the student learns, the guidance folded in, and
    how the student's derivative is taken."""

    teacher: str | None = (
        None  # a run, checkpoint, pipeline or transformer folder, or a checkpoint file (teacher_format)
    )
    # a checkpoint file's format, as moh-dit convert's --format: dit | sit | repa | lightningdit
    teacher_format: str = "dit"
    teacher_path: str = "linear"  # a SiT or REPA checkpoint's path (convert's --flow-path): linear | gvp
    teacher_num_heads: int | None = None  # a checkpoint file's heads, where its width is no DiT preset's (--num-heads)
    # the teacher's guidance folded into the target (1: none); null: the guidance the teacher records (its previews')
    guidance_scale: float | None = None
    # [first, last] flow times guided (1: noise); null: the teacher's recorded interval (as noise levels), else every time
    guidance_times: list[float] | None = None
    guide: str | None = None  # autoguidance of the teacher: a weaker model (run, checkpoint, pipeline) instead of CFG
    guide_step: int | None = None  # the guide run's checkpoint at this step
    guide_sigma_rel: float | None = None  # an EMA of this width rebuilt from the guide run's post-hoc snapshots
    student: str = (
        "teacher"  # teacher: the teacher's architecture, from its weights | preset: model.preset (+ overrides)
    )
    end_time_blocks: int = 0  # Decoupled MeanFlow's split: the last N blocks see the end time (0: MeanFlow's interval)
    # false: the student keeps its teacher's time embedding as it is (frozen), so that its dependence on t stays as
    # smooth as the teacher's (the derivative in t multiplies the target's errors; docs/objective.md#distillation)
    train_time_embedding: bool = True
    # what the student outputs: velocity | noise (a DDPM teacher's own parameterization on its input scale, so that the
    # student starts as its teacher; DDPM teachers only) | teacher (the teacher's own: noise for DDPM, else velocity)
    head: str = "velocity"
    # the noise head's last flow time of DDIM's exact parameterization (u = (F - z) / (1 - t)); later times divide by
    # 1 - noise_until, so that the first step from pure noise stays learnable (docs/objective.md#the-student-and-its-time)
    noise_until: float = 0.5
    derivative: str = "jvp"  # du/dt by jvp | finite-difference (float64, MoH's routing held)
    # the finite difference's step in time; null: 5e-3 for a teacher that sees times x1000 (moh-dit's flow, DDPM), 1e-4
    # (FastGen's) for raw times (SiT, REPA, LightningDiT)
    fd_eps: float | None = None
    # how the student learns (moh_dit/objectives/distill/methods.py): meanflow (MeanFlow's identity on the teacher's
    # velocity) | trajectory (secants of the teacher's own sampling trajectories) | dmd2 (distribution matching) | rcm
    # (trajectories regularised by DMD2) | ect (consistency post-training with a small fixed step)
    method: str = "meanflow"
    # the student's weights to start from instead of its teacher's: a run, checkpoint or pipeline of another student of
    # the same teacher (CMT's second stage: a trajectory student post-trained by MeanFlow)
    student_from: str | None = None
    # --- which intervals are trained (every method; docs/objective.md#interval-coverage) ---
    # r drawn apart from t (Decoupled MeanFlow: t ~ LN(0.4, 1), r ~ LN(-1.2, 1)); null: as t (objective.time_*)
    r_time_sampling: str | None = None
    r_time_mean: float | None = None
    r_time_std: float | None = None
    # the share of the interval samples (r < t) put on the intervals the student samples with: the grids of
    # grid_steps steps (1: [1, 0]; 2: [1, 0.5] and [0.5, 0]; ...), each interval equally often
    grid_share: float = 0.0
    grid_steps: tuple[int, ...] = (1, 2)
    # --- the meanflow method's stabilisers (docs/objective.md#the-stabilisers) ---
    loss: str = (
        "l2"  # l2 (MeanFlow's adaptively weighted error) | opt-grad (FastGen's: a normalised step to the target)
    )
    spatial_invariance: bool = False  # opt-grad: the step's norm per element (FastGen's tangent_spatial_invariance)
    tangent_clamp: float | None = None  # each element of the step to the target clamped to [-c, c] (FACM's 1)
    tangent_warmup: int = 0  # steps over which the derivative's term grows from 0 to 1 (FastGen: 2000; sCM: 10k)
    anchor: float = 0.0  # the weight of a flow-matching anchor: u(z_t, t, t) on the teacher's velocity (DMF, FACM)
    # --- the trajectory method (docs/objective.md#trajectory-distillation) ---
    # the teacher's trajectories: null (drawn by the run itself into its folder before training), online (drawn for
    # each batch, never stored) or a folder a run or `moh-dit trajectories` recorded for this teacher
    trajectories: str | None = None
    trajectory_count: int = 2048  # trajectories in a stored set
    trajectory_sampler: str | None = None  # euler | heun | unipc; null: the teacher's recorded sampler where it is one
    trajectory_steps: int | None = None  # the teacher's steps; null: its recorded protocol's
    trajectory_shard_size: int = 256  # trajectories per file of a stored set
    # --- the dmd2 method (docs/objective.md#dmd2) ---
    fake_updates: int = 4  # fake-score updates per generator update (FastGen's student_update_freq 5)
    fake_lr: float | None = None  # the fake score's and discriminator's learning rate; null: optim.lr
    gan_weight: float = 0.0  # the GAN term's weight in the generator's loss (FastGen's 1e-3); 0: no discriminator
    gan_block: int | None = None  # the fake score's block (from 1) the discriminator reads; null: the middle one
    regression: float = 0.0  # DMD's regression on the teacher's trajectories (distill.trajectory_*), its weight
    regression_distance: str = "mse"  # its distance: mse | teacher_features (LPIPS's form in the teacher's tokens)
    regression_feature_time: float | None = None  # teacher_features: the flow time the teacher reads both at; null: 0
    # where its generator sample starts: noise (the trajectory's, one step: DMD's) | start (the trajectory's state at
    # each sample's start time on the generator's grids, e.g. the two-step grid's middle)
    regression_from: str = "noise"
    dmd_steps: tuple[int, ...] = (1,)  # the generator's grids: [1] one step; [1, 2] also two
    # a multi-step generator's input at a grid time below 1: data (noised) | generator (its own earlier step, backward
    # simulation) | generator_fresh (the same, noised afresh at each step: DMD2's) | lead (distill.lead_model's steps)
    dmd_input: str = "data"
    lead_model: str | None = None  # dmd_input lead: the lead's run, checkpoint, pipeline or transformer folder
    dmd_time: tuple[float, ...] = (0.02, 0.98)  # the flow times the VSD loss noises the samples at (uniform)
    # how those times are drawn: uniform in flow time | karras (uniform over EDM's Karras sigmas between the range's
    # ends, as FastGen's DMD2 and SiD draw them)
    dmd_time_sampling: str = "uniform"
    # the real score's guidance scale (1: the teacher unguided, DMD2's ImageNet-64 and SiDA's); null: the teacher's
    # (distill.guidance_scale, or what it records). Recorded with the generator
    real_guidance: float | None = None
    # the real score's scale for the samples a multi-step generator makes from its grids' later start times (the
    # two-step grid's middle); null: real_guidance's. Recorded with the generator
    real_guidance_later: float | None = None
    # the scale real_guidance moves to, linearly over the first real_guidance_ramp training steps, then held (both or
    # neither; null: it stays). Recorded with the generator
    real_guidance_end: float | None = None
    real_guidance_ramp: int | None = None
    # the fake score's own guidance (SiD-LSG): the scale it is trained at through its guided prediction, and the one the
    # generator's loss reads it at (null: 1, unguided; and the training scale). Recorded with the generator
    fake_guidance: float | None = None
    fake_guidance_eval: float | None = None
    # the share of the generator's samples that start from pure noise (its grids' first time), the rest alike over the
    # later start times; null: every start time alike
    dmd_first_share: float | None = None
    vsd_weight: float = 1.0  # the VSD loss's weight; 0: the GAN term alone (a GAN fine-tune of the teacher, GDD's)
    gan_start: int = (
        0  # the step from which the GAN term and its discriminator train (SiDA: the fake score alone first)
    )
    dmd_midpoint: float = 0.5  # the two-step grid's middle flow time (every grid shifted alike; recorded)
    # the flow times the discriminator and the GAN term noise their images at ([first, last], uniform, drawn apart
    # from the VSD loss's); null: the VSD loss's own (its times and noised samples)
    gan_time: tuple[float, ...] | None = None
    # the divergence VSD follows: reverse_kl (VSD's) | js | forward_kl (f-distill: weighted by the discriminator's ratio)
    vsd_divergence: str = "reverse_kl"
    # --- the sid method (docs/objective.md#sid): DMD2's keys above, and SiD's loss in place of VSD ---
    sid_alpha: float = 1.2  # SiD's alpha: the fake score's gap weighed against the data's in its loss (SiD's 1.2)
    # --- the rcm method (docs/objective.md#rcm): trajectory distillation regularised by DMD2 in one run ---
    student_updates: int = 4  # student updates per fake-score update (rCM's 4: the fake score in 1 of 5 steps)
    vsd_start: int = 0  # the step from which the VSD term trains the student (the fake score trains from the start)
    # --- the ect method (docs/objective.md#ect): consistency post-training with a small fixed step ---
    ect_dt: float = 0.01  # the fixed step down the trajectory, in flow time, before the student's own jump
    ect_step: str = "teacher"  # the step's velocity: teacher (guided, folded in) | data (eps - x: unguided students)
    ect_dt_start: float | None = None  # ECT's curriculum: the step at the start, halved down to ect_dt (null: fixed)
    ect_dt_every: int = 1000  # the curriculum's training steps between two halvings


@dataclass
class TokenRoutingSection:
    """Token routing in training (TREAD; moh_dit/model/token_routing.py, docs/training.md#token-routing): a random
    share of each image's tokens skips a span of blocks; sampling uses every token. Off with ``share: 0``."""

    share: float = 0.0  # the share of each image's tokens that skips the span (TREAD's 0.5); 0: off
    first_block: int = 2  # the span's first block, from 0 (negative: from the end)
    last_block: int = -3  # its last block, included (negative: from the end; -1 is the last block)


@dataclass
class RepaSection:
    """REPA's representation alignment (moh_dit/training/repa.py, docs/training.md#repa); off without an encoder."""

    encoder: list[str] = field(default_factory=list)  # dinov2-vit-b (REPA's), ...; several: one projector each
    encoder_weights: list[str] = field(default_factory=list)  # one file per encoder: nothing is downloaded here
    encoder_module: str | None = None  # a module that registers encoders (torch-fidelity extractors, patch_tokens)
    encoder_resolution: int = 0  # the encoders' input size; 0: REPA's 224 * (data.image_size // 256)
    depth: int = 8  # the block, from 1, whose tokens are aligned: REPA's 8 for L/XL, 4 for B (a third of the depth)
    coeff: float = 0.5  # REPA's lambda
    projector_dim: int = 2048


def _spec_fields(**defaults: Any) -> list[tuple[str, Any, Any]]:
    """The fields of a config section that holds a :class:`SamplingSpec`: one per key of :data:`CONFIG_KEYS`, with the
    spec's default (or the section's own, ``defaults``); the mappings of options default to ``{}``."""
    signature = inspect.signature(SamplingSpec.create).parameters
    fields = []
    for key, (flat, _) in CONFIG_KEYS.items():
        if flat.endswith("_options"):
            fields.append((key, dict[str, Any], field(default_factory=dict)))
        else:
            fields.append((key, Any, field(default=defaults.get(key, signature[flat].default))))
    return fields


def _spec_section(name: str, doc: str, prefix: str, extra: list[tuple[str, Any, Any]], **defaults: Any) -> type:
    """A config section made from the spec's table (``extra``: the section's own fields first), whose ``sampling()``
    is the spec it holds, checked (an error names the key with ``prefix``)."""

    def sampling(self) -> SamplingSpec:
        return SamplingSpec.from_config(dataclasses.asdict(self), prefix=prefix)

    keys = "\n".join(f"    ``{key}``: {words}" for key, (_, words) in CONFIG_KEYS.items())
    cls = dataclasses.make_dataclass(
        name, [*extra, *_spec_fields(**defaults)], namespace={"sampling": sampling, "__doc__": f"{doc}\n\n{keys}"}
    )
    cls.__module__ = __name__
    return cls


# How the evaluations during training sample. By default the fast protocol without guidance: DiT's curves of FID against
# training steps are unguided, and 25 solver steps cost a tenth of DiT's 250.
EvalSamplingSection = _spec_section(
    "EvalSamplingSection",
    "How the evaluations during training sample (``log.eval_sampling``): the fast protocol, unguided, by default.",
    "log.eval_sampling.",
    [],
    scheduler=None,
    guidance_scale=1.0,
)


@dataclass
class LogSection:
    log_every: int = 100
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # accelerate trackers; [] for none
    project: str = "moh-dit"  # the trackers' project name (a wandb project, a TensorBoard sub-folder)
    head_usage: bool = True
    # peak TFLOP/s of one device for MFU; 0: known GPUs by name, a matmul measured at the start on a CPU
    peak_tflops: float = 0.0
    # evaluation during training (moh_dit/training/quality.py): every eval_every steps and at the end (0: off),
    # eval_samples class-balanced images of the EMA weights, sampled on every process as `moh-dit evaluate
    # --model` samples, scored (KID, FID, precision, recall, ...) against eval_reference with eval_extractor
    eval_every: int = 0
    eval_samples: int = 10_000
    eval_reference: str | None = None  # ADM reference .npz, or an .npz / folder of real images
    eval_extractor: str = "inception"  # or a torch-fidelity extractor (registered by eval_extractor_module)
    eval_extractor_weights: str | None = None  # default: $MOH_DIT_INCEPTION_WEIGHTS, then the torch hub cache
    eval_extractor_module: str | None = None
    eval_batch_size: int = 64  # images per sampling block (as evaluate's --sample-batch-size)
    # more step counts of eval_sampling's sampler scored at each evaluation (records kid@N, fid@N, ...), e.g. [2, 4]
    # for a model sampled in one step
    eval_also_steps: tuple[int, ...] = ()
    eval_keep_samples: bool = False  # keep the images (PNGs and .npz) after scoring; the scores are always kept
    # the score (kid, fid, ...; kid@2: at one of eval_also_steps) whose best evaluation's EMA weights are kept as a
    # pipeline in <run>/best (lower is better for kid, fid and sfid, higher for the rest); null: none kept. Score it
    # against a reference the final evaluation does not use (a training split: fashion-mnist-train)
    eval_keep_best: str | None = None
    eval_sampling: EvalSamplingSection = field(default_factory=EvalSamplingSection)


# The trainer's grids of EMA samples: when, how many, and how they are sampled (a SamplingSpec, which the exported
# pipeline records for sample.py and the demo).
PreviewSection = _spec_section(
    "PreviewSection",
    "The trainer's grids of EMA samples (``preview``): when, how many, and how they are sampled.",
    "preview.",
    [
        ("every", int, field(default=0)),  # > 0: save a grid every N steps (and at the end)
        ("per_class", int, field(default=4)),  # images per class row; 0: no grids, not even at the end
        ("max_classes", int, field(default=10)),
    ],
    scheduler=None,
)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    ema: EMASection = field(default_factory=EMASection)
    log: LogSection = field(default_factory=LogSection)
    preview: PreviewSection = field(default_factory=PreviewSection)
    repa: RepaSection = field(default_factory=RepaSection)
    distill: DistillSection = field(default_factory=DistillSection)
    token_routing: TokenRoutingSection = field(default_factory=TokenRoutingSection)
