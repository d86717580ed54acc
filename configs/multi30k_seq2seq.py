"""GRU Seq2Seq with additive attention on Multi30k de->en, 4 synchronous (BSP) workers x batch 32.

  python -m experiments.main --config=configs/multi30k_seq2seq.py --workdir=/tmp/m30k

Full: embedding 256, hidden 512, dropout 0.5, Adam 1e-3, gradient clip 1, 10 epochs;
test BLEU (sacrebleu, greedy decoding) on test_2016_flickr. On a 2-core CPU ~20 min per epoch (see docs/RESULTS.md).
`configs/multi30k_seq2seq.py:smoke`: a small model on 512 sentence pairs, ~1 min.
"""

from gssp_jax.defaults import default_config, parse_arg


def get_config(arg=None):
  args = parse_arg(arg)
  c = default_config()
  c.model = "seq2seq"
  c.dataset = "multi30k"
  c.model_args.emb_dim = 256
  c.model_args.hidden_dim = 512
  c.model_args.dropout = 0.5
  c.num_workers = 4
  c.batch_size = 32
  c.data.eval_batch_size = 250
  c.optimizer.name = "adam"
  c.optimizer.learning_rate = 1e-3
  c.optimizer.weight_decay = 0.0
  c.optimizer.grad_clip = 1.0
  c.train.num_epochs = 10.0
  c.train.eval_every = 1.0
  c.train.target_bleu = 30.0
  if "smoke" in args:
    c.model_args.emb_dim = 32
    c.model_args.hidden_dim = 64
    c.data.train_size = 512
    c.data.test_size = 64
    c.data.eval_batch_size = 64
    c.data.max_len = 20
    c.optimizer.learning_rate = 3e-3
    c.train.num_epochs = 4.0
  return c
