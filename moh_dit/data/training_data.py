"""A run's training data from its ``data`` config section: images or pre-extracted latents, with the
batch sampler and the fingerprint that a resume checks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset, Subset

from moh_dit.data.batches import ClassDraws, class_draws, dataset_labels, subset_indices
from moh_dit.data.fashion_mnist import FashionMNIST
from moh_dit.data.image_folder import ImageFolderDataset
from moh_dit.errors import DataError
from moh_dit.vae import LatentNormalization

logger = logging.getLogger(__name__)


class DataSection(Protocol):
    """What this module reads of a run's ``data`` section (``moh_dit.training.config_sections.DataSection`` is one):
    stated here so that the data layer does not import the training layer above it."""

    name: str
    path: str | None
    image_size: int
    channels: int
    split: str
    download: bool
    random_flip: bool
    max_bad_fraction: float
    subset_per_class: int
    class_weights: Any
    vae: str


# ----------------------------------------------------------------------------------------------------
# What training reads: the data set, its classes, and the space the model works in
# ----------------------------------------------------------------------------------------------------
@dataclass
class TrainingData:
    """A training data set and what the model must know about it.

    Attributes:
        dataset: items ``(x, label)``: images in [-1, 1], or posterior moments for ``latent_input``.
        id2label: class names (empty when the data has none).
        num_classes: distinct classes of the data.
        in_channels, sample_size: the model's input (latent channels and size with a VAE).
        latent_input: items are pre-extracted posterior moments (2 flips, K, c, h, w): K = 2 (mean, std) for a
            Gaussian posterior, K = 1 (the latent) for a deterministic encoder.
        vae: the autoencoder (to encode images on the fly, and to decode previews and exported pipelines), or
            ``None`` in pixel space.
        vae_record: what identifies the autoencoder and its latent space (see :func:`moh_dit.vae.vae_record`).
        normalization: how its latents become the model's (the identity in pixel space).
        description: what identifies the data (name, fingerprint, count, preprocessing).
        draws: how often an epoch draws each class (``data.class_weights``); ``None``: every item once.
    """

    dataset: Dataset
    id2label: dict[int, str]
    num_classes: int
    in_channels: int
    sample_size: int
    latent_input: bool = False
    vae: torch.nn.Module | None = None
    vae_record: dict | None = None
    normalization: LatentNormalization = field(default_factory=LatentNormalization)
    description: dict = field(default_factory=dict)
    draws: ClassDraws | None = None

    def record(self) -> dict:
        """What a checkpoint keeps of the data: the VAE record and the class names."""
        return {"vae": self.vae_record, "id2label": {str(k): v for k, v in self.id2label.items()}}

    def loader(self, batch_sampler, num_workers: int):
        """A DataLoader over the data set in the batches of ``batch_sampler``."""
        from torch.utils.data import DataLoader

        pin = torch.cuda.is_available()
        return DataLoader(self.dataset, batch_sampler=batch_sampler, num_workers=num_workers, pin_memory=pin)

    def clean_latents(
        self, x: torch.Tensor, flip: torch.Tensor, generator: torch.Generator, device: torch.device
    ) -> torch.Tensor:
        """A micro-batch as the model's clean input x0: flipped where ``flip``, and in latent space either
        drawn from the pre-extracted posterior of that flip or encoded by the VAE and drawn from its
        posterior (the draws come from ``generator``)."""
        from moh_dit.vae import ImageSpace, sample_posterior

        if self.latent_input:  # x: (N, 2 flips, K [mean, std] or [latent], c, h, w), with the images where kept
            x = x["moments"] if isinstance(x, dict) else x
            moments = x[torch.arange(x.shape[0]), flip.long()]
            std = moments[:, 1] if moments.shape[1] == 2 else None
            return sample_posterior(moments[:, 0], std, self.normalization, generator).to(device)
        x = torch.where(flip[:, None, None, None], x.flip(-1), x).to(device)
        return ImageSpace(self.vae).encode(x, generator, device)

    def encoder_images(self, x: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """The clean images of a micro-batch as uint8 (N, C, H, W), flipped where the model's input is: what REPA's
        encoders see. Images in [-1, 1] are the data's uint8 values exactly (``u / 127.5 - 1``)."""
        if self.latent_input:
            if not isinstance(x, dict):
                raise DataError(
                    "REPA's encoders need the images the latents were made from: extract the latents with `moh-dit "
                    "latents --keep-images`"
                )
            images = x["images"]
            return torch.where(flip[:, None, None, None], images.flip(-1), images)
        images = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return ((images.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


def build_dataset(section: DataSection) -> Dataset:
    """The data set named by a config's ``data`` section (without subsetting)."""
    from moh_dit.data.latent_dataset import LatentDataset

    if section.name == "fashion-mnist":
        return FashionMNIST(
            section.path,
            split=section.split,
            image_size=section.image_size,
            channels=section.channels,
            download=section.download,
        )
    if not section.path:
        what = (
            "a folder with one sub-folder per class"
            if section.name == "folder"
            else "a file written by `moh-dit latents`"
        )
        raise DataError(f"data.name={section.name} needs data.path ({what})")
    if section.name == "folder":
        return ImageFolderDataset(
            section.path, section.image_size, channels=section.channels, max_bad_fraction=section.max_bad_fraction
        )
    return LatentDataset(section.path)


def load_training_data(section: DataSection, device: str | torch.device = "cpu") -> TrainingData:
    """Read the data set, resolve the space the model works in (:func:`load_data_space`) and how often
    each class is drawn (``data.class_weights``, :func:`class_draws`)."""
    data = load_data_space(section, device)
    draws = class_draws(section.class_weights, dataset_labels(data.dataset), data.id2label)
    if draws is None:
        return data
    shares = ", ".join(
        f"{data.id2label.get(c, c)} {share:.1%}" for c, share in draws.shares().items() if draws.weights[c] != 1
    )
    logger.info("class weights: %d draws per epoch from %d items; %s", draws.epoch_size, len(data.dataset), shares)
    # the weights by class id, so that a name and its id (or "balanced" and its numbers) record alike
    described = dict(data.description, class_weights={str(c): w for c, w in sorted(draws.weights.items())})
    return dataclasses.replace(data, draws=draws, description=described)


def load_data_space(section: DataSection, device: str | torch.device = "cpu") -> TrainingData:
    """Read the data set and resolve the space the model works in.

    Pixel space (``data.vae=none``): the images themselves. With a VAE: images are encoded on the fly,
    and the VAE must load now (it is needed for previews and the exported pipeline; finding out after days
    of training would be too late). Pre-extracted latents: the VAE recorded in the latent file's manifest
    is authoritative; ``data.vae`` may only name the same VAE (the same path or hub id, or a copy with the
    same weights), anything else is an error.
    """
    from moh_dit.data.latent_dataset import LatentDataset
    from moh_dit.vae import check_vae, load_vae, resolve_vae_spec, vae_record

    base = build_dataset(section)
    if section.name == "fashion-mnist" and section.random_flip:
        # DiT's flips suit photos; in this catalogue every shoe points the same way, and a model trained
        # with flips draws half of them mirrored (experiments/results/default/flip_floor.md)
        logger.warning(
            "data.random_flip=true on Fashion-MNIST: its shoes all point one way, so the model will draw "
            "half of them mirrored; set data.random_flip=false unless that is what you want"
        )
    described = base.describe()
    dataset: Dataset = base
    if section.subset_per_class > 0:
        dataset = Subset(base, subset_indices(base.targets, section.subset_per_class))
        described = dict(described, subset_per_class=section.subset_per_class, count=len(dataset))
    id2label = dict(base.id2label)
    num_classes = len(id2label) if id2label else len(set(base.targets))
    if isinstance(base, LatentDataset):
        # the run records data.image_size and data.channels; they must say what the latents were made from
        made = {"image_size": base.meta.get("image_size"), "channels": base.meta.get("image_channels")}
        wrong = [f"data.{k}={v}" for k, v in made.items() if v is not None and getattr(section, k) != v]
        if wrong:
            asked = ", ".join(f"data.{k}={getattr(section, k)}" for k in made)
            raise DataError(
                f"the latents in {base.path} were extracted from {made['image_size']} px images with "
                f"{made['channels']} channels, not {asked}: set {' '.join(wrong)}, or extract latents to match"
            )
        record = base.vae
        wanted = resolve_vae_spec(section.vae)
        if wanted is not None and wanted != record.get("spec"):
            # another name for the recorded VAE is fine (a copy in another folder, a cached hub id), as long
            # as it is the same VAE; never fetched from the network just to find out it is not
            try:
                vae = load_vae(wanted, device=device, local_only=True)
            except DataError:
                raise DataError(
                    f"data.vae={section.vae} differs from the VAE recorded with the latents "
                    f"({record.get('spec')}) and is not available locally to compare: set data.vae=none "
                    f"to use the recorded one"
                ) from None
            check_vae(vae, wanted, record, f"the latents {base.path}")
            spec = wanted
        else:
            spec = record.get("spec")
            if spec is None:
                raise DataError(f"the latents in {base.path} record no VAE; extract them again")
            try:
                vae = load_vae(spec, device=device)
            except DataError as err:
                raise DataError(
                    f"{err} (the VAE the latents {base.path} were made with): pass it, or a copy, as data.vae"
                ) from None
            check_vae(vae, spec, record, f"the latents {base.path}")
        c, size = base.latent_shape[0], base.latent_shape[-1]
        return TrainingData(
            dataset,
            id2label,
            num_classes,
            c,
            size,
            True,
            vae,
            dict(record, spec=spec),
            LatentNormalization.of(record),
            described,
        )
    vae = load_vae(section.vae, device=device)
    if vae is None:
        return TrainingData(
            dataset, id2label, num_classes, section.channels, section.image_size, description=described
        )
    record = vae_record(vae, section.vae)
    factor = record["downsample_factor"]
    if vae.config.in_channels != section.channels:
        raise DataError(
            f"data.vae takes {vae.config.in_channels}-channel images but data.channels={section.channels}: set "
            f"data.channels={vae.config.in_channels} (grayscale is repeated)"
        )
    if section.image_size % factor:
        raise DataError(
            f"data.image_size={section.image_size} is not divisible by the VAE's downsampling factor {factor}"
        )
    return TrainingData(
        dataset,
        id2label,
        num_classes,
        record["latent_channels"],
        section.image_size // factor,
        False,
        vae,
        record,
        LatentNormalization.of(record),
        described,
    )
