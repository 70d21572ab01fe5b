"""Where a run starts: the checkpoint it resumes from, what changed since it was saved, and the history a new
start replaces.

    run.resume=auto    the newest checkpoint of the run that verifies (checkpoint.verify); a damaged newer one
                       (a step folder without COMPLETE included) is named in the log and set aside. When
                       checkpoints exist but none verifies, the run stops: starting over silently would throw
                       the run away.
    run.resume=PATH    that step folder (it must verify), or the newest that verifies under a run folder.
    run.resume=never   a new run in this folder.

run.init_from on a run folder with checkpoints is refused (`check_init_from`), unless it is the one the run was
started from (trainer.json's `init_from`): the command that started it, given again, resumes.

A start replaces the history after its step: checkpoints newer than the resumed one and metrics.jsonl lines
of later steps (all of them for a new start) move to RUN/superseded/<time>/, so keep-last-K never weighs the
old run's higher steps against the new run's, metrics.jsonl holds each step once, and nothing is deleted. A start
that does the end of the run again (at its final checkpoint, the end cut short by a stop, a crash or an error)
moves the end's events of that step too (END_EVENTS: the final evaluation, lm-eval tasks), which the end logs anew:
metrics.jsonl holds each event of a step once.

Changed settings on resume (`compare`): those that change no maths (logging, intervals, kernels' memory
layout, micro-batch size, compilation and CUDA graphs, garbage collection, downloads) pass silently; optimizer
and schedule settings and the numerics switches apply from the resumed step on and are listed in the log and
the run's `start` event; anything that defines the model, the data or the batch order is refused with the list
of differences.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from trainbox import checkpoint
from trainbox.config import RunConfig
from trainbox.errors import ConfigError, RunFinished
from trainbox.files import atomic_write_text
from trainbox.monitor.console import log
from trainbox.parallel import experts_sharded

# keys that never change what a step computes. train.cuda_graphs replays the compiled step's own kernels (the
# gradients of several micro-batches summed into kept zeros, the same sums); train.gc_every times Python's garbage
# collection; data.download only fetches a missing data.path (data_identity checks what was read)
RUNTIME = ("recipe", "requires_gpu", "required", "run.name", "run.dir", "run.resume", "run.init_from", "monitor.",
           "data.cache_dir", "data.num_workers", "data.download", "train.device", "train.threads",
           "train.pg_timeout_s", "train.collective_timeout", "train.gc_every", "train.cuda_graphs",
           "train.sample_tokens", "train.sample_prompt", "train.compile", "train.peak_tflops", "train.memory_check",
           "train.memory_limit_gib",
           "train.eval_every", "train.eval_tokens", "train.eval_tasks", "train.eval_tasks_every",
           "train.eval_tasks_limit", "train.parallel", "train.reshard_after_forward", "train.grad_reduce",
           "model.moe.expert_parallel", "model.moe.exchange", "model.moe.split_sizes", "train.checkpoint_every",
           "train.checkpoints", "train.keep_last",
           "train.activation_checkpointing", "train.micro_batch_size", "lora.gradient_checkpointing")
# keys whose new value applies from the resumed step on
APPLIED = ("optim.", "train.max_steps", "train.max_tokens", "train.epochs", "train.dtype", "train.float8",
           "model.dropout",
           "model.moe.lb_loss_weight", "model.moe.z_loss_weight", "model.moe.jitter_eps",
           "model.moe.capacity_factor", "model.attention", "model.fused_loss", "model.fused_norm",
           "model.fused_mlp", "model.fp8_head", "model.fp8_mlp", "model.fp8_fallback", "model.lowp_residual",
           "model.window_warmup_steps")
REFUSED_ALWAYS = ("optim.name",)
# the events the end of a run logs at its final step, after the final checkpoint (train/stop.py Ending)
END_EVENTS = ("eval", "eval_tasks")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = tuple(v) if isinstance(v, list) else v
    return out


def _matches(key: str, rules: tuple) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in rules)


def compare(saved: dict, cfg: RunConfig) -> tuple[dict, dict]:
    """-> (applied, refused): dotted key -> (value at save time, value now), for the keys that differ."""
    old, new = _flat(saved), _flat(cfg.model_dump(mode="json"))
    applied, refused = {}, {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b or (_matches(key, RUNTIME) and not _matches(key, REFUSED_ALWAYS)):
            continue
        if _matches(key, APPLIED) and not _matches(key, REFUSED_ALWAYS):
            applied[key] = (a, b)
        else:
            refused[key] = (a, b)
    return applied, refused


def check_changes(saved: dict, cfg: RunConfig, ckpt: Path) -> dict:
    """Refuse a resume whose model, data or batch settings differ from the checkpoint's; return the applied
    changes (key -> (old, new))."""
    applied, refused = compare(saved, cfg)
    if refused:
        lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(refused.items())[:8])
        more = f" (and {len(refused) - 8} more)" if len(refused) > 8 else ""
        raise ConfigError(f"run {cfg.run_dir} was trained with other settings than these; {ckpt} differs in "
                          f"{lines}{more}",
                          hint="start a new run with run.name=NEW_NAME, or start this one over with "
                               "run.resume=never (its files move to superseded/), or resume with the saved "
                               f"settings (see {cfg.run_dir / 'config.yaml'})")
    return applied


def check_init_from(trainer_state: dict, cfg: RunConfig, ckpt: Path) -> str | None:
    """Refuse run.init_from on a start that resumes `ckpt`: run.init_from starts a new run from weights, which a
    resume would drop. The run.init_from the run was started from passes (the command that started the run, given
    again, resumes it): trainer.json's `init_from`, carried from checkpoint to checkpoint (a resume may leave
    run.init_from out), else the saved config's. Returns it."""
    asked = cfg.run.init_from
    was = trainer_state.get("init_from") or (trainer_state.get("config", {}).get("run") or {}).get("init_from")
    if not asked or (was and (was == asked or Path(was).resolve() == Path(asked).resolve())):
        return was
    started = f"it was started from run.init_from={was}" if was else "it was not started from run.init_from"
    raise ConfigError(f"run.init_from={asked} starts a new run from those weights, but run {cfg.run_dir} has "
                      f"checkpoints ({started}) and would resume from {ckpt}",
                      hint="start a new run from those weights with run.name=NEW_NAME, or start this one over from "
                           "them with run.resume=never (its files move to superseded/)")


