"""Checkpoint surgery (moh_dit/model/surgery.py): a learned-sigma DiT's output layer cut to its noise channels."""

import torch

from moh_dit.model.surgery import first_output_channels

from ..helpers.factories import tiny_model


def test_the_output_layer_cut_to_the_noise_channels_predicts_the_noise_of_the_whole_model():
    """The rows of the first C of 2C channels at every patch position (the channel varies fastest): a model without
    the variance, given the cut layer and every other tensor, outputs the full model's first C channels."""
    full = tiny_model(signal=0.3, learn_sigma=True).eval()
    noise_only = tiny_model(learn_sigma=False).eval()
    state = full.state_dict()
    cut = first_output_channels(state, noise_only.final_layer.linear, full.out_channels)
    assert set(cut) == {"final_layer.linear.weight", "final_layer.linear.bias"}
    noise_only.load_state_dict(state | cut)
    x = torch.randn(2, full.in_channels, full.config.sample_size, full.config.sample_size)
    t, y = torch.tensor([10.0, 500.0]), torch.tensor([0, 1])
    with torch.no_grad():
        torch.testing.assert_close(noise_only(x, t, y).sample, full(x, t, y).sample[:, : full.in_channels])
    assert first_output_channels(noise_only.state_dict(), noise_only.final_layer.linear, 3) == {}  # fits already
