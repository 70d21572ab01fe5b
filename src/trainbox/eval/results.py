"""An evaluation's record: `RUN/eval/<time>.json`, lm-eval's results dictionary plus a `trainbox` section (the source,
checkpoint and step, the git commit, the device, and `scores`: the summary `trainbox runs`, `trainbox status` and the
dashboard show; rundir/runs.py latest_eval reads it back).

    {"results": {...lm-eval...}, "configs": {...}, ..., "trainbox": {"step": 1000, "git_commit": "...",
     "scores": {"hellaswag": {"acc": 0.29, "acc_norm": 0.31}}, ...}}
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from trainbox.files import atomic_write_text


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results (stderr entries left out; a metric under a filter other than
    lm-eval's "none" keeps the filter's name: `exact_match,strict-match`)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")   # lm-eval's "metric,filter" keys; not alias, sample_len
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not comma or metric.endswith("_stderr") or not number:
                continue
            out.setdefault(task, {})[metric if filt in ("", "none") else key] = float(value)
    return out


def flat(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"task/metric": value}: one series per score for metrics.jsonl's charts and Prometheus."""
    return {f"{task}/{metric}": v for task, metrics in summary.items() for metric, v in metrics.items()}


def _plain(o):
    """JSON for what lm-eval's results hold besides plain values: numpy scalars, sets, callables (as text)."""
    if hasattr(o, "item"):
        try:
            return o.item()
        except (TypeError, ValueError):
            pass
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def write(folder: Path, results: dict) -> Path:
    """`folder/<UTC time>.json` (a later one in the same second: `<time>_2.json`; the names sort in time order),
    written atomically; sample-level outputs (lm-eval's "samples") are not kept."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path, n = folder / f"{stamp}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stamp}_{n}.json"   # sorts after {stamp}.json
    record = {k: v for k, v in results.items() if k != "samples"}
    atomic_write_text(path, json.dumps(record, indent=1, default=_plain) + "\n")
    return path
