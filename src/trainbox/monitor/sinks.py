"""Metric sinks: metrics.jsonl always, loss.png unless monitor.plot=false; TensorBoard and W&B optional. The loop
calls one `Sinks` object and never branches on which sinks are on.

Events are flat dicts: {"event": "train" | "eval" | "checkpoint" | "start" | "error", "time", "step", ...}.
TensorBoard and W&B get every numeric field as `<event>/<field>` at `step`. The W&B run id goes into
each checkpoint's trainer.json (`Sinks.wandb_id`), and a resumed run passes it back to `build_sinks`, so
the same W&B run continues instead of a new one starting.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from trainbox.errors import MissingDependency
from trainbox.files import open_append
from trainbox.monitor import plot
from trainbox.monitor.console import log


class JsonlSink:
    """One JSON object per line, flushed per event so a crash loses at most the line being written."""

    def __init__(self, path: Path):
        self.f = open_append(path, buffering=1)

    def log(self, event: dict) -> None:
        self.f.write(json.dumps(event, default=float) + "\n")

    def close(self) -> None:
        self.f.close()


def numbers(event: dict, skip: tuple = ("step", "time")):
    """(name, value) of an event's numeric fields but `skip`, and of the numbers in its dict fields (eval_tasks'
    scores, by their own names), for the sinks that chart scalars."""
    for k, v in event.items():
        if isinstance(v, dict):
            yield from ((k2, v2) for k2, v2 in v.items() if isinstance(v2, (int, float)))
        elif isinstance(v, (int, float)) and k not in skip:
            yield k, v


class TensorBoardSink:
    """Event files under run_dir/tensorboard (`tensorboard --logdir runs/`), flushed every 10 s so a live
    run shows up while it trains."""

    def __init__(self, logdir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter  # heavy: torch
        except ImportError:
            raise MissingDependency("tensorboard", "tracking", "monitor.tensorboard") from None
        self.w = SummaryWriter(str(logdir), flush_secs=10)

    def log(self, event: dict) -> None:
        step = event.get("step", 0)
        kind = event.get("event", "train")
        for k, v in numbers(event):
            self.w.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self.w.close()


class WandbSink:
    """W&B (works offline with WANDB_MODE=offline; `wandb sync` uploads later). `run_id` makes a resumed
    run continue the same W&B run; W&B ignores steps it has already seen, so the steps a run repeats after
    resuming from an older checkpoint keep their first values there (metrics.jsonl has both)."""

    def __init__(self, project: str, name: str, run_id: str | None, config: dict, run_dir: Path):
        try:
            import wandb  # optional: wandb
        except ImportError:
            raise MissingDependency("wandb", "tracking", "monitor.wandb") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", config=config, dir=str(run_dir))
        self.run_id = self.run.id

    def log(self, event: dict) -> None:
        kind = event.get("event", "train")
        self.run.log({f"{kind}/{k}": v for k, v in numbers(event, skip=("step",))},
                     step=event.get("step"))

    def close(self) -> None:
        self.run.finish()


class LossPlotSink:
    """Writes loss.png from metrics.jsonl when the run ends (finished, failed or preempted). matplotlib is a
    core dependency; an environment without it gets one line saying so, and the run carries on."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def log(self, event: dict) -> None:
        pass

    def close(self) -> None:
        try:
            plot.write_loss_png(self.run_dir)
        except MissingDependency as e:
            log.info(f"loss.png not written: {e.message} ({e.hint})")
        except Exception as e:  # a plot must never turn a finished run into a failed one
            log.warning(f"loss.png not written: {type(e).__name__}: {e}")


class Sinks:
    """Fan-out to every enabled sink; what the loop holds (a run with no sinks holds an empty one)."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, event: str, **fields) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        for s in self.sinks:
            s.log(record)

    def close(self) -> None:
        for s in self.sinks:  # in order: metrics.jsonl is closed (complete) before loss.png reads it
            s.close()

    @property
    def wandb_id(self) -> str | None:
        return next((s.run_id for s in self.sinks if isinstance(s, WandbSink)), None)


def build_sinks(monitor_cfg, run_dir: Path, run_name: str, config: dict, wandb_id: str | None, enabled: bool) -> Sinks:
    """The sinks a MonitorSection asks for; `wandb_id` (from the resumed checkpoint) continues that W&B run."""
    if not enabled:  # non-zero ranks write nothing
        return Sinks([])
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl"), *([LossPlotSink(run_dir)] if monitor_cfg.plot else [])]
    if monitor_cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if monitor_cfg.wandb:
        sinks.append(WandbSink(monitor_cfg.wandb_project, run_name, wandb_id, config, run_dir))
    return Sinks(sinks)
