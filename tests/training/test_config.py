"""Config files and overrides: strict keys, typed values, base files, the shipped configs."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from moh_dit.errors import ConfigError
from moh_dit.model.presets import PRESETS, preset_config
from moh_dit.training.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
# the runnable targets, and the frozen recipes the experiments cite
CONFIGS = sorted([*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "experiments" / "configs").glob("*.yaml")])
TRAIN_CONFIGS = [p for p in CONFIGS if "accelerate" not in p.parts]


def test_defaults_and_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "train.max_steps=12",
            "optim.lr=3e-4",
            "data.vae=none",
            "model.overrides.num_classes=7",
            "optim.betas=[0.9, 0.95]",
        ],
    )
    assert isinstance(cfg, Config)
    assert cfg.train.max_steps == 12 and cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model.overrides == {"num_classes": 7} and cfg.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_stepz=3", "train.max_stepz"),
        ("trian.max_steps=3", "trian"),
        ("model.overrides.num_head=3", "num_head"),
        ("train.mixed_precision=fp8", "mixed_precision"),
        ("data.name=imagenet", "data.name"),
        ("train.global_batch_size=0", "global_batch_size"),
        ("no_equals_sign", "section.key=value"),
        ("train.snr_gamma=0", "train.snr_gamma must be a number > 0"),
        ("train.snr_gamma=nan", "train.snr_gamma must be a number > 0"),
        ("preview.guidance_interval=[600,100]", r"preview.guidance_interval must be two timesteps"),
        ("preview.guidance_interval=[0,1000]", r"0 <= first <= last < 1000"),
        ("preview.grid_averaging=1000", r"preview.grid_averaging must be a timestep between 0 and 999"),
        ("preview.grid_averaging=[100]", r"preview.grid_averaging must be a timestep"),
        ("model.init_from=x model.overrides.num_head=3", "num_head"),  # checked with init_from too
        ("data.split=val", "data.split"),
        ("data.name=folder data.split=test", "data.split and data.download apply to data.name=fashion-mnist"),
        ("data.name=latents data.download=true", "apply to data.name=fashion-mnist, not latents"),
    ],
)
def test_bad_keys_and_values_are_rejected(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, override.split(" "))


@pytest.mark.parametrize(
    "value,message",
    [
        ("{Sandal: 0}", r"class_weights\['Sandal'\] must be a finite number > 0, got 0"),
        ("{Sandal: -1}", "must be a finite number > 0"),
        ("{Sandal: .nan}", "must be a finite number > 0"),
        ("{Sandal: two}", "must be a finite number > 0, got 'two'"),
        ("{Sandal:2}", "needs a space after the colon"),
        ("[Sandal, Bag]", "must be a mapping such as"),
        ("even", "must be a mapping such as .* or 'balanced'"),
    ],
)
def test_bad_class_weights_are_rejected_when_the_config_is_read(value, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [f"data.class_weights={value}"])
    assert load_config(None, ["data.class_weights={Sandal: 2, 8: 1.5}"]).data.class_weights == {"Sandal": 2, 8: 1.5}
    assert load_config(None, ["data.class_weights=balanced"]).data.class_weights == "balanced"


def test_base_file_is_merged(tmp_path):
    (tmp_path / "base.yaml").write_text("train:\n  max_steps: 5\n  seed: 3\noptim:\n  lr: 0.5\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain:\n  max_steps: 9\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.train.max_steps, cfg.train.seed, cfg.optim.lr) == (9, 3, 0.5)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="loop"):
        load_config(tmp_path / "loop.yaml")


def test_configs_as_dicts_and_the_preset_checked_when_read(tmp_path):
    (tmp_path / "base.yaml").write_text("train:\n  max_steps: 5\n")
    cfg = load_config(
        {"base": str(tmp_path / "base.yaml"), "model": {"overrides": {"hidden_size": 32}}}, ["train.seed=4"]
    )
    assert (cfg.train.max_steps, cfg.train.seed, cfg.model.overrides) == (5, 4, {"hidden_size": 32})
    source = {"model": {"preset": "MoH-DiT-Ti/4-75"}}
    load_config(source)
    assert source == {"model": {"preset": "MoH-DiT-Ti/4-75"}}  # not modified
    with pytest.raises(ConfigError, match="unknown preset 'MoH-DiT-Tiny'"):
        load_config({"model": {"preset": "MoH-DiT-Tiny"}})
    with pytest.raises(ConfigError, match="num_heads .* num_shared_heads .* top_k"):
        load_config({"model": {"preset": "MoH-DiT-S/2-75", "overrides": {"depth": 3}}})


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/does-not-exist.yaml")


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_name_real_presets(path):
    cfg = load_config(path)
    assert cfg.model.preset in PRESETS


def test_every_paper_preset_has_an_imagenet_config():
    names = {load_config(p).model.preset for p in TRAIN_CONFIGS if "imagenet256" in p.parts}
    wanted = {n for n in PRESETS if n.startswith("MoH-DiT-") and "Ti" not in n}
    wanted |= {"DiT-S/2", "DiT-B/2", "DiT-L/2", "DiT-XL/2"}
    assert wanted <= names


@pytest.mark.parametrize(
    "override", ["train.max_steps=abc", "train.compile=maybe", "optim.lr=fast", "train.max_steps=1.5"]
)
def test_wrongly_typed_values_are_rejected(override):
    with pytest.raises(ValueError, match="must be a"):
        load_config(None, [override])


def test_preview_keys_of_moh_dit_0_2_still_load_where_they_live_now(caplog):
    old = ["log.sample_every=5", "log.sample_cfg_scale=2.5", "log.sample_guidance_interval=[100,600]"]
    with caplog.at_level("WARNING", logger="moh_dit"):
        config = load_config(None, [*old, "log.sample_steps=7", "log.sample_scheduler=ddim"])
    assert "log.sample_cfg_scale -> preview.guidance_scale" in caplog.text
    assert (config.preview.every, config.preview.num_steps) == (5, 7)
    spec = config.preview.sampling()
    assert (spec.sampler.scheduler, spec.guidance.scale, spec.guidance.interval) == ("ddim", 2.5, (100, 600))
    with pytest.raises(ConfigError, match="log.sample_cfg_scale and preview.guidance_scale are the same setting"):
        load_config(None, ["log.sample_cfg_scale=2", "preview.guidance_scale=3"])


def test_print_config_prints_the_resolved_config_and_trains_nothing(tmp_path, capsys):
    import yaml

    from moh_dit.cli.train import main

    out = tmp_path / "run"
    main(["--config", str(ROOT / "configs" / "fashion_mnist_moh.yaml"), f"train.output_dir={out}", "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["output_dir"] == str(out) and printed["preview"]["guidance_interval"] == [100, 500]
    assert load_config(printed).preview == load_config(ROOT / "configs" / "fashion_mnist_moh.yaml").preview
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------
# The objective section
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["objective.name=diffusion"], "unknown objective 'diffusion'; choose one of ddpm, flow"),
        (["objective.path=gvp"], "objective.path applies to the flow objective; this run trains ddpm"),
        (["objective.time_sampling=logit-normal"], "objective.time_sampling applies to the flow objective"),
        (
            ["objective.name=flow", "train.snr_gamma=5"],
            "train.snr_gamma applies to the ddpm objective; this run trains flow",
        ),
        (["objective.name=flow", "objective.path=vp"], "objective.path must be one of linear, gvp"),
        (["objective.name=flow", "objective.convention=edm"], "convention must be one of moh-dit, repa, sit"),
        (["objective.name=flow", "objective.time_std=0"], "time_std > 0"),
        (
            ["objective.name=flow", "preview.scheduler=ddpm"],
            "preview.scheduler 'ddpm' samples ddpm models; this is a flow",
        ),
        (
            [
                "objective.name=flow",
                "log.eval_sampling.scheduler=ddim",
                "log.eval_every=5",
                "log.eval_reference=r.npz",
            ],
            "log.eval_sampling.scheduler 'ddim' samples ddpm",
        ),
        (["preview.scheduler=sde"], "preview.scheduler 'sde' samples flow models; this is a ddpm model"),
        (["objective.name=flow", "model.overrides.learn_sigma=true"], "learn_sigma=True: flow matching"),
        (["model.overrides.objective={name: flow}"], "the objective section says what the model learns"),
        (["objective.name=flow", "objective.path=gvp", "preview.scheduler=dpm-solver"], "linear path only"),
        (["preview.time_shift=0"], "preview.time_shift must be a finite number > 0"),
        (["preview.guidance_noise=[5, 1]"], "preview.guidance_noise must be two noise levels"),
        (["preview.guidance_noise=[0.3, 5]", "preview.guidance_interval=[100, 500]"], "give one"),
    ],
)
def test_objective_keys_are_checked_when_the_config_is_read(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, [*overrides, "model.preset=DiT-Ti/4"])


def test_unset_samplers_resolve_for_the_objective_and_a_part_that_is_off_is_not_checked():
    from moh_dit.objectives.flow import Flow
    from moh_dit.training.objective import run_sampling

    gvp = load_config(ROOT / "configs" / "fashion_mnist_moh_flow.yaml", ["objective.path=gvp"])
    assert gvp.preview.scheduler is None and gvp.log.eval_sampling.scheduler is None
    assert run_sampling(gvp.preview.sampling(), Flow("gvp")).sampler.scheduler == "euler"  # DPM-Solver++ needs linear
    assert run_sampling(gvp.preview.sampling(), Flow()).sampler.scheduler == "dpm-solver"
    assert run_sampling(gvp.preview.sampling().replace(scheduler="heun"), Flow("gvp")).sampler.scheduler == "heun"
    # evaluation is off: its sampler is not checked against the objective (it never runs)
    load_config(None, ["objective.name=flow", "log.eval_sampling.scheduler=ddim", "model.preset=DiT-Ti/4"])


def test_the_flow_twins_train_flow_and_keep_the_defaults_recipe():
    default = load_config(ROOT / "configs" / "fashion_mnist_moh.yaml")
    flow = load_config(ROOT / "configs" / "fashion_mnist_moh_flow.yaml")
    assert (flow.objective.name, default.objective.name) == ("flow", None) and flow.train.snr_gamma is None
    for section in ("model", "data", "optim", "ema", "preview"):
        assert getattr(flow, section) == getattr(default, section), section
    same = {k: v for k, v in vars(flow.train).items() if k not in ("output_dir", "snr_gamma")}
    assert same == {k: v for k, v in vars(default.train).items() if k not in ("output_dir", "snr_gamma")}
    assert load_config(ROOT / "configs" / "fashion_mnist_dit_flow.yaml").model.preset == "DiT-Ti/4"
    for preset in PRESETS:
        if preset.endswith(("/2", "/2-90", "/2-75")) and "Ti" not in preset:
            name = "flow-" + preset.lower().replace("/", "-")
            config = load_config(ROOT / "configs" / "imagenet256" / f"{name}.yaml")
            assert config.model.preset == preset and config.objective.name == "flow" and config.optim.lr == 1e-4


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "imagenet512").glob("dcae-*.yaml")), ids=lambda p: p.name)
def test_imagenet512_dc_ae_configs_give_the_token_counts_they_state(path):
    """Each DC-AE f32c32 config on the latent grid its autoencoder gives at 512 px (16 x 16 x 32, from the
    AutoencoderDC config's six encoder levels): the patch size divides it, and the tokens are those its comment says."""
    from moh_dit.training.setup import _check_patch_grid, describe_tokens
    from moh_dit.vae import latent_space

    config = load_config(path)
    dc_ae = {"_class_name": "AutoencoderDC", "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024]}
    space = latent_space(dc_ae | {"latent_channels": 32, "scaling_factor": 0.5})
    grid = config.data.image_size // space["downsample_factor"]
    model = preset_config(
        config.model.preset, in_channels=32, sample_size=grid, num_classes=1000, **config.model.overrides
    )
    data = SimpleNamespace(vae_record=space)
    _check_patch_grid(config.model.preset, model, data)
    stated = int(re.search(r"(\d+) tokens per image", path.read_text())[1])
    assert describe_tokens(model, space).startswith(f"{stated} tokens per image: 32 x 16 x 16 AutoencoderDC latents")
    assert stated == (16 // model["patch_size"]) ** 2


def test_a_patch_size_that_does_not_divide_the_latent_grid_is_a_clear_error():
    from moh_dit.training.setup import _check_patch_grid

    space = {"kind": "AutoencoderDC", "downsample_factor": 32}
    model = preset_config("DiT-XL/4", in_channels=32, sample_size=6, num_classes=10)  # 192 px: a 6 x 6 grid
    with pytest.raises(ConfigError, match=r"DiT-XL/4's patch size 4 does not divide the 6 x 6 latent grid of the "):
        _check_patch_grid("DiT-XL/4", model, SimpleNamespace(vae_record=space))


def test_block_options_are_checked_with_the_rest_of_the_config_before_any_data():
    """A typo in the block's options stops when the config is read (``--print-config`` too), not when the model is
    built after the data has loaded; with ``init_from`` as well."""
    with pytest.raises(ConfigError, match="model.overrides.block mlp must be one of gelu, swiglu, got 'swigl'"):
        load_config(None, ["model.overrides.block={mlp: swigl}"])
    with pytest.raises(ConfigError, match=r"model.overrides.block: unknown block options \['bogus'\]"):
        load_config(None, ["model.init_from=runs/x", "model.overrides.block={bogus: 1}"])
    assert load_config(None, ["model.overrides.block={mlp: swiglu}"]).model.overrides["block"] == {"mlp": "swiglu"}


def _imagenet_runs() -> dict[str, Path]:
    """The run folder each ImageNet 256 training config writes, and the config."""
    configs = [
        p for p in (ROOT / "configs" / "imagenet256").glob("*.yaml") if not p.name.startswith(("distill-", "dmd2-"))
    ]
    return {load_config(p).train.output_dir: p for p in configs if "base" not in p.name}


@pytest.mark.parametrize(
    "path",
    sorted(
        [
            *(ROOT / "configs" / "imagenet256").glob("distill-*.yaml"),
            *(ROOT / "configs" / "imagenet256").glob("dmd2-*.yaml"),
        ]
    ),
    ids=lambda p: p.name,
)
def test_imagenet_distillation_configs_distil_the_run_their_base_config_trains(path):
    """Each ImageNet distillation names as its teacher a run an ImageNet config trains (or a checkpoint file in a
    format convert reads), keeps the model and data of the config it builds on, trains a fraction of its teacher's
    steps, and previews and evaluates in one step without guidance (scoring 2 and 4 beside it); a MeanFlow one takes
    finite differences and splits fewer blocks than the model has, a trajectory one records its student's times."""
    import yaml

    config = load_config(path)
    base = load_config(path.parent / yaml.safe_load(path.read_text())["base"])
    assert config.objective.name == "distill" and (config.model, config.data) == (base.model, base.data)
    if config.distill.teacher.endswith(".pt"):
        assert config.distill.teacher_format in ("sit", "repa", "lightningdit")
        teacher_steps = base.train.max_steps
    else:
        runs = _imagenet_runs()
        assert config.distill.teacher in runs, config.distill.teacher
        teacher_steps = load_config(runs[config.distill.teacher]).train.max_steps
    if config.distill.method == "meanflow":
        assert config.distill.derivative == "finite-difference"
        assert 0 < config.distill.end_time_blocks < preset_config(config.model.preset)["depth"]
    elif config.distill.method == "trajectory":
        assert {1, 2, 4} <= set(config.distill.grid_steps) and config.distill.trajectory_count >= 10_000
    assert config.distill.guidance_scale > 1 and config.train.max_steps <= teacher_steps / 2
    for spec in (config.log.eval_sampling.sampling(), config.preview.sampling()):
        assert spec.sampler.num_steps == 1 and spec.guidance.scale == 1.0 and spec.sampler.time_shift == 1.0
    assert config.log.eval_sampling.scheduler == "meanflow" and tuple(config.log.eval_also_steps)[0] == 2


@pytest.mark.parametrize(
    "name",
    [
        "fashion_mnist_moh_tread.yaml",
        "fashion_mnist_moh_mg.yaml",
        "fashion_mnist_moh_flow_mg.yaml",
        "fashion_mnist_moh_modern_tread_mg.yaml",
    ],
)
def test_the_efficiency_twins_train_and_record_what_they_turn_on(name, tmp_path, image_dir):
    """Each twin with no other override than the tiny data and size: routing on in training, guidance folded in and
    recorded (so that sampling defaults to one evaluation per step)."""
    from moh_dit.training.trainer import Trainer

    from ..helpers.factories import as_overrides, tiny_train_config

    tiny = tiny_train_config(tmp_path / "run", image_dir)
    overrides = [*as_overrides({k: tiny[k] for k in ("data", "train")}), "model.overrides.hidden_size=32",
                 "model.overrides.head_dim=8", "model.overrides.patch_size=2", "train.max_steps=2", "preview.per_class=0",
                 "log.trackers=[]", "objective.guidance_warmup=0"]  # fmt: skip
    config = load_config(ROOT / "configs" / name, overrides)
    trainer = Trainer(config)
    trainer.run()
    routed = "tread" in name
    assert (trainer.route_span is not None) is routed
    recorded = trainer.unwrapped.config.objective or {}
    assert (recorded.get("guidance_scale") == 4.0) is ("mg" in name)


def test_a_folded_guidance_run_shorter_than_its_warmup_says_so_before_training_and_its_card_says_whether_it_folded(
    tmp_path, image_dir, caplog
):
    """configs/fashion_mnist_moh_mg.yaml for fewer steps than its warm-up never folded its guidance in, yet recorded it
    and sampled unguided without a word: the log says so before training and the card says it was not folded in (a
    first leg of a run to resume later is allowed); a run that folds records from which step."""
    import logging

    from moh_dit.training.trainer import train

    from ..helpers.factories import as_overrides, tiny_train_config

    tiny = tiny_train_config(tmp_path / "run", image_dir)
    overrides = [*as_overrides({k: tiny[k] for k in ("data", "train", "model")}), "train.max_steps=3",
                 "preview.per_class=0", "log.trackers=[]"]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        short = train(load_config(ROOT / "configs" / "fashion_mnist_moh_mg.yaml", overrides))
    assert "objective.guidance_warmup=1000 is not shorter than train.max_steps=3" in caplog.text
    assert "| guidance folded in | **no**: training stopped at step 3" in (short["pipeline"] / "README.md").read_text()
    overrides = [*overrides, f"train.output_dir={tmp_path / 'folds'}", "objective.guidance_warmup=1"]
    summary = train(load_config(ROOT / "configs" / "fashion_mnist_moh_mg.yaml", overrides))
    assert "| guidance folded in | from step 1 |" in (summary["pipeline"] / "README.md").read_text()


def test_a_card_says_when_a_run_stopped_before_its_guidance_was_folded_in():
    from moh_dit.sampling.card import _folded_row

    assert _folded_row({"from_step": None, "warmup": 1000}, 40)[0].startswith("| guidance folded in | **no**: ")
    assert _folded_row(None, 40) == []


def test_an_unknown_key_is_answered_with_its_nearest_and_only_then_with_the_sections_keys():
    """An unknown key listed every valid key on one line; a typo now gets its nearest key, and a key with none the
    keys of its own section."""
    with pytest.raises(
        ConfigError, match=r"^unknown config keys train\.max_stpes \(did you mean train\.max_steps\?\)$"
    ):
        load_config(None, ["train.max_stpes=3"])
    with pytest.raises(ConfigError, match=r"unknown config keys train\.zzz; train's keys: output_dir, "):
        load_config(None, ["train.zzz=3"])


def test_another_method_by_override_on_a_config_of_one_says_where_its_keys_came_from_and_which_config_to_use():
    """configs/fashion_mnist_moh_distill.yaml distill.method=trajectory: the config wrote the MeanFlow keys, not the
    user; the message says so and names the shipped config of that method."""
    from pathlib import Path

    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError) as caught:
        load_config(root / "configs" / "fashion_mnist_moh_distill.yaml", ["distill.method=trajectory"])
    said = str(caught.value)
    assert "fashion_mnist_moh_distill.yaml sets distill.derivative, distill.loss" in said
    assert "(written for distill.method=meanflow)" in said and "\n" not in said
    assert "start from a config of trajectory instead (configs/fashion_mnist_moh_distill_trajectory.yaml" in said
    with pytest.raises(ConfigError, match=r"the overrides give distill.fake_updates"):
        load_config(
            root / "configs" / "fashion_mnist_moh_distill.yaml",
            ["distill.method=trajectory", "distill.fake_updates=2"],
        )
