"""THE training loop, for every model family (pretraining and fine-tuning).

    forward (loss + aux losses) -> backward with gradient accumulation -> clip -> step -> schedule
    -> log -> eval -> checkpoint,      stopping cleanly on SIGTERM / SIGINT / SIGUSR1 or a NaN.

The global batch is a pure function of (seed, step) (see data/loader.py), so the maths of a step is
the same on 1 or N processes, and the loader's whole state is the step number. bf16 autocast on GPU,
fp32 on CPU; `train.compile` wraps the model in torch.compile.

Loss normalisation. The gradient of a step is the gradient of the mean token loss over the WHOLE global
batch: every micro-batch contributes (sum of its token losses) / (target tokens in the global batch).
The denominator is counted on the host from the loader (a pure function of the step), so it needs no
communication and no GPU sync. Averaging per-micro-batch means instead would weight a token by
1 / (tokens in its micro-batch), which changes with micro-batch size and world size as soon as loss
masks make micro-batches uneven. DDP averages gradients over ranks, so each rank scales by `world`.

Host synchronisation. A step queues work on the device and returns device tensors; the only host
reads are at log boundaries (`monitor.log_every`: losses, grad norm, NaN check) and the stop vote,
which runs on a gloo group over CPU tensors (parallel/distributed.py).

Preemption. SIGTERM / SIGINT / SIGUSR1 only set a flag (train/stop.py); before every step all ranks vote
(any rank flagged -> all stop), so they stop at the same step boundary, save once and return normally (exit 0).
A signal during an evaluation or a save is acted on at the next boundary; one before the first step ends the
run with nothing to save. The end of a run (final evaluation, lm-eval tasks, sample) follows its final checkpoint; a
signal there cuts it short, and the same command does it again from that checkpoint (train/stop.py). Under a plain
`torchrun`, SIGTERM and SIGINT reach the workers by default; add
`--signals-to-handle SIGTERM,SIGINT,SIGUSR1` for SIGUSR1 (Slurm `--signal`) and a `--shutdown-timeout` long
enough for a save. `trainbox train --nproc` signals its workers itself (cli/train.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainbox import checkpoint
from trainbox.config import RunConfig
from trainbox.data.loader import to_device
from trainbox.errors import TrainboxError, TrainingFailed
from trainbox.eval.training import TaskEvaluation
from trainbox.kernels.fused_ce import host_trained_rows, trained_rows
from trainbox.model.spec import family
from trainbox.monitor.console import ProgressBar, log
from trainbox.monitor.memory_snapshot import MemorySnapshot
from trainbox.monitor.meter import Meter
from trainbox.monitor.state import RunState
from trainbox.objective import Runtime, build_objective
from trainbox.optim.build import lr_multiplier, set_lr
from trainbox.parallel import keeps_split_sizes_in_graph, split_sizes_in_graph
from trainbox.parallel.distributed import Dist
from trainbox.rundir.lock import RunLock, unlock_run
from trainbox.rundir.ranks import Heartbeat
from trainbox.train import resume
from trainbox.train.build import (  # noqa: F401 - plan_length: tests
    build_data,
    build_model_side,
    keeps_gradients,
    plan_length,
)
from trainbox.train.collect import StepCollector
from trainbox.train.device import is_out_of_memory, out_of_memory, use_device
from trainbox.train.evaluate import Evaluations, autocast_context
from trainbox.train.memory import check_memory
from trainbox.train.peers import Watchdog, end_process, name_lost
from trainbox.train.preflight import Preflight, preflight
from trainbox.train.reporting import Reporting
from trainbox.train.run_files import RunFiles
from trainbox.train.saving import Checkpointing
from trainbox.train.stop import STOP, Ending


class Trainer(RunFiles, Checkpointing, Evaluations, Reporting, Ending):
    """Builds everything from a RunConfig, then `run()` trains. `dist` comes from the CLI (torchrun env); `checked`:
    the run's pre-flight checks where the CLI ran them (train/preflight.py), else they run here, on `cfg` as it
    is (its micro-batch not adapted)."""

    def __init__(self, cfg: RunConfig, dist: Dist | None = None, argv: list[str] | None = None,
                 progress: ProgressBar | None = None, checked: Preflight | None = None):
        self.dist, self.argv = dist or Dist(), argv or []
        d = self.dist
        checked = checked or preflight(cfg, d.world, d.local_rank, serves_monitor=d.is_main)
        # the given config is never changed: self.cfg is the one the checks resolved
        self.cfg, self.layout, self.device, self.dtype = checked.cfg, checked.layout, checked.device, checked.dtype
        self._fp32_matmuls = torch.get_float32_matmul_precision()   # process-wide: put back when the run ends
        use_device(self.device, self.dtype, self.cfg.train.memory_limit_gib)
        self.run_dir = cfg.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.progress = progress or ProgressBar(enabled=False)
        self.stop = STOP
        self.autocast = lambda: autocast_context(self.device, self.dtype)
        self.pin = self.device.type == "cuda"   # page-locked host batches: the H2D copy runs asynchronously
        self.family = family(cfg.model.family)
        self.objective = build_objective(self.cfg, self.device, self.dtype)   # the loss of a step, its batches
        # set by setup(), from the config (train/build.py) and the checkpoint resumed from (train/resume.py)
        self.lock: RunLock | None = None
        self.heartbeat: Heartbeat | None = None   # this rank's, and its watch over the others' (train/peers.py)
        self.watchdog: Watchdog | None = None
        self.resume_from: Path | None = None
        self.end_again: str | None = None   # the status of a run resumed at its final checkpoint to do its end again
        self.cut_short = False   # the end was cut short on several ranks: their collectives may be broken
        self.tokenizer = self.train_data = self.val_data = self.batches = None
        self.vocab = self.total = self.start_step = self.tokens_seen = 0
        self.changed: dict = {}
        self.init_from = self.cfg.run.init_from    # what the run was started from (a resume: what its checkpoint says)
        self.init_source: str | None = None   # a new start's run.init_from weights: what they were read from
        self.model = self.kernels = self.parallel = self.forward = self.reference = None
        self.optimizers: list = []
        self.last_saved_step: int | None = None
        self.saver = None        # parallel/dcp.py AsyncSaver of a sharded run
        self.collector = StepCollector(cfg.train.gc_every)   # Python's garbage collection at step boundaries
        self.snapshot = None     # monitor/memory_snapshot.py, through step monitor.memory_snapshot
        self.state: RunState | None = None
        self.tasks: TaskEvaluation | None = None   # train.eval_tasks, on rank 0
        self._status_written = 0.0                 # status.json's last write inside an evaluation
        self.server = self.sinks = None
        self.last_stats: dict = {}
        self.objective_stats: torch.Tensor | None = None   # of the last step: the objective's stat_names
        self._prefetched: tuple[int, list] | None = None  # (step, its micro-batches on the device)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        d = self.dist
        d.init(self.device, self.cfg.train.pg_timeout_s)
        if self.cfg.train.threads and self.device.type == "cpu":
            torch.set_num_threads(self.cfg.train.threads)
        self._lock_run_dir()   # rank 0 has cleared the heartbeats of an earlier run
        if d.enabled:
            self.heartbeat = Heartbeat(self.run_dir, d.rank, d.node).start()
            self.watchdog = Watchdog(self.run_dir, d.world, d.rank, self.cfg.train.collective_timeout,
                                     self._peer_lost).start()
        self.resume_from = resume.find_start(self.cfg, self.ckpt_root)
        data = build_data(self.cfg, self.layout, d, self.objective)
        cfg = self.cfg = data.cfg
        self.tokenizer, self.vocab, self.train_data, self.val_data = data.tokenizer, data.vocab, data.train, data.val
        self.batches, self.total = data.batches, data.total
        memory_plan = check_memory(cfg, self.vocab, self.device, self.dtype, world=d.world,
                                   local_world=d.local_world)   # before any weight exists
        if memory_plan is not None and (f := memory_plan.fewer_exchanges) is not None and d.is_main:
            log.info(f"expert parallelism: {memory_plan.accumulation} micro-batches a step, each with its own "
                     f"all-to-all exchanges; {f.overrides[0]} fits by the memory plan ({f.needed / 2**30:.1f} GiB of "
                     f"{memory_plan.target.memory / 2**30:.1f} free) and exchanges less often")
        if memory_plan is not None and (f := memory_plan.kept_gathered) is not None and d.is_main:
            log.info(f"fsdp: {' '.join(f.overrides)} fits by the memory plan ({f.needed / 2**30:.1f} GiB of "
                     f"{memory_plan.target.memory / 2**30:.1f} free) and keeps the blocks gathered: a step of "
                     f"{f.time.step:.2f} s predicted, against {memory_plan.time.step:.2f} s resharding them")
        if keeps_split_sizes_in_graph(cfg, memory_plan.time if memory_plan is not None else None):
            split_sizes_in_graph()   # every rank compiles alike (the plan is the same on every rank)
            if d.is_main:
                why = "model.moe.split_sizes=auto on a GPU the plan knows" \
                    if cfg.model.moe.split_sizes == "auto" else "model.moe.split_sizes=graph"
                log.info(f"expert parallelism: the exchanges' split sizes stay in the compiled graph ({why})")
        if cfg.monitor.memory_snapshot:   # from before the first weight to the end of step N
            self.snapshot = MemorySnapshot(cfg.monitor.memory_snapshot, self.run_dir, d.rank, self.device)
        trainer_state = {}
        if self.resume_from is not None:   # checked before any model is built
            trainer_state = checkpoint.load_trainer(self.resume_from)
            self.start_step = trainer_state["step"]
            self.init_from = resume.check_init_from(trainer_state, cfg, self.resume_from)
            self.changed = resume.check_changes(trainer_state.get("config", {}), cfg, self.resume_from)
            resume.check_data(trainer_state.get("data"), self.data_identity(), self.resume_from, cfg)
            if self.start_step == self.total:   # the run's last checkpoint: is its end still to do?
                status = resume.unfinished(self.run_dir) if d.is_main else None
                self.end_again = (status or "unfinished") if d.any(status is not None) else None
            resume.check_finished(self.start_step, self.total, trainer_state.get("total_steps"), cfg,
                                  ended=self.end_again is None)
        # a resumed run builds the initial weights too where the objective takes something from them (a reference)
        initial = self.resume_from is None or self.objective.needs_initial_weights(cfg)
        built = build_model_side(cfg, self.layout, self.vocab, self.device, d, init_weights=initial,
                                 dtype=self.dtype, reference=self.objective.frozen_copy(cfg))
        self.model, self.kernels, self.optimizers = built.model, built.kernels, built.optimizers
        self.parallel, self.forward, self.reference = built.parallel, built.parallel.forward, built.reference
        self.init_source = built.init_source if self.resume_from is None else None
        self.objective.attach(self.runtime())   # before the checkpoint's weights replace the initial ones
        if self.parallel.sharded and cfg.train.checkpoints:
            from trainbox.parallel.dcp import AsyncSaver  # heavy: torch.distributed.checkpoint, sharded runs only
            self.saver = AsyncSaver(self.ckpt_root, d, cfg.train.keep_last, self.resume_from)
        if self.resume_from is not None:
            resume.restore(self.resume_from, self.model, self.optimizers, trainer_state, d.rank, d.world, cfg.run.seed,
                           self.objective)
            self.last_saved_step = self.start_step
        else:
            torch.manual_seed(cfg.run.seed + 1000 * d.rank)  # dropout differs per rank, init did not
        if self.saver is not None:   # the host memory its saves stage into: checked, and pinned in the background
            self.saver.reserve(self.model, self.optimizers)
        self.tokens_seen = trainer_state.get("tokens_seen", 0)
        self.state = RunState(cfg.run_name, self.run_dir, self.total)
        self._setup_run_files(trainer_state)
        if cfg.train.eval_tasks and d.is_main:
            self.tasks = TaskEvaluation(cfg, self.run_dir, self.tokenizer, self.autocast, self._heartbeat)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        """Train to the end (or a stop signal). Returns a summary; raises TrainingFailed on a fault."""
        self.stop.install()   # (the CLI installed it first) a stop during setup is acted on before the first step
        graceful = False
        try:
            self.setup()
            result = self._run()
            graceful = True
            return result
        except BaseException as e:
            lost = self._lost_peers(e)
            if self.dist.is_main and self.state is not None and self.sinks is not None:
                phase = "preempted" if isinstance(e, KeyboardInterrupt) else "failed"
                self.state.update(phase=phase, error=str(lost or e)[:500])
                self.state.write_status(self.run_dir / "status.json")
                self.sinks.log("error", step=self.state.snapshot()["step"], error=str(lost or e)[:500])
            if lost is not None:
                raise lost from e
            raise
        finally:
            self.collector.stop()
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.heartbeat is not None:
                self.heartbeat.end("finished" if graceful else "failed")
            torch.set_float32_matmul_precision(self._fp32_matmuls)
            if self.saver is not None:
                self.saver.close()   # its pinned staging buffers
            self.stop.restore()
            if self.sinks is not None:
                self.sinks.close()
            self.progress.close()
            if self.server is not None:
                self.server.stop()
            self.dist.shutdown(graceful and not self.cut_short)
            if self.lock is not None:
                unlock_run(self.run_dir)

    def _lost_peers(self, e: BaseException) -> TrainingFailed | None:
        """After an error in this rank of several: when a peer went silent (a lost node, a killed rank, which made
        a collective fail), the error naming it (train/peers.py), else None (the error is this rank's own)."""
        if self.heartbeat is None or isinstance(e, (TrainboxError, KeyboardInterrupt)):
            return None
        self.watchdog.stop()
        self.heartbeat.end(f"failed: {type(e).__name__}")   # the peers wait for this rank no longer
        d = self.dist
        line = name_lost(self.run_dir, d.world, d.rank, self.cfg.train.collective_timeout, self.watchdog.since)
        return TrainingFailed(f"{line}; the job stops", hint=self._relaunch_hint()) if line else None

    def _peer_lost(self, line: str) -> None:
        """The watchdog's finding (a peer silent for train.collective_timeout): recorded, then this process ends,
        its training thread blocked in a collective that would wait for the silent peer until the process-group
        timeout."""
        message = f"{line}; the job stops (train.collective_timeout={self.cfg.train.collective_timeout:g}s)"
        log.error(f"error: {message}\n  -> {self._relaunch_hint()}")
        if self.dist.is_main and self.state is not None:
            self.state.update(phase="failed", error=message)
            self.state.write_status(self.run_dir / "status.json")
            if self.sinks is not None:
                self.sinks.log("error", step=self.state.snapshot()["step"], error=message)
        self.heartbeat.end(f"failed: {line}")
        end_process(1)

    def _relaunch_hint(self) -> str:
        newest = checkpoint.latest(self.ckpt_root)
        return ("start every node again with the same command: the run resumes from "
                + (f"{newest}" if newest else "the start (no checkpoint yet)"))

    def _run(self) -> dict:
        cfg, d = self.cfg, self.dist
        every = cfg.monitor.log_every
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len * self.objective.sequences
        meter = Meter(tokens_per_step, self.start_step)
        window: list[torch.Tensor] = []
        window_start = self.start_step
        self._phase("compiling" if cfg.train.compile else "training")
        # training mode (dropout, gradient checkpointing): from_pretrained hands Hugging Face models over in eval mode
        self.model.train()
        self.progress.update(self.start_step, self.total, None, None, None, force=True)
        step, stopped = self.start_step, False
        lr = grad_norm = None   # of the last step taken: a stop logs the open window with them
        self.collector.start()
        while step < self.total:
            if d.any(self.stop.requested):  # every rank stops at the same step boundary
                stopped = True
                break
            self.stop.announce = True   # from here a signal is logged as it arrives
            try:
                loss, grad_norm, lr = self.train_step(step)
            except RuntimeError as e:   # torch.cuda.OutOfMemoryError is one; a CPU allocation failure is another
                if not is_out_of_memory(e):
                    raise
                raise out_of_memory(e, step + 1, cfg.train.micro_batch_size, self.device,
                                    checkpoint.latest(self.ckpt_root)) from None
            step += 1
            self.tokens_seen += tokens_per_step
            if self.snapshot is not None and self.snapshot.after_step(step - self.start_step):
                self.snapshot = None
            window.append(loss)
            meter.step_done(step)
            if step == self.start_step + 1:
                if cfg.train.compile:
                    self._phase("training")
                if self.saver is not None:
                    self.saver.prepare(self.model, self.optimizers)   # the save's host buffers, in the background
            end_of_epoch = step % self.batches.steps_per_epoch == 0
            # the last step's evaluation and tasks come after its checkpoint, in the end of the run (self._end)
            do_eval = (self.val_data is not None and cfg.train.eval_every and step % cfg.train.eval_every == 0
                       and step < self.total)
            do_save = cfg.train.checkpoints and (step == self.total or end_of_epoch or (
                cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0))
            # the NaN check runs on every logged window: flush before eval/save so bad weights are never saved
            if step % every == 0 or do_eval or do_save or step == self.total:
                self._log_window(window, window_start, step, grad_norm, lr, meter)
                window, window_start = [], step
            tasks = self.tasks is not None and step < self.total and self.tasks.due(step, self.total)
            with meter.outside_steps():   # tokens/s and the ETA count the steps alone
                if do_eval:
                    self._evaluate(step)
                if tasks:
                    self._evaluate_tasks(step)
                if do_save:
                    self._save(step)
            self.collector.after_step(step, paused=bool(do_eval or tasks or do_save))
        if stopped:
            if window:
                self._log_window(window, window_start, step, grad_norm, lr, meter)
            if cfg.train.checkpoints and step > 0 and self.last_saved_step != step:   # the same on every rank
                self._save(step)
            return self._stopped(step)
        return self._end(step)

    def train_step(self, step: int):
        """One optimizer step over the global batch; returns device tensors (no host sync)."""
        cfg = self.cfg
        lr = set_lr(self.optimizers, lr_multiplier(step, self.total, cfg.optim))
        if self.family.steps:  # inside the model: the speedrun window warm-up, the attention kernel
            self.model.set_step(step, self.total)
        batches = self.objective.step_batches(step, self._device_batches(step))
        accum = len(batches)
        # a micro-batch's loss is its sum over this count (target tokens, pairs) of the global batch: its share of
        # the global mean, times the world size that DDP's gradient average divides by
        scale = self.dist.world / max(1, self.objective.denominator(self.batches, step))
        loss_sum = torch.zeros((), device=self.device)
        stats = None
        graphs = cfg.train.cuda_graphs
        kept = keeps_gradients(cfg, accum)
        with self.autocast():
            self.objective.before_step(self.forward, batches)
        for k, b in enumerate(batches):
            if graphs:   # a new replay: the previous micro-batch's graph outputs may be overwritten (read above)
                torch.compiler.cudagraph_mark_step_begin()
            with self.parallel.micro_batch(k, accum), trained_rows(*b.get("rows", (None, 0))):
                with self.autocast():
                    part = self.objective.loss(self.forward, b, scale)
                    total = part.loss if part.aux is None else part.loss + part.aux / accum
                total.backward()
            loss_sum += part.loss.detach() / self.dist.world
            if part.stats is not None:
                stats = part.stats / self.dist.world + (0 if stats is None else stats)
        grad_norm = self.parallel.clip(cfg.optim.grad_clip, self.optimizers)
        for opt in self.optimizers:
            opt.step()
        self.parallel.after_step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=not kept)
        model_stats = part.model_stats
        if graphs and model_stats:   # read at the next log line, after later replays overwrote the graphs' outputs
            model_stats = {k: v.clone() if torch.is_tensor(v) else v for k, v in model_stats.items()}
        self.last_stats, self.objective_stats = model_stats, stats
        if step + 1 < self.total:  # the next step's data, sent while the GPU still runs this one
            self._prefetched = (step + 1, self._send_batches(step + 1))
        return loss_sum, grad_norm, lr

    def _device_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of `step` on the device: sent at the end of the previous step (before the
        loop's host sync for logging, while the GPU still runs that step), else now."""
        ready, self._prefetched = self._prefetched, None
        return ready[1] if ready is not None and ready[0] == step else self._send_batches(step)

    def _send_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """to_device; a masked micro-batch also gets "rows": (its trained targets' flat indices, found on the host
        and sent with it, how many targets there are), which its forward's head uses (fused_ce.trained_rows); the
        same as "kl_rows" for the mismatched sequences of dpo.loss=kto ("kl_y", "kl_loss_mask")."""
        host = self.batches.micro_batches(step)
        sent = to_device(host, self.device, self.pin)
        for h, b in zip(host, sent):
            for pre in ("", "kl_"):
                if f"{pre}loss_mask" in h and f"{pre}y" in h:
                    rows = host_trained_rows(h[f"{pre}y"], h[f"{pre}loss_mask"])
                    b[f"{pre}rows"] = (rows.pin_memory().to(self.device, non_blocking=True) if self.pin
                                       else rows.to(self.device), h[f"{pre}y"].numel())
        return sent

    # ------------------------------------------------------------------ logging, eval, checkpoints
    def runtime(self) -> Runtime:
        """The run as its objective sees it."""
        return Runtime(self.cfg, self.model, self.forward, self.reference, self.device, self.autocast, self.dist,
                       self.train_data, self.val_data, self.tokenizer, self.vocab, self.parallel.whole)


def train(cfg: RunConfig, dist: Dist | None = None, argv: list[str] | None = None,
          progress: ProgressBar | None = None, checked: Preflight | None = None) -> dict:
    """Train one run described by `cfg` (the entry point used by the CLI and tests); `checked`: its pre-flight
    checks where the caller ran them (the CLI, before it touched the run directory)."""
    return Trainer(cfg, dist, argv, progress, checked).run()
