r"""Distillation: a student of a trained teacher, sampled in one step or a few (``objective.name: distill``;
docs/objective.md#distillation). One objective with several methods (``distill.method``), one class and one table
entry each, and the pieces they share.

Read it in this order:

    methods.py      the table of methods: each one's class, its keys, and which key is what its student *is*
                    (refused on resume), where something came from, or how it trains (logged on resume)
    meanflow.py     MeanFlowDistill, the base of every method: the student of an average velocity over an interval,
                    its time convention and head, its sampler; the ``meanflow`` method's loss (MeanFlow's identity
                    with the teacher's guided velocity)
    trajectory.py   the ``trajectory`` method: secants of the teacher's own sampling trajectories
    dmd2.py         the ``dmd2`` method: a generator matching the teacher's distribution through a fake score
    sid.py          the ``sid`` method: DMD2's pieces with SiD's score-identity loss in place of VSD
    rcm.py          the ``rcm`` method: trajectory distillation regularised by DMD2 in the same run (rCM)
    ect.py          the ``ect`` method: consistency post-training with a small fixed step (CMT's second stage)
    generator.py    DMD2's generator on its grids: its start times and their shares, backward simulation (with the
                    start's noise, or noised afresh), its renoising sampler
    real_score.py   DMD2's real score: the teacher at its own guidance scale (ramped over training, if asked), the
                    later grid steps' at theirs
    fake_guidance.py the fake score's own guidance (SiD-LSG): the scale it trains at, the one the generator reads it at
    grids.py        the sampler's intervals and the generator's grids (pure Python: read by the table's users)
    times.py        the draws of (t, r): which intervals are trained
    derivative.py   du/dt by finite differences (the JVP is MeanFlow's)
    heads.py        what the student's network outputs (a velocity, or a DDPM teacher's noise)
    losses.py       the tangent loss and its stabilisers (l2, FastGen's opt-grad, the clamp, the warm-up)
    dmd_losses.py   DMD2's losses (VSD, the GAN's) and SiD's
    divergences.py  the divergence VSD follows (reverse KL; Jensen-Shannon and forward KL by f-distill's weights)
    dmd_costs.py    what a step of DMD2 (and of the methods on its pieces) costs, in network evaluations
    regression.py   DMD's regression: from a trajectory's noise, or from its state at each sample's start time
    distances.py    the distances of DMD's regression (squared error, LPIPS's form in the teacher's tokens)

Outside this folder import these names from the package, not its modules (``from moh_dit.objectives.distill import
MeanFlowDistill``); the classes load on first use, so that the table is read without torch. The objective registry
below everything reads the table module itself (``distill.methods``): the package's classes stand on the registry.
The training side (the teacher, its trajectories, the fake score, the students a run starts from) is
``moh_dit.training.distill``.
"""

from __future__ import annotations

import importlib
from typing import Any

from moh_dit.objectives.distill.grids import generator_grids, sampler_intervals
from moh_dit.objectives.distill.methods import (
    DEFAULT_METHOD,
    METHODS,
    PROVENANCE_KEYS,
    STUDENT_KEYS,
    MethodEntry,
    identity_keys,
    keys_of_other_methods,
    method_entry,
    user_key,
)

# the names that need torch, by the module that holds them (loaded on first use)
_LAZY = {
    "MeanFlowDistill": "meanflow",
    "TIME_CONVENTIONS": "meanflow",
    "DERIVATIVES": "meanflow",
    "TrajectoryDistill": "trajectory",
    "DMD2Distill": "dmd2",
    "RCMDistill": "rcm",
    "SiDDistill": "sid",
    "ECTDistill": "ect",
    "ECT_STEPS": "ect",
    "DMD_INPUTS": "generator",
    "HEADS": "heads",
    "native_head": "heads",
    "TimeDistribution": "times",
    "IntervalCoverage": "times",
    "finite_difference_times": "derivative",
    "TangentLoss": "losses",
    "TANGENT_LOSSES": "losses",
    "vsd_loss": "dmd_losses",
    "sid_loss": "dmd_losses",
    "gan_generator_loss": "dmd_losses",
    "gan_discriminator_loss": "dmd_losses",
}

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "PROVENANCE_KEYS",
    "STUDENT_KEYS",
    "MethodEntry",
    "identity_keys",
    "keys_of_other_methods",
    "method_entry",
    "user_key",
    "generator_grids",
    "sampler_intervals",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
