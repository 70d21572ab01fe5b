"""Prepared output sets: the manifest `trainbox prepare` writes beside its output files (OUT.manifest.json),
and the check that readers make with it.

prepare writes the manifest twice: first with state "committing", listing the new files and the old ones they
replace, then, once every file is renamed into place and the stale ones removed, with state "complete" and each
file's name, size in bytes and token count. A reader refuses any token file that a manifest speaks for unless
that manifest is complete and the file is listed with its size; files no manifest speaks for (downloaded shards,
Megatron's own output) are read as they are.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from trainbox.data.formats import mask_path, token_file
from trainbox.data.megatron import is_megatron_prefix
from trainbox.errors import DataError
from trainbox.files import fsync_dir

MANIFEST_SUFFIX = ".manifest.json"


def manifest_path(out: str | Path) -> Path:
    return Path(f"{out}{MANIFEST_SUFFIX}")


def write_manifest(path: Path, manifest: dict) -> None:
    """Replace `path` atomically (temporary name, fsync, rename, fsync of the folder)."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent.resolve())


def read_manifest(path: Path) -> dict:
    """A prepare manifest, checked field by field; {} for a JSON file that is not one (no "trainbox_prepare")."""
    try:
        m = json.loads(path.read_text())
        if not isinstance(m, dict) or "trainbox_prepare" not in m:
            return {}
        names = [f["name"] for f in m["files"]] + list(m.get("replaces", []))
        if not (isinstance(m["out"], str) and m["state"] in ("committing", "complete")
                and all(isinstance(n, str) for n in names) and all(isinstance(f["bytes"], int) for f in m["files"])):
            raise ValueError("a field has the wrong type or value")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: unreadable `trainbox prepare` manifest ({type(e).__name__}: {e})",
                        hint="re-create the dataset with `trainbox prepare ... --overwrite`") from None
    return m


def output_pattern(out: str, fmt: str) -> re.Pattern:
    """File names `trainbox prepare --out .../OUT --format FMT` writes (shard, megatron, or preference pairs)."""
    o = re.escape(out)
    if fmt == "pairs":
        return re.compile(rf"{o}_(train|val)_pairs\.(tokens|mask|index)\.npy")
    if fmt == "megatron":
        return re.compile(rf"{o}(_val)?_.+_document(_mask)?\.(bin|idx)")
    return re.compile(rf"{o}_(train|val)_\d+\.(bin|mask)")


def _physical_files(path: Path) -> list[Path]:
    if is_megatron_prefix(path):
        p = str(path).removesuffix(".idx").removesuffix(".bin")
        return [Path(f"{q}.{ext}") for q in (p, f"{p}_mask") for ext in ("bin", "idx") if os.path.isfile(f"{q}.{ext}")]
    return [path] + ([mask_path(path)] if path.suffix == ".bin" and mask_path(path).is_file() else [])


def check_output_sets(paths: list[Path]) -> None:
    """DataError unless every token file in `paths` that a prepare manifest speaks for is part of a whole set."""
    manifests: dict[Path, list[tuple[Path, dict]]] = {}
    touched: dict[Path, dict] = {}
    for f in (q for p in paths for q in _physical_files(Path(p))):
        folder = f.parent
        if folder not in manifests:
            found = [(m, read_manifest(m)) for m in sorted(folder.glob(f"*{MANIFEST_SUFFIX}"))]
            manifests[folder] = [(m, d) for m, d in found if d]
        listing = [(m, d) for m, d in manifests[folder] if f.name in {e["name"] for e in d["files"]}
                   or f.name in d.get("replaces", [])]
        owners = listing or [(m, d) for m, d in manifests[folder]
                             if output_pattern(d["out"], d.get("format", "shard")).fullmatch(f.name)]
        for m, d in owners:
            if d["state"] != "complete":
                out = folder / d["out"]
                raise DataError(f"{f}: part of an unfinished `trainbox prepare` into {out} ({m} says "
                                f"'{d['state']}'): the files {out}_* may mix an old and a new output set",
                                hint=f"run the same `trainbox prepare ... --out {out} --overwrite` again")
            if not listing:
                raise DataError(f"{f}: not listed in {m}, though named like an output of its prepare; the file "
                                f"does not belong to that prepared set (left over, or copied in)",
                                hint=f"remove {f}, or re-create the set with `trainbox prepare ... --overwrite`")
            touched[m] = d
    for m, d in touched.items():
        for e in d["files"]:
            f = m.parent / e["name"]
            size = f.stat().st_size if f.is_file() else None
            if size != e["bytes"]:
                has = "is missing" if size is None else f"has {size}"
                raise DataError(f"{f}: listed in {m} with {e['bytes']} bytes but {has}; the prepared set is not "
                                f"whole", hint=f"re-create it with `trainbox prepare ... --overwrite` (or delete {m} "
                                               f"to read the files as they are)")


def listing(path: str | Path) -> tuple[Path, dict] | None:
    """(path, contents) of the complete prepare manifest that lists the token file of `path`; None when no manifest
    speaks for it."""
    f = token_file(path)
    for m in sorted(f.parent.glob(f"*{MANIFEST_SUFFIX}")):
        try:
            d = read_manifest(m)
        except DataError:
            continue
        if d and d["state"] == "complete" and f.name in {e["name"] for e in d["files"]}:
            return m, d
    return None


def prepared_with(path: str | Path) -> str | None:
    """The --tokenizer of the complete prepare manifest that lists the token file of `path`, if any."""
    found = listing(path)
    return found[1].get("tokenizer") if found else None
