"""BSP on the reduced Seq2Seq sweep with Adam's learning rate scaled for its 8x larger batch.

  python -m experiments.sweep --sweep=configs/sweeps/multi30k_seq2seq_bsp_lr.py \\
      --workdir=/tmp/multi30k_seq2seq_bsp_lr
  python -m experiments.report /tmp/multi30k_seq2seq_bsp_lr --out=results/multi30k_seq2seq_bsp_lr

In ``paper_multi30k_seq2seq.py`` every scheme uses Adam 1e-3. BSP applies the
mean of 8 workers' gradients once per round (32 optimizer steps per reduced
epoch), SSP and GSSP apply every worker's (or group's) gradient as its own
step, and Adam's step size does not shrink with the noise of a smaller batch,
so at one shared rate BSP moves about 8x less per epoch. This sweep is the
same reduced BSP trial at 1e-3 x sqrt(8) ~ 3e-3, the square-root scaling rule
for Adam (Malladi et al. 2022), so the comparison does not rest on a rate that
handicaps BSP. One trial, seed 0; 36 min on a 2-core CPU beside another run.
"""

from configs.sweeps import paper_multi30k_seq2seq as seq2seq_sweep
from gssp_jax.studies.sweep import product, sweep


def get_config():
  return seq2seq_sweep.get_config()


def get_sweep():
  return product(sweep("sync.scheme", ["bsp"]), sweep("optimizer.learning_rate", [3e-3]),
                 sweep("seed", [0]))
