"""Dataset containers and the data-specific error type.

The containers hold host numpy arrays; moving them to devices is the caller's job. They are
frozen but compare by identity (``eq=False``): field-wise ``==`` on numpy arrays is ambiguous.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

DATASETS = ("mnist", "cifar10", "multi30k")

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")


class DataError(Exception):
  """Data files are missing, malformed or fail their checksum.

  Messages name the offending file, what is wrong with it and how to fix it.
  """


def _check_labels(what: str, images: np.ndarray, labels: np.ndarray) -> None:
  if images.ndim < 2 or images.dtype not in (np.uint8, np.float32):
    raise ValueError(f"{what} images must be uint8 or float32 [N,...,C] (images [N,H,W,C]), got "
                     f"{images.dtype} {images.shape}")
  if labels.shape != (images.shape[0],) or labels.dtype != np.int32:
    raise ValueError(
        f"{what} labels must be int32 [{images.shape[0]}], got {labels.dtype} {labels.shape}")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageDataset:
  """An image classification dataset held in host memory.

  Attributes:
    name: dataset name, e.g. ``"mnist"``.
    train_images: ``[N, 32, 32, C]`` uint8. MNIST's 28x28 digits are zero-padded by 2 pixels on
      each side (the LeNet-5 input size), C=1; CIFAR-10 has C=3. A user dataset
      (:func:`gssp_jax.data.from_arrays`) may hold any ``[N, ..., C]`` uint8 or float32 inputs.
    train_labels: ``[N]`` int32 in ``[0, num_classes)``.
    test_images: like ``train_images``.
    test_labels: like ``train_labels``.
    num_classes: number of classes.
    mean: per-channel mean of ``train_images`` in [0, 1] units, computed from the arrays actually
      loaded (for MNIST the padded 32x32 images, so the zero border is included; for CIFAR-10 the
      decoded images, which differ slightly from the published constants when read from JPEG).
    std: per-channel (population) standard deviation, same convention as ``mean``.
  """

  name: str
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int
  mean: tuple[float, ...]
  std: tuple[float, ...]

  def __post_init__(self):
    _check_labels("train", self.train_images, self.train_labels)
    _check_labels("test", self.test_images, self.test_labels)
    channels = self.train_images.shape[-1]
    if self.test_images.shape[1:] != self.train_images.shape[1:]:
      raise ValueError(f"test images are {self.test_images.shape[1:]}, train images "
                       f"{self.train_images.shape[1:]}: they must match")
    if len(self.mean) != channels or len(self.std) != channels:
      raise ValueError(f"mean/std need {channels} entries, got {self.mean} / {self.std}")


@dataclasses.dataclass(frozen=True)
class Vocab:
  """A token vocabulary with the fixed specials ``<pad>=0, <unk>=1, <bos>=2, <eos>=3``.

  Build one with :meth:`Vocab.build`; the order after the specials is by decreasing frequency,
  ties broken by the token string, so the same corpus always gives the same ids.
  """

  itos: tuple[str, ...]

  def __post_init__(self):
    if tuple(self.itos[: len(SPECIALS)]) != SPECIALS:
      raise ValueError(f"Vocab must start with {SPECIALS}, got {self.itos[:len(SPECIALS)]}")
    if len(set(self.itos)) != len(self.itos):
      raise ValueError("Vocab tokens must be unique")

  @classmethod
  def build(cls, sentences: Iterable[Sequence[str]], min_freq: int = 2) -> Vocab:
    """Vocabulary of the tokens occurring at least ``min_freq`` times in ``sentences``."""
    if min_freq < 1:
      raise ValueError(f"min_freq must be >= 1, got {min_freq}")
    counts: dict[str, int] = {}
    for tokens in sentences:
      for token in tokens:
        counts[token] = counts.get(token, 0) + 1
    kept = [t for t, c in counts.items() if c >= min_freq and t not in SPECIALS]
    kept.sort(key=lambda t: (-counts[t], t))
    return cls(SPECIALS + tuple(kept))

  @functools.cached_property
  def stoi(self) -> Mapping[str, int]:
    return {token: i for i, token in enumerate(self.itos)}

  def __len__(self) -> int:
    return len(self.itos)

  def encode(self, tokens: Iterable[str]) -> list[int]:
    """Ids of ``tokens``; unknown tokens map to ``UNK``. Adds no BOS/EOS."""
    stoi = self.stoi
    return [stoi.get(token, UNK) for token in tokens]

  def decode(self, ids: Iterable[int], strip_special: bool = True) -> list[str]:
    """Tokens of ``ids``.

    Args:
      ids: token ids (a list or a 1-D integer array).
      strip_special: if True, stop at the first ``EOS`` and drop ``PAD``/``BOS`` (``<unk>`` is
        kept, it stands for a real word); if False, map every id verbatim.
    """
    out = []
    for i in (int(i) for i in ids):
      if strip_special:
        if i == EOS:
          break
        if i in (PAD, BOS):
          continue
      out.append(self.itos[i])
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class TokenArrays:
  """One split of a translation corpus as padded id arrays.

  Attributes:
    src: ``[N, Ls]`` int32, source ids then ``EOS``, ``PAD`` after (no ``BOS`` on the source).
    src_len: ``[N]`` int32, source lengths including ``EOS``.
    tgt: ``[N, Lt]`` int32, ``BOS``, target ids, ``EOS``, ``PAD`` after.
    tgt_len: ``[N]`` int32, target lengths including ``BOS`` and ``EOS``.
  """

  src: np.ndarray
  src_len: np.ndarray
  tgt: np.ndarray
  tgt_len: np.ndarray

  def __len__(self) -> int:
    return int(self.src.shape[0])


@dataclasses.dataclass(frozen=True, eq=False)
class TranslationDataset:
  """A parallel corpus, German to English for Multi30k.

  Attributes:
    name: ``"multi30k"``.
    src_vocab: source (German) vocabulary, built from the training split.
    tgt_vocab: target (English) vocabulary, built from the training split.
    train: training split.
    val: validation split.
    test: test split (``test_2016_flickr``).
    test_references: the test targets, tokenised with :func:`tokenize` (so lowercased), tokens
      joined by single spaces, never truncated: the references for BLEU.
    val_references: the same for the validation split.
  """

  name: str
  src_vocab: Vocab
  tgt_vocab: Vocab
  train: TokenArrays
  val: TokenArrays
  test: TokenArrays
  test_references: tuple[str, ...]
  val_references: tuple[str, ...]
