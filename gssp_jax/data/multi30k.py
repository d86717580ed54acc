"""Multi30k (task 1, German to English) from the raw text files."""

from __future__ import annotations

import pathlib
import re
import unicodedata
from collections.abc import Sequence

import numpy as np
from absl import logging

from gssp_jax.data import checksums, paths
from gssp_jax.data.types import BOS, EOS, PAD, DataError, TokenArrays, TranslationDataset, Vocab

SRC_LANG, TGT_LANG = "de", "en"
# split -> file stem; test is the 2016 Flickr test set, the one papers report BLEU on.
SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
FILE_NAMES = tuple(f"{stem}.{lang}" for stem in SPLITS.values() for lang in (SRC_LANG, TGT_LANG))

# A word is a run of letters/digits/underscore (\w is unicode-aware: ä, ö, ü, ß, é ...); every
# other non-space character is a token of its own, so "Männer," -> ["männer", ","].
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def tokenize(sentence: str) -> list[str]:
  """Lowercased word and punctuation tokens of ``sentence``; deterministic, needs no models.

  Text is NFC-normalised first so a decomposed umlaut (``u`` + combining diaeresis) gives the
  same token as the precomposed one. ``str.lower`` keeps ``ß`` (``casefold`` would make "ss").
  """
  return _TOKEN_RE.findall(unicodedata.normalize("NFC", sentence).lower())


def find_multi30k_dir(root: pathlib.Path) -> pathlib.Path | None:
  """``root/multi30k`` or ``root``, whichever holds any of the needed files; else None."""
  for directory in (root / "multi30k", root):
    if any(paths.find_file(directory, name) for name in FILE_NAMES):
      return directory
  return None


def source_files(directory: pathlib.Path) -> list[pathlib.Path]:
  """The Multi30k files present in ``directory`` (the ones :func:`load_multi30k_dir` reads)."""
  return [p for p in (paths.find_file(directory, name) for name in FILE_NAMES) if p]


def read_lines(directory: pathlib.Path, name: str) -> tuple[list[str], bytes, pathlib.Path]:
  """The lines of ``directory/name[.gz]``, with the decompressed content and the path."""
  path = paths.find_file(directory, name)
  if path is None:
    raise DataError(
        f"missing Multi30k file {directory / (name + '.gz')} (other Multi30k files are there). "
        f"Expected {', '.join(n + '.gz' for n in FILE_NAMES)} in {directory}.")
  content = paths.read_maybe_gzip(path)
  try:
    text = content.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not valid UTF-8 ({e}).") from e
  # split("\n"), not splitlines(): the latter also breaks on rare separators such as U+2028
  # inside a sentence, which would misalign the two languages.
  lines = text.split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  return [line.rstrip("\r") for line in lines], content, path


def read_split(directory: pathlib.Path, stem: str) -> tuple[list[str], list[str]]:
  """Source and target lines of one split, checked for alignment and against the checksums.

  Alignment is checked first: it gives the more useful message for a hand-edited file.
  """
  src, src_content, src_path = read_lines(directory, f"{stem}.{SRC_LANG}")
  tgt, tgt_content, tgt_path = read_lines(directory, f"{stem}.{TGT_LANG}")
  if len(src) != len(tgt):
    raise DataError(
        f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; the two files must "
        "be line-aligned translations (one sentence per line).")
  checksums.verify_content(f"multi30k/{stem}.{SRC_LANG}", src_content, src_path)
  checksums.verify_content(f"multi30k/{stem}.{TGT_LANG}", tgt_content, tgt_path)
  return src, tgt


def _pad(rows: Sequence[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  lengths = np.array([len(r) for r in rows], dtype=np.int32)
  out = np.full((len(rows), int(lengths.max(initial=1))), PAD, dtype=np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out, lengths


def make_token_arrays(src: Sequence[list[str]], tgt: Sequence[list[str]], src_vocab: Vocab,
                      tgt_vocab: Vocab, max_len: int | None = None) -> TokenArrays:
  """Padded id arrays: source + EOS, BOS + target + EOS; sentences cut to ``max_len`` tokens."""
  cut = slice(None, max_len)
  src_arr, src_len = _pad([src_vocab.encode(s[cut]) + [EOS] for s in src])
  tgt_arr, tgt_len = _pad([[BOS] + tgt_vocab.encode(t[cut]) + [EOS] for t in tgt])
  return TokenArrays(src=src_arr, src_len=src_len, tgt=tgt_arr, tgt_len=tgt_len)


def load_multi30k_dir(directory: pathlib.Path, max_len: int | None = None,
                      min_freq: int = 2) -> TranslationDataset:
  """Multi30k de->en from ``directory``; vocabularies come from the training split only.

  Raises:
    DataError: a file is missing, corrupt, not canonical, or the languages' line counts differ.
  """
  logging.info("Loading Multi30k from %s", directory)
  tokens = {}
  for split, stem in SPLITS.items():
    src_lines, tgt_lines = read_split(directory, stem)
    tokens[split] = ([tokenize(s) for s in src_lines], [tokenize(t) for t in tgt_lines])
  src_vocab = Vocab.build(tokens["train"][0], min_freq)
  tgt_vocab = Vocab.build(tokens["train"][1], min_freq)
  logging.info("Multi30k vocabularies (min_freq=%d): %s %d, %s %d tokens", min_freq, SRC_LANG,
               len(src_vocab), TGT_LANG, len(tgt_vocab))
  arrays = {split: make_token_arrays(*tokens[split], src_vocab, tgt_vocab, max_len)
            for split in SPLITS}
  return TranslationDataset(
      name="multi30k",
      src_vocab=src_vocab,
      tgt_vocab=tgt_vocab,
      train=arrays["train"],
      val=arrays["val"],
      test=arrays["test"],
      test_references=tuple(" ".join(t) for t in tokens["test"][1]),
      val_references=tuple(" ".join(t) for t in tokens["val"][1]),
  )