def find_start(cfg: RunConfig, ckpt_root: Path) -> Path | None:
    """The checkpoint this run resumes from (None: a new start), by run.resume (see the module docstring)."""
    r = cfg.run.resume
    if r == "never":
        return None

    def skip(path: Path, why: str) -> None:
        log.info(f"warning: checkpoint {path.name} does not verify ({why}); trying the one before")

    if r == "auto":
        if not checkpoint.list_steps(ckpt_root):
            return None
        return checkpoint.resolve(ckpt_root, on_skip=skip)
    return checkpoint.resolve(r, on_skip=skip)


def _split_metrics(metrics: Path, after: int, end_again: bool = False) -> str | None:
    """The lines of metrics.jsonl that belong to the history up to step `after` (None: all of them do); with
    `end_again`, without the end's events at step `after` (END_EVENTS)."""
    lines = metrics.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:   # a line cut by a crash
            continue
        step = event.get("step")
        if step is None or step < after or (step == after and not (end_again and event.get("event") in END_EVENTS)):
            kept.append(line)
    return None if len(kept) == len(lines) else "".join(kept)


def supersede(run_dir: Path, ckpt_root: Path, start: Path | None, end_again: bool = False) -> Path | None:
    """Move the history after `start` to run_dir/superseded/<time>/ and return that folder (None: nothing to
    move): the checkpoints of later steps, and metrics.jsonl when it holds later steps (a copy of the lines up
    to the start stays in place), or, with `end_again` (a start at the run's final checkpoint that does its end
    again), the end's events of the start's step. A new start (None) moves every checkpoint and the whole
    metrics.jsonl."""
    if start is None:
        after = 0
    elif start.parent == ckpt_root:
        after = checkpoint.step_of(start)
    else:   # resumed from another run's checkpoint: this run's own history is all superseded
        after = -1
    doomed = [p for p in ckpt_root.glob("step_*") if p.is_dir() and checkpoint.STEP_RE.match(p.name)
              and checkpoint.step_of(p) > after and p != start] if ckpt_root.is_dir() else []
    metrics = run_dir / "metrics.jsonl"
    kept = None
    if metrics.exists():
        kept = "" if after <= 0 else _split_metrics(metrics, after, end_again)
    if not doomed and kept is None:
        return None
    dest = run_dir / "superseded" / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    (dest / "checkpoints").mkdir(parents=True)
    for p in sorted(doomed):
        os.replace(p, dest / "checkpoints" / p.name)
    if kept is not None:
        os.replace(metrics, dest / "metrics.jsonl")
        if kept:
            atomic_write_text(metrics, kept)
    pointer = ckpt_root / "latest"
    if pointer.exists() and not (ckpt_root / pointer.read_text().strip()).is_dir():
        if start is not None and start.parent == ckpt_root:
            atomic_write_text(pointer, start.name + "\n")
        else:
            pointer.unlink()
    return dest


