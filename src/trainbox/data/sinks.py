"""Where `trainbox prepare` writes (data/prepare.py): one sink per split, shard files or Megatron datasets, every
file under its temporary name (NAME.partial) until prepare commits the whole set."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from trainbox.data import formats, megatron


def partial(final: Path) -> Path:
    """The temporary name an output is written under until the whole set is complete."""
    return final.with_name(final.name + ".partial")


class ShardSink:
    """One split's shards: EOT before each document, a new shard every `shard_tokens` tokens."""

    def __init__(self, out: str, split: str, first_index: int, shard_tokens: int, eot: int, masked: bool):
        self.out, self.split, self.index, self.cap = out, split, first_index, shard_tokens
        self.eot, self.masked = eot, masked
        self.writer: formats.ShardWriter | None = None
        self.mask_writer: formats.ShardWriter | None = None
        self.done: list[tuple[Path, Path, int]] = []  # (temporary, final name, tokens)

    def _open(self) -> None:
        final = Path(f"{self.out}_{self.split}_{self.index:06d}.bin")
        self.writer = formats.ShardWriter(final, partial(final))
        if self.masked:
            mfinal = formats.mask_path(final)
            self.mask_writer = formats.ShardWriter(mfinal, partial(mfinal), formats.MASK_MAGIC, np.uint8)
        self.index += 1

    def _roll(self) -> None:
        for w in (self.writer, self.mask_writer):
            if w is not None:
                w.close()
                self.done.append((w.tmp, w.final, w.count))
        self.writer = self.mask_writer = None

    def add(self, ids: np.ndarray, mask: np.ndarray | None, starts_document: bool) -> int:
        if starts_document:
            ids = np.concatenate([np.array([self.eot], dtype=ids.dtype), ids])
            if self.masked:
                mask = np.concatenate([[0], mask if mask is not None else np.ones(len(ids) - 1)]).astype(np.uint8)
        if self.masked and mask is None:
            mask = np.ones(len(ids), dtype=np.uint8)
        pos = 0
        while pos < len(ids):
            if self.writer is None:
                self._open()
            take = min(len(ids) - pos, self.cap - self.writer.count)
            self.writer.write(ids[pos:pos + take])
            if self.mask_writer is not None:
                self.mask_writer.write(mask[pos:pos + take])
            pos += take
            if self.writer.count >= self.cap:
                self._roll()
        return len(ids)

    def close(self) -> list[tuple[Path, Path, int]]:
        self._roll()
        return self.done

    def abort(self) -> list[Path]:
        for w in (self.writer, self.mask_writer):
            if w is not None:
                w.f.close()
                self.done.append((w.tmp, w.final, w.count))
        return [tmp for tmp, _, _ in self.done]


class MegatronSink:
    """One split's Megatron datasets, one per text key: {out}_{key}_document or {out}_val_{key}_document."""

    def __init__(self, out: str, split: str, keys: list[str], dtype, eod: int | None, masked: bool):
        tag = "" if split == "train" else "_val"
        self.eod, self.masked, self.keys = eod, masked, keys
        self.writers = [megatron.MegatronWriter(f"{out}{tag}_{k}_document", dtype, ".partial") for k in keys]
        self.masks = ([megatron.MegatronWriter(f"{out}{tag}_{keys[0]}_document_mask", np.uint8, ".partial")]
                      if masked else [])
        self.open_doc = False

    def add_entry(self, ids_per_key: list[np.ndarray], mask: np.ndarray | None, starts_document: bool) -> int:
        """Tokens written: the entry's, plus the EODs that end the previous document."""
        n = self._end() if starts_document and self.open_doc else 0
        self.open_doc = True
        for w, ids in zip(self.writers, ids_per_key):
            w.extend(ids)
            n += len(ids)
        if self.masks:
            self.masks[0].extend(mask if mask is not None else np.ones(len(ids_per_key[0]), dtype=np.uint8))
        return n

    def _end(self) -> int:
        n = 0
        for w in self.writers:
            if self.eod is not None:
                w.extend(np.array([self.eod]))
                n += 1
            w.end_document()
        for m in self.masks:
            if self.eod is not None:
                m.extend(np.zeros(1, dtype=np.uint8))
            m.end_document()
        self.open_doc = False
        return n

    def close(self) -> tuple[int, list[tuple[Path, Path, int | None]]]:
        n = self._end() if self.open_doc else 0
        done = []
        for w in self.writers + self.masks:
            w.close()
            (bin_tmp, bin_final), idx = w.outputs()
            done += [(bin_tmp, bin_final, w.tokens), (*idx, None)]
        return n, done

    def abort(self) -> list[Path]:
        for w in self.writers + self.masks:
            w.f.close()
        return [tmp for w in self.writers + self.masks for tmp, _ in w.outputs()]
