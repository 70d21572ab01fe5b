"""Loss curves from runs' metrics.jsonl: `trainbox plot RUN... --out FILE.png`, and loss.png per run.

One figure, two panels: loss against optimizer steps and against training tokens (which compares runs
with different batch sizes or sequence lengths fairly). Training loss is a solid line, validation loss
a dashed line with markers, one colour per run. Runs of the preference objective (train.objective=dpo) add a
row against steps: reward accuracy (train solid, validation dashed with markers) and the rewards of the chosen
(solid) and rejected (dotted) responses, validation's with markers. Under dpo and ipo a reward is beta x (the
response's log-probability - the reference's) on the same pairs, so the chosen reward above 0 is the chosen
responses' log-probability risen since the start (the summed log-probabilities themselves, logp_chosen in
metrics.jsonl, vary with each batch's responses). Runs of grpo add the same row: the KL estimate against the
reference where grpo.beta keeps one, and the reward (the reward functions' weighted sum, the step's mean, and
validation's). A resumed run appends to metrics.jsonl and may log some
steps twice (those after its last checkpoint); the later value wins, as it is the one the run kept.
matplotlib is a core dependency, imported only here and only when plotting.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from trainbox.errors import DataError, MissingDependency


@dataclass
class Curves:
    """One run's loss curves, each a list of (step, tokens, loss) sorted by step."""

    name: str
    train: list[tuple[int, int, float]] = field(default_factory=list)
    val: list[tuple[int, int, float]] = field(default_factory=list)
    prefs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)   # PREFERENCE key -> (step, value)


PREFERENCE = ("reward_accuracy", "val_reward_accuracy", "reward_chosen", "reward_rejected", "val_reward_chosen",
              "val_reward_rejected", "kl", "val_kl", "reward", "val_reward")


def load_curves(run_dir: Path) -> Curves:
    """Read run_dir/metrics.jsonl into train and validation curves (see the module docstring)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise DataError(f"{path} does not exist: {run_dir} is not a trainbox run directory (or logged nothing yet)",
                        hint="list runs with `trainbox runs`")
    train: dict[int, float] = {}
    val: dict[int, tuple[int, float]] = {}
    prefs: dict[str, dict[int, float]] = {k: {} for k in PREFERENCE}
    tokens_per_step = None
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        kind, step = ev.get("event"), ev.get("step")
        if step and ev.get("tokens"):
            tokens_per_step = ev["tokens"] / step
        if kind == "train" and ev.get("loss") is not None:
            train[step] = ev["loss"]
        elif kind == "eval" and ev.get("val_loss") is not None:
            val[step] = (ev.get("tokens"), ev["val_loss"])
        for k in PREFERENCE:
            if kind in ("train", "eval") and isinstance(ev.get(k), (int, float)) and math.isfinite(ev[k]):
                prefs[k][step] = ev[k]
    tps = tokens_per_step or 0
    curves = Curves(name=run_dir.name)
    curves.train = [(s, round(s * tps), v) for s, v in sorted(train.items()) if math.isfinite(v)]
    curves.val = [(s, t if t is not None else round(s * tps), v) for s, (t, v) in sorted(val.items())
                  if math.isfinite(v)]
    curves.prefs = {k: sorted(v.items()) for k, v in prefs.items() if v}
    return curves


def _figure(**kw):
    """A matplotlib Figure of its own, drawn by Agg when saved: files only, no display (containers, CI), and no
    pyplot, whose figure manager and backend selection a file does not need."""
    try:
        import matplotlib  # heavy: matplotlib
    except ImportError:
        raise MissingDependency("matplotlib", "plot", "plotting loss curves",
                                hint="pip install 'matplotlib>=3.7' (a trainbox dependency: "
                                     "this environment lost it)") from None
    from matplotlib.figure import Figure  # heavy: matplotlib
    return Figure(**kw), matplotlib.rcParams


def plot_curves(runs: list[Curves], out: Path, title: str | None = None) -> Path:
    """Draw `runs` into a PNG at `out` (written atomically); returns `out`."""
    pref = any(r.prefs for r in runs)
    fig, rc = _figure(figsize=(12, 9 if pref else 4.5), dpi=100)
    grid = fig.subplots(2 if pref else 1, 2, squeeze=False)
    axes = grid[0]
    colors = rc["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        for ax, x in ((axes[0], 0), (axes[1], 1)):
            if run.train:
                ax.plot([p[x] for p in run.train], [p[2] for p in run.train], color=c, lw=1.2,
                        label=f"{run.name} train")
            if run.val:
                ax.plot([p[x] for p in run.val], [p[2] for p in run.val], color=c, ls="--", marker="o", ms=4,
                        label=f"{run.name} val")
        for key, ax, style in (("reward_accuracy", 0, "-"), ("val_reward_accuracy", 0, "--"),
                               ("kl", 0, "-"), ("val_kl", 0, "--"),
                               ("reward_chosen", 1, "-"), ("reward_rejected", 1, ":"),
                               ("val_reward_chosen", 1, "--"), ("val_reward_rejected", 1, "-."),
                               ("reward", 1, "-"), ("val_reward", 1, "--")):
            pts = run.prefs.get(key)
            if pts:
                grid[1][ax].plot([p[0] for p in pts], [p[1] for p in pts], color=c, ls=style, lw=1.2,
                                 marker="o" if key.startswith("val_") else None, ms=4, label=f"{run.name} {key}")
    for ax, xlabel in ((axes[0], "step"), (axes[1], "tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/token)" if not pref else "loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if pref:
        paired = any(run.prefs.get("reward_accuracy") for run in runs)
        scored = any(run.prefs.get("reward") or run.prefs.get("val_reward") for run in runs)   # grpo's rewards
        for ax, ylabel in ((grid[1][0], "reward accuracy (chosen > rejected)" if paired else "KL estimate"),
                           (grid[1][1], "reward (grpo: the reward functions')" if scored and not paired else
                            "reward (dpo: beta x log-prob. against the reference)")):
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:   # a panel no run has a curve in keeps no legend
                ax.legend(fontsize=8)
    fig.suptitle(title or ", ".join(r.name for r in runs))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """`trainbox plot`: compare the loss curves of several runs in one PNG."""
    runs = [load_curves(Path(d)) for d in run_dirs]
    empty = [r.name for r in runs if not r.train and not r.val and not r.prefs]
    if len(empty) == len(runs):
        raise DataError(f"no loss values logged yet in {', '.join(empty)}", hint="wait for the first logged step")
    return plot_curves(runs, out)


def write_loss_png(run_dir: Path) -> Path | None:
    """Write run_dir/loss.png (called when a run ends); None when nothing was logged."""
    curves = load_curves(run_dir)
    if not curves.train and not curves.val:
        return None
    return plot_curves([curves], Path(run_dir) / "loss.png", title=f"{curves.name}")
