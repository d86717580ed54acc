"""Known checksums of the canonical data files.

``FILE_SHA256`` holds the sha256 of each file as published (the ``.gz`` bytes); downloads are
checked against it. ``CONTENT_SHA256`` holds the sha256 of the decompressed content, which is
what local files are checked against: it accepts a re-compressed or already-unpacked copy of the
same data, and rejects anything else.
"""

from __future__ import annotations

import hashlib

from gssp_jax.data.types import DataError

FILE_SHA256 = {
    "mnist/train-images-idx3-ubyte.gz":
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "mnist/train-labels-idx1-ubyte.gz":
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "mnist/t10k-images-idx3-ubyte.gz":
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "mnist/t10k-labels-idx1-ubyte.gz":
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    "multi30k/train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "multi30k/train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "multi30k/val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "multi30k/val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "multi30k/test_2016_flickr.de.gz":
        "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "multi30k/test_2016_flickr.en.gz":
        "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "cifar10-jpeg/cifar10_jpg.tar.gz":
        "d34c68f61cca57aa9144c8f25bda427abb9921bd642d5857a2fc1a6b4416f965",
}

CONTENT_SHA256 = {
    "mnist/train-images-idx3-ubyte":
        "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "mnist/train-labels-idx1-ubyte":
        "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "mnist/t10k-images-idx3-ubyte":
        "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "mnist/t10k-labels-idx1-ubyte":
        "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    "multi30k/train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "multi30k/train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "multi30k/val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "multi30k/val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "multi30k/test_2016_flickr.de":
        "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
    "multi30k/test_2016_flickr.en":
        "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
}

# The official md5 of https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz.
CIFAR10_PYTHON_MD5 = "c58f30108f718f92721af3b95e74349a"


def verify_content(key: str, content: bytes, path) -> None:
  """Raises DataError if ``content`` (decompressed) of ``path`` is not the canonical ``key``."""
  expected = CONTENT_SHA256.get(key)
  if expected is None:
    return
  actual = hashlib.sha256(content).hexdigest()
  if actual != expected:
    raise DataError(
        f"{path}: content checksum mismatch (sha256 of the decompressed data is {actual}, "
        f"expected {expected}). The file is corrupt or not the canonical {key}; replace it with "
        "the original file (e.g. delete it and load with data_download=True).")
