"""Small deterministic networks called as a MoHDiT (``net(z, times, y, force_drop_ids=...)``): fixtures of the
distillation's records (tests/reference_outputs/record_fastgen.py) and tests. Smooth in every input, so that a finite
difference and a JVP of them agree."""

import torch
from torch import nn

from moh_dit.model.network import MoHDiTOutput

CLASSES = 3  # and the null class, index 3


class ToyAverageVelocity(nn.Module):
    """``u(z, (t, h), y) = conv(z) (1 + a t) + tanh(b h) + e_y``: a student's average velocity (times ``t`` and
    ``h = t - r``)."""

    projectors = None
    null_class_id = CLASSES

    def __init__(self, channels: int = 2, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        with torch.no_grad():
            for p in self.conv.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        self.a = nn.Parameter(torch.randn(channels, generator=g))
        self.b = nn.Parameter(torch.randn(channels, generator=g))
        self.embedding = nn.Parameter(0.5 * torch.randn(CLASSES + 1, channels, generator=g))

    def forward(self, z, times, y=None, force_drop_ids=None, **_):
        t, h = (torch.as_tensor(s, dtype=z.dtype).expand(z.shape[0]) for s in times)
        shape = (-1, 1, 1, 1)
        u = self.conv(z) * (1 + t.reshape(shape) * self.a.reshape(1, -1, 1, 1).to(z.dtype))
        u = u + torch.tanh(h.reshape(shape) * self.b.reshape(1, -1, 1, 1).to(z.dtype))
        if y is not None:
            u = u + self.embedding.to(z.dtype)[y].reshape(z.shape[0], -1, 1, 1)
        return MoHDiTOutput(sample=u, aux_loss=z.new_zeros(()))


class ToyTeacher(nn.Module):
    """``v(z, t, y) = conv(z) (1 + a t) + e_y``: a teacher's velocity of the linear path, conditional on the class
    (index 3: the null class)."""

    def __init__(self, channels: int = 2, seed: int = 1) -> None:
        super().__init__()
        self.inner = ToyAverageVelocity(channels, seed)

    def forward(self, z, t, y):
        return self.inner(z, (t, torch.zeros_like(t)), y).sample
