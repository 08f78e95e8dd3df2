"""Gradients averaged by hand (moh_dit/training/gradients.py): each gradient once, in buckets of any size, as the
mean over processes. The real two-process run is tests/test_distributed.py's (MeanFlow's gradients against the
mean of each micro-batch's, computed by hand); here the all-reduce is a stand-in whose other process holds ones."""

import pytest
import torch

from moh_dit.training import gradients


@pytest.mark.parametrize("bucket", [10, 2**24])
def test_every_gradient_is_averaged_once_whatever_the_buckets(monkeypatch, bucket):
    monkeypatch.setattr(gradients.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(gradients.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(gradients.dist, "all_reduce", lambda t: t.add_(1.0))  # the other process's gradients: ones
    monkeypatch.setattr(gradients, "BUCKET_ELEMENTS", bucket)
    shapes = [(3, 4), (25,), (2, 2, 2), (1,), (7, 3)]  # one larger than a 10-element bucket
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes] + [torch.nn.Parameter(torch.zeros(2))]
    g = torch.Generator().manual_seed(0)
    for p in params[:-1]:
        p.grad = torch.randn(p.shape, generator=g)
    params[-1].grad = None  # a parameter without a gradient is left alone
    before = [p.grad.clone() for p in params[:-1]]
    gradients.average_gradients(params)
    for p, grad in zip(params[:-1], before):
        torch.testing.assert_close(p.grad, (grad + 1) / 2, rtol=0, atol=1e-7)
    assert params[-1].grad is None


def test_one_process_changes_nothing():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    gradients.average_gradients([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))
