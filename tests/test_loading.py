"""Every wrapper that turns a loader's failure into "the file is damaged" blames the file only for what the file
caused: a header or format error, a short read, pickled code. A bug (a wrong argument, a TypeError deep in a
library) or a lack of memory propagates as itself, with its traceback. Device names are the caller's: every
load path reads on the CPU and takes any device torch accepts."""

import pickle

import pytest
import torch
from safetensors.torch import save_file

from moh_dit.errors import ArtifactError, ConversionError, DataError, EvaluationError, MohDitError, raised_by_the_file
from moh_dit.files import read_safetensors, read_torch_file


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def wrapped_bug(wrapper=OSError):
    """What diffusers does with a bug inside its loader: a new ``wrapper`` error raised while handling it."""

    def load(*args, **kwargs):
        try:
            raise TypeError("a bug inside the loader")
        except TypeError:
            raise wrapper("Unable to load weights from checkpoint file") from None

    return load


def raises(exc):
    def load(*args, **kwargs):
        raise exc

    return load


def test_only_what_a_file_can_cause_is_blamed_on_it():
    assert raised_by_the_file(OSError("truncated"))
    assert not raised_by_the_file(TypeError("bug"))
    assert not raised_by_the_file(torch.OutOfMemoryError("CUDA out of memory"))
    assert not raised_by_the_file(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    try:
        wrapped_bug()()
    except OSError as err:  # the wrapper hides the bug's type; its context still names it
        assert err.__cause__ is None and isinstance(err.__context__, TypeError)
        assert not raised_by_the_file(err)


def test_safetensors_load_on_any_device_name_torch_accepts(tmp_path):
    save_file({"w": torch.arange(3.0)}, tmp_path / "w.safetensors")
    for device in ("cpu", torch.device("cpu"), torch.device("cpu", 0), "cpu:0"):  # accelerate hands out cpu:0
        assert torch.equal(read_safetensors(tmp_path / "w.safetensors", device)["w"], torch.arange(3.0))
    with pytest.raises(RuntimeError, match="device"):  # a bad name is the caller's bug, not a damaged file
        read_safetensors(tmp_path / "w.safetensors", "no-such-device")


def test_damaged_files_are_blamed_and_bugs_are_not(tmp_path, monkeypatch):
    save_file({"w": torch.ones(4)}, tmp_path / "ok.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "ok.safetensors").read_bytes()[:30])
    with pytest.raises(ArtifactError, match="cut.safetensors is damaged"):
        read_safetensors(tmp_path / "cut.safetensors")
    torch.save({"w": torch.ones(4)}, tmp_path / "ok.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:100])
    (tmp_path / "empty.pt").write_bytes(b"")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    for name in ("cut.pt", "empty.pt", "evil.pt"):
        with pytest.raises(ArtifactError, match=f"{name} is damaged or not a plain tensor file"):
            read_torch_file(tmp_path / name)

    import safetensors.torch

    for bug in (TypeError("a bug"), torch.OutOfMemoryError("out of memory")):
        monkeypatch.setattr(safetensors.torch, "load_file", raises(bug))
        with pytest.raises(type(bug)):
            read_safetensors(tmp_path / "ok.safetensors")
        monkeypatch.setattr(torch, "load", raises(bug))
        with pytest.raises(type(bug)):
            read_torch_file(tmp_path / "ok.pt")


def test_the_wrappers_of_every_loader_let_bugs_through(tmp_path, monkeypatch):
    """Each place that says "damaged" or "cannot be loaded" about a user's file, given a file that is fine and a
    loader with a bug in it: the bug comes out, not a one-line claim about the file."""
    from diffusers import AutoencoderKL

    from moh_dit.evaluation.features import check_plain_tensor_file
    from moh_dit.interop.official import read_checkpoint
    from moh_dit.model.network import MoHDiT
    from moh_dit.sampling import loading as generate
    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.vae import load_vae

    from .helpers.factories import tiny_model, tiny_pipeline, tiny_vae

    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    tiny_vae().save_pretrained(tmp_path / "vae")
    tiny_model().save_pretrained(tmp_path / "transformer")
    tiny_pipeline().save(tmp_path / "pipe", {"test": True})
    # the files load (the wrappers are not in the way of good files)
    assert read_checkpoint(tmp_path / "w.pt")[1] == "state dict" and check_plain_tensor_file(tmp_path / "w.pt")
    assert load_vae(str(tmp_path / "vae")) is not None and generate.load_pipeline(tmp_path / "pipe", "cpu")

    monkeypatch.setattr(torch, "load", raises(TypeError("a bug in torch.load")))
    for call in (lambda: read_checkpoint(tmp_path / "w.pt"), lambda: check_plain_tensor_file(tmp_path / "w.pt")):
        with pytest.raises(TypeError, match="a bug in torch.load"):
            call()
    monkeypatch.setattr(AutoencoderKL, "from_pretrained", wrapped_bug())
    with pytest.raises(OSError) as caught:
        load_vae(str(tmp_path / "vae"))
    assert not isinstance(caught.value, MohDitError)
    monkeypatch.setattr(MoHDiT, "from_pretrained", wrapped_bug(ValueError))
    with pytest.raises(ValueError) as caught:
        generate.load_transformer(tmp_path / "transformer")
    assert not isinstance(caught.value, MohDitError)
    monkeypatch.setattr(MoHDiTPipeline, "from_pretrained", wrapped_bug())
    with pytest.raises(OSError) as caught:
        generate.load_pipeline(tmp_path / "pipe", "cpu")
    assert not isinstance(caught.value, MohDitError)

    # and the same wrappers still blame a file that is damaged
    monkeypatch.undo()
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(DataError, match="not a readable diffusers autoencoder"):
        load_vae(str(tmp_path / "vae"))
    (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ArtifactError, match="cannot be loaded"):
        generate.load_transformer(tmp_path / "transformer")
    (tmp_path / "w.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(ConversionError, match="refusing to unpickle"):
        read_checkpoint(tmp_path / "w.pt")
    with pytest.raises(EvaluationError, match="refusing to unpickle"):
        check_plain_tensor_file(tmp_path / "w.pt")
