"""Noise levels shared by the objectives: DiT's schedule in sigma, flow times in sigma, both ways."""

import math

import numpy as np
import pytest

from moh_dit.objectives.noise import ddpm_sigma, ddpm_timestep, flow_sigma, flow_time


def test_dit_timesteps_match_their_noise_levels_from_the_schedule():
    betas = np.linspace(1e-4, 0.02, 1000, dtype=np.float64)
    abar = np.cumprod(1 - betas)
    for t in (0, 1, 100, 426, 999):
        assert ddpm_sigma(t) == pytest.approx(math.sqrt((1 - abar[t]) / abar[t]), rel=1e-12)
    assert ddpm_sigma(100.5) == pytest.approx((ddpm_sigma(100) + ddpm_sigma(101)) / 2)
    with pytest.raises(ValueError, match="between 0 and 999"):
        ddpm_sigma(1000)


def test_a_flow_time_at_the_noise_level_of_a_ddpm_timestep():
    # the same signal to noise ratio: DDPM t -> linear flow time s = sigma / (1 + sigma)
    expected = {0: 0.0099, 100: 0.255, 250: 0.4893, 426: 0.6996, 500: 0.7749, 620: 0.8751, 750: 0.9456, 999: 0.9937}
    for t, s in expected.items():
        assert flow_time(ddpm_sigma(t)) == pytest.approx(s, abs=5e-5)


@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_flow_time_and_noise_level_invert_each_other(path):
    for s in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert flow_time(flow_sigma(s, path), path) == pytest.approx(s, abs=1e-12)
    assert flow_sigma(0.5, "linear") == 1.0 and flow_sigma(0.5, "gvp") == pytest.approx(1.0)
    assert flow_sigma(1.0, path) == math.inf and flow_time(math.inf, path) == 1.0


def test_a_ddpm_timestep_from_a_noise_level_is_the_inverse():
    for t in (0, 1, 57, 426.25, 998.5, 999):
        assert ddpm_timestep(ddpm_sigma(t)) == pytest.approx(t, abs=1e-9)
    assert ddpm_timestep(0.0) == 0.0 and ddpm_timestep(1e9) == 999.0