def check_finished(step: int, total: int, saved_total: int | None, cfg: RunConfig, ended: bool = True) -> None:
    """Raise RunFinished when the checkpoint is past the run's planned length, or at it in a run that `ended` (see
    `unfinished`). At it in a run that did not, the start goes on: the loop does the end of the run again."""
    if step < total or (step == total and not ended):
        return
    how = f"train.max_steps={total} now" if saved_total != total else f"of {total}"
    raise RunFinished(f"run {cfg.run_dir} already finished: it is at step {step} ({how})",
                      hint="start a new run with run.name=NEW_NAME, or raise train.max_steps to continue this one")


def unfinished(run_dir: Path) -> str | None:
    """What the run's status.json says of a run that did not finish (preempted, failed with its error, or crashed
    in its last phase), or None when it finished. The final checkpoint is written before the end of the run (the
    final evaluation, lm-eval tasks, sample), so a crash, a stop or an error there leaves one in a run that did not
    finish. None too where there is no status.json to read: the final checkpoint is all there is to go by."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict) or status.get("phase") == "finished":
        return None
    phase, error = status.get("phase"), status.get("error")
    if phase not in ("failed", "preempted"):   # the run directory is this process's now: its writer is gone
        return f"crashed, last phase {phase}"
    return f"{phase}: {error}" if error else phase


def check_data(saved: dict | None, now: dict, ckpt: Path, cfg) -> None:
    """Refuse to resume on another training set than the checkpoint's (its samples and tokens, as saved:
    `data_identity`): the batch order would go on over other samples, so the run would not be the one continued.
    A file changed in place under the same data.path is caught here, where the config comparison sees nothing."""
    if not saved or saved == now:
        return
    what = "; ".join(f"{k} {saved.get(k, 0):,} then, {now[k]:,} now" for k in now if saved.get(k) != now[k])
    raise ConfigError(f"data.path={cfg.data.path} is not the training data {ckpt} was trained on ({what})",
                      hint="resume with the data it was trained on; to train on this data from its weights, start a "
                           f"new run from the checkpoint: run.name=NEW_NAME run.init_from={ckpt}")


def restore(ckpt: Path, model, optimizers: list, trainer_state: dict, rank: int, world: int, seed: int,
            objective=None) -> None:
    """Load weights, optimizer states, this rank's RNG (reseeded by step when the world size changed: the RNG
    streams of other ranks do not carry over) and the objective's state where it saved one from `ckpt`."""
    if checkpoint.is_sharded(ckpt) or checkpoint.is_fsdp(model):
        from trainbox.parallel.dcp import load_state  # heavy: torch.distributed.checkpoint; resharded to this layout
        load_state(ckpt, model, optimizers)
    elif experts_sharded(model):
        # checkpoints hold every expert: under expert parallelism this rank keeps its shard
        from trainbox.parallel import expert_state  # heavy: torch.distributed.tensor, expert parallelism only
        checkpoint.load_weights(ckpt, model, adapt=lambda state: expert_state.shard_state(model, state))
        checkpoint.load_optimizers(ckpt, optimizers,
                                   adapt=lambda st: expert_state.shard_optimizer_states(model, optimizers, st))
    else:
        checkpoint.load_weights(ckpt, model)
        checkpoint.load_optimizers(ckpt, optimizers)
    if objective is not None and (states := checkpoint.load_objective(ckpt)) is not None:
        objective.load_state(states)
    rng = checkpoint.load_rng(ckpt, rank)
    if rng is not None and trainer_state.get("world") == world:
        checkpoint.set_rng_state(rng)
    else:
        torch.manual_seed(seed + 1000 * rank + trainer_state["step"])
