"""The embedded default corpus: 42 modern-spelling Project Gutenberg works of Shakespeare.

Whole works are held out for validation (VAL_WORKS), so the validation loss measures text the model
never saw. Provenance and licence: trainbox/assets/README.md.
"""
from __future__ import annotations

import functools
import tarfile

from trainbox.data.tokenizer import asset_path

CORPUS = "shakespeare"
VAL_WORKS = ("julius_caesar", "macbeth", "twelfth_night")  # three whole plays, about 6% of the bytes


@functools.lru_cache(maxsize=1)
def works() -> dict[str, str]:
    """Work name -> text, in name order (a stable order for tokenization)."""
    out = {}
    with tarfile.open(asset_path(f"{CORPUS}.tar.xz"), "r:xz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.endswith("_gut.txt"):
                text = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
                out[member.name[: -len("_gut.txt")]] = text
    return out


def split(name: str) -> list[str]:
    """Texts of the train or val split (one document per work)."""
    if name not in ("train", "val"):
        raise ValueError(name)
    return [t for w, t in works().items() if (w in VAL_WORKS) == (name == "val")]
