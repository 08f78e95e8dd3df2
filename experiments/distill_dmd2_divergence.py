"""The DMD2 study's f-divergence arms (experiments/distill_dmd2.py builds them): VSD's gap weighted by the GAN
discriminator's density ratio (``distill.vsd_divergence``, moh_dit/objectives/distill/divergences.py; f-distill, Xu,
Nie and Vahdat 2025, arXiv:2502.15681) at each teacher's DMD2 config from ECT's start, noised afresh
(`dmd2ecfdt-{kind}-g{r}-nogan[-ema998]-fresh`). What the default misses at two steps is recall (0.22 below its
teacher after that config), and reverse KL, VSD's own divergence, seeks modes; Jensen-Shannon and forward KL weigh up
the samples where the teacher has more mass than the generator. The ratio needs the discriminator, so each arm runs
the GAN term as SiDA orders it (:data:`GAN_LATE`: weight 3e-3, switched on at step 200; VSD alone before), and the
same arm with the GAN term alone (`-ganlate`) is its pair: the difference is the weighting.

    {config arm}-ganlate        the GAN term on real data (the name drops ``-nogan``), VSD as it is (reverse KL)
    {config arm}-ganlate-js     and VSD weighted as the Jensen-Shannon divergence's gradient: h(r) = r / (1 + r)
    {config arm}-ganlate-fkl    and as forward KL's: h(r) = r

Measured (the default, seeds 0 and 1, experiments/results/distill_divergence): Jensen-Shannon level with reverse KL
(-0.03 and -0.05 KID at two steps, recall level; the discriminator's ratio is flat for most of the stage), and the
GAN term it needs worse than the config's arm (185 generator updates against 265): not adopted; `-fkl` not run.
"""

from __future__ import annotations

from experiments.distill_dmd2_settings import GAN_LATE

__all__ = ["DIVERGENCE_PREFIXES", "DIVERGENCE_ARMS"]

DIVERGENCE_PREFIXES = ("dmd2ecfdt",)  # the DMD2 configs' stages they vary (each teacher's ECT start)
_GAN = {f"distill.{key}": value for key, value in GAN_LATE.items()}  # (its full keys: the names drop ``-nogan``)
DIVERGENCE_ARMS = {
    "ganlate": _GAN,
    "ganlate-js": _GAN | {"distill.vsd_divergence": "js"},
    "ganlate-fkl": _GAN | {"distill.vsd_divergence": "forward_kl"},
}
