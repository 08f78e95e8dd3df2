"""Which torch device a user's ``--device`` means, checked before anything is loaded."""

from __future__ import annotations


def resolve_device(spec: str | None):
    """``None`` -> CUDA when available, else CPU; an explicit device must exist on this machine."""
    import torch

    from moh_dit.errors import ConfigError

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"--device {spec!r} is not a device name (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {spec}: no CUDA GPU is available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {spec}: MPS is not available on this machine")
    return device
