"""The loop's checkpoints (a part of train/loop.py's Trainer): when a step saves, every rank learns whether the
save worked and fails with it if not. Single-file checkpoints are written by rank 0 (checkpoint.save); sharded
ones (train.parallel=fsdp, expert parallelism) by every rank in the background (parallel/dcp.py AsyncSaver),
logged once rank 0 has published them."""
from __future__ import annotations

import time
from pathlib import Path

from trainbox import checkpoint
from trainbox.config import public_dict
from trainbox.errors import CheckpointError
from trainbox.monitor.console import log
from trainbox.rundir import runs


class Checkpointing:
    """Mixed into Trainer: uses its cfg, dist, model, optimizers, objective, plan, state, sinks, saver and
    resume_from."""

    def _save(self, step: int) -> None:
        """Rank 0 writes the checkpoint (sharded runs: every rank its shards, in the background); every rank
        learns whether it worked and fails together if not."""
        self._phase("checkpointing")
        self.last_saved_step = step
        rngs = self.dist.gather_objects(checkpoint.rng_state())
        objective = self.dist.gather_objects(self.objective.state(step))
        objective = objective if any(o is not None for o in objective) else None
        if self.saver is not None:
            t0 = time.perf_counter()
            self._saves_published(wait=True)   # the previous save, finished and logged first
            staged = self.saver.start(step, self.model, self.optimizers,
                                      self._trainer_state(step) if self.dist.is_main else None, rngs,
                                      objective)
            if self.dist.is_main:
                waited = time.perf_counter() - t0
                log.info(f"checkpoint of step {step} is being written in the background (training waited "
                         f"{waited:.2f}s: {staged:.2f}s staging, {waited - staged:.2f}s for the previous save)")
            self._phase("training")
            return
        error: CheckpointError | None = None
        if self.dist.is_main:
            try:
                t0 = time.time()
                path = checkpoint.save(self.ckpt_root, step, self._weights(), self.optimizers,
                                       self._trainer_state(step), rngs, self.cfg.train.keep_last,
                                       protect=self.resume_from, objective=objective)
                self._saved(step, path, time.time() - t0)
            except CheckpointError as e:
                error = e
        if self.dist.any(error is not None):   # also the barrier: others wait while rank 0 writes
            raise error or CheckpointError(f"rank 0 failed to save the checkpoint of step {step}; "
                                           "older checkpoints are kept", hint="see rank 0's log")
        self._phase("training")

    def _saves_published(self, wait: bool = False) -> None:
        """Log the background saves that rank 0 has published; `wait`: first wait for the one in flight."""
        if self.saver is None:
            return
        if wait:
            self.saver.wait()
        done = self.saver.finished() if self.dist.is_main else None
        if done is not None:
            self._saved(checkpoint.step_of(done[0]), done[0], done[1])

    def _saved(self, step: int, path: Path, seconds: float) -> None:
        snap = self.state.snapshot()
        self.state.update(last_checkpoint=path.name, checkpoints_saved=snap["checkpoints_saved"] + 1)
        self.sinks.log("checkpoint", step=step, path=str(path), seconds=round(seconds, 3))
        log.info(f"checkpoint {path} ({seconds:.1f}s)")

    def _trainer_state(self, step: int) -> dict:
        return {"step": step, "total_steps": self.total, "epoch": step / self.batches.steps_per_epoch,
                "loader": {"step": step, "seed": self.cfg.run.seed}, "tokens_seen": self.tokens_seen,
                "world": self.dist.world, "finished": step >= self.total,
                "restarts": self.state.snapshot()["restarts"], "wandb_id": self.sinks.wandb_id,
                "config": public_dict(self.cfg), "versions": runs.versions(), "parallel": self.parallel.name,
                "data": self.data_identity(), "init_from": self.init_from}

    def data_identity(self) -> dict:
        """What a resume checks its training set against (resume.check_data): its samples and tokens."""
        ds = self.batches.dataset
        return {"samples": int(ds.num_samples), "tokens": int(getattr(ds, "num_tokens", 0))}

    def _weights(self) -> dict:
        return checkpoint.model_state(self.model, trainable_only=getattr(self.model, "adapter_only", False))

