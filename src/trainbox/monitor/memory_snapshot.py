"""Where a run's GPU memory goes (`monitor.memory_snapshot=N`): the CUDA caching allocator's history from the
start of the run through step N, on every rank.

    trainbox train llama-1b --nproc 2 train.parallel=fsdp monitor.memory_snapshot=4

After step N each rank writes, into the run directory:

    memory_snapshot.rank{R}.pickle   torch.cuda.memory._snapshot(): drop it on https://pytorch.org/memory_viz
    memory_peak.rank{R}.json         the history replayed: the allocated and reserved peaks, what was live at
                                     the allocated peak by allocation site (the innermost frames of trainbox
                                     and of torch's FSDP, optimizer and Inductor code), and the reserved memory
                                     of each CUDA stream's pool at the reserved peak (FSDP's side streams keep
                                     pools of their own: trainbox.plan's `pools`)

Recording costs host time on every allocation (a Python stack each), so it stops after step N.
"""
from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import torch

from trainbox.files import atomic_write_bytes, atomic_write_text

GiB = 2 ** 30
MAX_ENTRIES = 2_000_000   # allocator events kept (a ring: older ones are dropped first)
SITE_FRAMES = 4           # frames that name an allocation site
OURS = ("trainbox/", "torch/distributed/fsdp/", "torch/optim/", "torch/_inductor/")


def site(frames: list[dict]) -> str:
    """The innermost frames of trainbox and of the torch code that allocates for it, innermost first."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        mark = next((m for m in OURS if m in name), None)
        if mark is not None:
            out.append(f"{mark}{name.split(mark, 1)[1]}:{f.get('line')} {f.get('name')}")
        if len(out) == SITE_FRAMES:
            break
    return " < ".join(out) or "(outside trainbox)"


def summarize(snapshot: dict, device: int = 0, top: int = 25) -> dict:
    """Replay the allocator events of `device`: peaks, what was live at the allocated peak by site, and the pools
    by stream at the reserved peak. Memory allocated before the history started is not in the events."""
    events = snapshot["device_traces"][device]
    live: dict[int, tuple[int, str]] = {}
    pools: Counter = Counter()
    allocated = reserved = top_allocated = top_reserved = 0
    at_allocated: Counter = Counter()
    at_reserved: dict = {}
    rising = False
    for e in events:
        action, size = e["action"], e.get("size", 0)
        if action in ("segment_alloc", "segment_map"):
            reserved += size
            pools[e.get("stream", 0)] += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
            pools[e.get("stream", 0)] -= size
        elif action == "alloc":
            allocated += size
            live[e["addr"]] = (size, site(e.get("frames", [])))
            if allocated > top_allocated:
                top_allocated, rising = allocated, True
        elif action == "free_completed":
            if rising:   # the allocated peak was the moment before this free: what was live there
                rising = False
                at_allocated = Counter()
                for n, where in live.values():
                    at_allocated[where] += n
            allocated -= size
            live.pop(e["addr"], None)
        if reserved > top_reserved:
            top_reserved, at_reserved = reserved, {str(k): v for k, v in pools.items() if v}
    if rising:
        at_allocated = Counter()
        for n, where in live.values():
            at_allocated[where] += n
    return {"events": len(events), "peak_allocated_gib": round(top_allocated / GiB, 3),
            "peak_reserved_gib": round(top_reserved / GiB, 3),
            "live_at_peak_gib": [(where, round(n / GiB, 3)) for where, n in at_allocated.most_common(top)],
            "pools_at_reserved_peak_gib": {k: round(v / GiB, 3) for k, v in at_reserved.items()}}


class MemorySnapshot:
    """Records from construction; `after_step(step)` writes the files and stops once `step` reaches the last."""

    def __init__(self, steps: int, run_dir: Path, rank: int, device: torch.device):
        """On a CUDA `device` (train/device.py refuses the option elsewhere, before any work)."""
        self.last, self.run_dir, self.rank, self.device = steps, Path(run_dir), rank, device
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="alloc", stacks="python")

    def after_step(self, step: int) -> bool:
        """True once written (the caller drops this object)."""
        if step < self.last:
            return False
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        name = f"rank{self.rank}"
        atomic_write_bytes(self.run_dir / f"memory_snapshot.{name}.pickle", pickle.dumps(snapshot))
        summary = {"step": step, **summarize(snapshot, self.device.index or 0)}
        atomic_write_text(self.run_dir / f"memory_peak.{name}.json", json.dumps(summary, indent=1))
        return True
