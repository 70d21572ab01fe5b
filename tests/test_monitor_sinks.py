"""Optional metric sinks on a real run that is resumed once: TensorBoard event files hold exactly
metrics.jsonl's values, and the resumed run continues the same Weights & Biases run (offline mode:
nothing leaves the machine)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli


def _events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_tensorboard_and_wandb_across_a_resume(tiny):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    sinks = ["monitor.tensorboard=true", "monitor.wandb=true", "train.eval_every=3"]
    run_cli("train", *tiny, "train.max_steps=4", *sinks, env=env)
    run_dir = Path(next(a for a in tiny if a.startswith("run.dir=")).split("=", 1)[1]) / "tiny"
    first = json.loads((run_dir / "checkpoints" / "step_00000004" / "trainer.json").read_text())["wandb_id"]
    assert first
    run_cli("train", *tiny, "train.max_steps=8", *sinks, env=env)  # resume=auto from step 4
    assert [e["step"] for e in _events(run_dir, "start")] == [0, 4]

    # W&B: the id stored in the checkpoint was reused, so both sessions belong to one W&B run
    second = json.loads((run_dir / "checkpoints" / "step_00000008" / "trainer.json").read_text())["wandb_id"]
    assert second == first
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith("-" + first) for name in offline)

    # TensorBoard: both sessions' event files together equal metrics.jsonl
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tb = sorted((e.step, round(e.value, 5)) for e in acc.Scalars("train/loss"))
    assert tb == [(e["step"], round(e["loss"], 5)) for e in _events(run_dir, "train")] and len(tb) == 8
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [3, 4, 6, 8]  # every 3 steps and at each end
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/val_bpb"} <= set(acc.Tags()["scalars"])
