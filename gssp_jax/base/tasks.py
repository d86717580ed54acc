"""What is trained: a model, its loss on one worker's batch, and its evaluation.

A task turns a dataset and a model into three pure pieces the training step
composes: ``init``, ``loss`` (train mode, one worker's batch) and ``evaluate``
(test split). Data arrays are kept as dicts of arrays with a leading example
axis, so a batch for ``W`` workers is a gather with ``[W, B]`` indices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import sacrebleu

from gssp_jax import checks
from gssp_jax import data as data_lib
from gssp_jax import defaults
from gssp_jax import models as models_lib
from gssp_jax.data import user as user_data_lib

Batch = dict[str, jax.Array]


VALIDATION_SEED = 20261206   # one fixed draw: every run, scheme and seed holds out the same set


def split_validation(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
  """``(training indices, validation indices)`` of a training set of ``n`` examples.

  ``size`` of them are held out, drawn by one fixed permutation
  (:data:`VALIDATION_SEED`, never the run's seed), so every scheme, rate and
  seed of a comparison is tuned on the same examples and trains on the same
  rest; the rest keep their order (``data.train_size`` then takes the first of
  them). A training set sorted by class (CIFAR-10 from JPEG folders) still
  gives a validation set of every class.

  Raises:
    ValueError: ``size`` leaves no example to train on.
  """
  if not 0 <= size < n:
    raise ValueError(f"config.data.validation_size={size} is invalid; allowed: 0 (none) to "
                     f"{n - 1} (the training set has {n} examples)")
  held = np.sort(np.random.default_rng(VALIDATION_SEED).permutation(n)[:size])
  return np.setdiff1d(np.arange(n), held, assume_unique=True), held


def _pad_to_batches(arrays: dict[str, np.ndarray], batch_size: int):
  """Splits arrays into ``[(batch, mask)]`` of equal size, the last padded (mask False)."""
  n = len(next(iter(arrays.values())))
  nb = -(-n // batch_size)
  pad = nb * batch_size - n
  padded = {k: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
            for k, a in arrays.items()}
  mask = np.arange(nb * batch_size) < n
  sl = lambda i: slice(i * batch_size, (i + 1) * batch_size)
  return [({k: a[sl(i)] for k, a in padded.items()}, mask[sl(i)]) for i in range(nb)]


@dataclasses.dataclass
class ClassificationTask:
  """Classification: LeNet-5, ResNet-18, VGG-19 on MNIST / CIFAR-10, or a user model and data.

  The loss is the mean softmax cross-entropy of the model's logits, the metrics test accuracy
  and loss, for every model alike, and with ``validation_size`` the same on the examples held
  out of the training set (``val_accuracy``, ``val_loss``; :func:`split_validation`).
  """
  model: Any
  dataset: data_lib.ImageDataset
  augment: bool
  eval_batch_size: int
  train_size: int = 0
  test_size: int = 0
  validation_size: int = 0

  def __post_init__(self):
    ds = self.dataset
    n_test = self.test_size or len(ds.test_labels)
    if self.validation_size:
      train, held = split_validation(len(ds.train_labels), self.validation_size)
      train = train[:self.train_size or len(train)]
      self.train = {"image": ds.train_images[train], "label": ds.train_labels[train]}
      self.val = {"image": ds.train_images[held], "label": ds.train_labels[held]}
    else:   # views of the (memory-mapped) arrays, no copy
      n_train = self.train_size or len(ds.train_labels)
      self.train = {"image": ds.train_images[:n_train], "label": ds.train_labels[:n_train]}
      self.val = None
    self.test = {"image": ds.test_images[:n_test], "label": ds.test_labels[:n_test]}
    self._mean = np.asarray(ds.mean, np.float32)
    self._std = np.asarray(ds.std, np.float32)
    self._eval = jax.jit(self._eval_batch)
    self._batches = {}

  @property
  def num_train(self) -> int:
    return len(self.train["label"])

  def _inputs(self, images):
    return data_lib.normalize_images(images, self._mean, self._std)

  def init(self, rng: jax.Array):
    variables = self.model.init(rng, self._inputs(self.train["image"][:1]), train=False)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    return params, model_state

  def loss(self, params, model_state, batch: Batch, rng: jax.Array):
    """Mean cross-entropy on one worker's batch; returns (loss, new model_state)."""
    images = batch["image"]
    if self.augment:
      images = data_lib.augment_crop_flip(rng, images)
    variables = {"params": params, **model_state}
    if model_state:  # BatchNorm: the step returns the new running statistics
      logits, new_state = self.model.apply(variables, self._inputs(images), train=True,
                                           mutable=list(model_state))
    else:
      logits, new_state = self.model.apply(variables, self._inputs(images), train=True), {}
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, dict(new_state)

  def _eval_batch(self, params, model_state, batch, mask):
    logits = self.model.apply({"params": params, **model_state},
                              self._inputs(batch["image"]), train=False)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = (jnp.argmax(logits, -1) == batch["label"]) & mask
    return correct.sum(), jnp.where(mask, ce, 0).sum()

  def evaluate(self, params, model_state) -> dict[str, float]:
    """Test accuracy and loss, and the validation set's (``val_*``) where one is held out."""
    out = self._score(params, model_state, "test", self.test)
    if self.val is not None:
      out.update(self._score(params, model_state, "val", self.val))
    return out

  def _score(self, params, model_state, split: str, arrays) -> dict[str, float]:
    if split not in self._batches:
      self._batches[split] = jax.device_put(_pad_to_batches(arrays, self.eval_batch_size))
    # A host loop over batches, not lax.scan: see step.make_chunk_runner on XLA:CPU loops.
    sums = [self._eval(params, model_state, b, m) for b, m in self._batches[split]]
    n = len(arrays["label"])
    correct = sum(int(c) for c, _ in sums)
    loss = sum(float(l) for _, l in sums)
    return {f"{split}_accuracy": correct / n, f"{split}_loss": loss / n}


def _masked_ce(logits, targets, lengths):
  """Token-mean cross-entropy over positions < lengths; returns (sum, count)."""
  mask = jnp.arange(targets.shape[1])[None, :] < lengths[:, None]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.where(mask, ce, 0).sum(), mask.sum()


@dataclasses.dataclass
class TranslationTask:
  """Multi30k de->en with the GRU Seq2Seq; evaluated by greedy-decoding BLEU (sacrebleu).

  With ``validation_size``, the first that many sentence pairs of Multi30k's own validation
  split are scored too (``val_bleu``, ``val_loss``, ``val_perplexity``): the corpus ships one
  that no run trains on, so nothing is taken out of the training split.
  """
  model: Any
  dataset: data_lib.TranslationDataset
  eval_batch_size: int
  train_size: int = 0
  test_size: int = 0
  validation_size: int = 0

  def __post_init__(self):
    ds = self.dataset
    n_train = self.train_size or len(ds.train.src)
    n_test = self.test_size or len(ds.test.src)
    keys = ("src", "src_len", "tgt", "tgt_len")
    self.train = {k: getattr(ds.train, k)[:n_train] for k in keys}
    self.test = {k: getattr(ds.test, k)[:n_test] for k in keys}
    self.references = {"test": list(ds.test_references[:n_test])}
    self.val = None
    if self.validation_size:
      if self.validation_size > len(ds.val.src):
        raise ValueError(f"config.data.validation_size={self.validation_size} is invalid; "
                         f"allowed: 0 (none) to {len(ds.val.src)} (Multi30k's validation split)")
      self.val = {k: getattr(ds.val, k)[:self.validation_size] for k in keys}
      self.references["val"] = list(ds.val_references[:self.validation_size])
    # Greedy decoding may run a few tokens past the longest reference.
    longest = max(a["tgt"].shape[1] for a in (self.test, self.val) if a is not None)
    self.max_decode_len = int(longest) + 5
    self._eval = jax.jit(self._eval_batch)
    self._batches = {}

  @property
  def num_train(self) -> int:
    return len(self.train["src"])

  def init(self, rng: jax.Array):
    p_rng, d_rng = jax.random.split(rng)
    t = self.train
    variables = self.model.init({"params": p_rng, "dropout": d_rng}, t["src"][:1],
                                t["src_len"][:1], t["tgt"][:1, :-1], train=False)
    return variables["params"], {}

  def loss(self, params, model_state, batch: Batch, rng: jax.Array):
    """Token-mean cross-entropy with teacher forcing on one worker's batch."""
    logits = self.model.apply({"params": params}, batch["src"], batch["src_len"],
                              batch["tgt"][:, :-1], train=True, rngs={"dropout": rng})
    total, count = _masked_ce(logits, batch["tgt"][:, 1:], batch["tgt_len"] - 1)
    return total / jnp.maximum(count, 1), model_state

  def _eval_batch(self, params, batch, mask):
    logits = self.model.apply({"params": params}, batch["src"], batch["src_len"],
                              batch["tgt"][:, :-1], train=False)
    total, count = _masked_ce(logits, batch["tgt"][:, 1:],
                              jnp.where(mask, batch["tgt_len"] - 1, 0))
    tokens = self.model.apply({"params": params}, batch["src"], batch["src_len"],
                              max_len=self.max_decode_len, bos_id=data_lib.BOS,
                              eos_id=data_lib.EOS, method=type(self.model).greedy_decode)
    return total, count, tokens

  def evaluate(self, params, model_state) -> dict[str, float]:
    """Test BLEU, loss and perplexity, and the validation set's (``val_*``) where asked for."""
    del model_state
    bleu, loss = self._score(params, "test", self.test)
    out = {"bleu": bleu, "test_loss": loss, "test_perplexity": float(np.exp(min(loss, 50.0)))}
    if self.val is not None:
      bleu, loss = self._score(params, "val", self.val)
      out.update(val_bleu=bleu, val_loss=loss, val_perplexity=float(np.exp(min(loss, 50.0))))
    return out

  def _score(self, params, split: str, arrays) -> tuple[float, float]:
    if split not in self._batches:
      self._batches[split] = jax.device_put(_pad_to_batches(arrays, self.eval_batch_size))
    outs = [self._eval(params, b, m) for b, m in self._batches[split]]
    total = sum(float(t) for t, _, _ in outs)
    count = sum(int(c) for _, c, _ in outs)
    references = self.references[split]
    tokens = np.concatenate([np.asarray(tok) for _, _, tok in outs])[: len(references)]
    vocab = self.dataset.tgt_vocab
    hyps = [" ".join(vocab.decode(row)) for row in tokens]
    return sacrebleu.corpus_bleu(hyps, [references]).score, total / max(count, 1)


def validate(config: ml_collections.ConfigDict) -> None:
  """The task's keys: ``model``, ``dataset`` (a pair that fits), ``model_args.width``, ``data.*``.

  A user model or dataset is resolved (imported) now, so a typo fails here.

  Raises:
    ValueError: one line naming the key, its value and what is allowed.
  """
  _check_model_and_dataset(config)
  width = config.model_args.get("width", 1.0)
  if config.model in ("resnet18", "vgg19") and (
      isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0):
    checks.fail("model_args.width", width, "a number > 0 (1.0 = the paper's channel counts)")
  checks.positive(config, "data.eval_batch_size", int)
  for key in ("data.train_size", "data.test_size", "data.max_len", "data.validation_size"):
    checks.non_negative(config, key)
    if not isinstance(checks.get(config, key), int):
      checks.fail(key, checks.get(config, key), "an integer >= 0")


def _check_model_and_dataset(config) -> None:
  """Built-in model and dataset (a pair that fits), or user ones (resolved, i.e. imported, now)."""
  model, dataset = config.model, config.dataset
  user_model = models_lib.is_user_model(model)
  user_data = user_data_lib.is_user_dataset(dataset)
  try:
    if user_model:
      models_lib.check_user_model_args(model, dict(config.model_args))
    if user_data:
      user_data_lib.check_name(dataset)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  if not user_model:
    checks.choice(config, "model", tuple(defaults.MODEL_DATASETS) + (
        "a name given to gssp_jax.models.register_model",
        "'package.module:Name' or 'path/file.py:Name' (a Flax module)"))
  if not user_data:
    checks.choice(config, "dataset", defaults.DATASETS + (
        "'tfds:<builder>'", "a name given to gssp_jax.data.register_dataset",
        "'package.module:load' or 'path/file.py:load'"))
  if user_model and dataset == "multi30k":
    checks.fail("dataset", dataset, f"an image-classification dataset for the user model "
                f"{model!r} (mnist, cifar10 or a user dataset); multi30k trains model='seq2seq'")
  if not user_model and user_data and model == "seq2seq":
    checks.fail("dataset", dataset,
                "multi30k for model 'seq2seq' (user datasets are classification)")
  if not user_model and not user_data and dataset not in defaults.MODEL_DATASETS[model]:
    checks.fail("dataset", dataset,
                f"{', '.join(defaults.MODEL_DATASETS[model])} for model {model!r}")


def validate_sizes(config: ml_collections.ConfigDict, num_train: int) -> None:
  """The checks that need the dataset's size (still before any compilation)."""
  shard = num_train // config.num_workers
  if shard < 1:
    checks.fail("num_workers", config.num_workers,
                f"at most the number of training examples ({num_train})")
  if config.batch_size > shard:
    checks.fail("batch_size", config.batch_size,
                f"at most the per-worker shard size {shard} (= {num_train} training examples //"
                f" num_workers={config.num_workers})")


def make_task(config: ml_collections.ConfigDict):
  """Loads the dataset and builds the model for ``config`` (validated beforehand)."""
  data_dir = config.data_dir or None
  ds = data_lib.load_dataset(
      config.dataset, data_dir, max_len=config.data.max_len or None,
      allow_download=config.data_download, download_url=config.data_url or None)
  model_args = dict(config.model_args)
  if isinstance(ds, data_lib.TranslationDataset):
    model = models_lib.create_model(config.model, src_vocab_size=len(ds.src_vocab),
                                    tgt_vocab_size=len(ds.tgt_vocab), **model_args)
    return TranslationTask(model, ds, config.data.eval_batch_size, config.data.train_size,
                           config.data.test_size, config.data.validation_size)
  if config.data.augment and ds.train_images.ndim != 4:
    raise ValueError(f"config.data.augment=True needs images [N, H, W, C]; dataset "
                     f"{config.dataset!r} has inputs {ds.train_images.shape}; allowed: "
                     "data.augment=False for it")
  model = models_lib.create_model(config.model, num_classes=ds.num_classes, **model_args)
  return ClassificationTask(model, ds, config.data.augment, config.data.eval_batch_size,
                            config.data.train_size, config.data.test_size,
                            config.data.validation_size)


TaskLike = ClassificationTask | TranslationTask
LossFn = Callable[..., tuple[jax.Array, Any]]
