"""GRU Seq2Seq with attention on Multi30k (de->en) across schemes on a heterogeneous cluster.

  # reduced (default): 97 min on a 2-core CPU, two trials at a time (2026-11-21)
  python -m experiments.sweep --sweep=configs/sweeps/paper_multi30k_seq2seq.py \\
      --workdir=/tmp/paper_seq2seq --parallel=2
  # full size, for GPUs
  python -m experiments.sweep --sweep=configs/sweeps/paper_multi30k_seq2seq.py:full \\
      --workdir=/tmp/paper_seq2seq_full

Cluster: workers in four equal speed tiers (1x, 1.5x, 2x, 3x a base iteration of
100 ms for a batch of 32), 10 Gb/s links; GSSP: 4 speed groups, s = 3, peer
exchange. Adam 1e-3 with each worker's gradient clipped to norm 1, a 1-epoch
warm-up then cosine, for every scheme. Metric: corpus BLEU (sacrebleu) of
greedy translations of test_2016_flickr.

Reduced: embedding 128, hidden 256, dropout 0.5, 8 workers x 32, the first
8,192 training pairs and 1,000 test sentences, 4 epochs, BSP, SSP and GSSP,
seed 0, target BLEU 5 (set for this budget; the paper-size model reaches
about 30 after 10 full epochs).
Full (``:full``): embedding 256, hidden 512 (20,533,002 parameters), 16
workers, all 29,000 pairs, 10 epochs, target BLEU 30, every scheme, seeds 0-2.
"""

from configs import multi30k_seq2seq
from configs.sweeps import paper_cifar10_resnet18 as resnet_sweep
from gssp_jax.studies.sweep import product, sweep, zipped


def get_config(arg=None):
  c = resnet_sweep.hetero(multi30k_seq2seq.get_config(), 16 if arg == "full" else 8)
  c.train.eval_every = 1.0
  if arg == "full":
    return c
  if arg is not None:
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: none (reduced) or 'full'")
  c.model_args.emb_dim = 128
  c.model_args.hidden_dim = 256
  c.data.train_size, c.data.test_size = 8192, 1000
  c.train.num_epochs = 4.0
  c.train.target_bleu = 5.0
  return c


def get_sweep(arg=None):
  if arg == "full":
    return resnet_sweep.get_sweep(arg)
  return product(zipped(sweep("sync.scheme", ["bsp", "ssp", "gssp"]),
                        sweep("compress.name", ["none", "none", "none"])), sweep("seed", [0]))
