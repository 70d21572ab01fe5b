"""Sharded, asynchronous checkpoints with torch.distributed.checkpoint (DCP), for `train.parallel=fsdp` and
expert parallelism (`model.moe.expert_parallel`: each rank writes its experts, the dense part is written once).

    checkpoints/step_00001000/
        state/              DCP: .metadata + __R_K.distcp files, several per rank (weights and optimizer state)
        trainer.json        as in every checkpoint (checkpoint/__init__.py)
        rng.pt, objective.pt
        COMPLETE            written last, over every file (state/ included)

A save (`AsyncSaver.start`) stages this rank's shards into host memory (on a GPU, pinned buffers that every
save reuses, pinned in the background while the first step runs: parallel/staging.py), which is the only time
training waits unless the previous save is still being written, and then writes them from background threads while
training goes on. The collectives of the write use a gloo group of their own, so they never interleave with
the training's. When the write has finished on every rank (DCP's coordinator writes `.metadata` after all
ranks report), rank 0 publishes the folder in a background thread exactly like a single-file save
(checkpoint.publish: fsync, COMPLETE with checksums, atomic rename, `latest`, keep-last-K). One save is in
flight at a time: the next save and the end of the run wait for it. A crash or SIGKILL during the write leaves
only a `.tmp-step_X` folder; the previous checkpoint stays the newest COMPLETE one. A save that does not fit
(disk full, `ulimit -f`) is refused at the start when every rank's shards alone exceed the free space, and a
write that fails is reported where the save is waited for, in the words of a single-file save
(checkpoint/room.py), its `.tmp-step_X` removed.

Loading (`load_state`) goes through the same DCP reader for any layout: an FSDP model on any number of ranks,
or a plain model on one process (`trainbox export`, `generate`, a DDP resume), since DCP reshards on load.
Nothing from the checkpoint is unpickled as code: `.metadata` is read by an unpickler that rebuilds only
DCP's metadata classes, and non-tensor values by `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import inspect
import logging
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from trainbox import checkpoint
from trainbox.checkpoint import room as checkpoint_room
from trainbox.checkpoint import sharded
from trainbox.errors import CheckpointError
from trainbox.parallel import expert_state
from trainbox.parallel.distributed import Dist
from trainbox.parallel.staging import (
    HostPieces,
    PinnedHost,
    expected_bytes,
    host_bytes,
    laid_out,
    reserve_sizes,
    saver_threads,
)

log = logging.getLogger("trainbox")  # the library logger


def state_dict(model: nn.Module, optimizers: list | None) -> dict:
    """{"model": ..., "optim": ...} keyed by parameter names: the same keys for FSDP, expert-parallel and plain
    modules (expert shards as DTensors over the expert mesh, parallel/expert.py)."""
    return expert_state.as_global(model, sharded.state_dict(model, optimizers))


def load_state(ckpt: Path, model: nn.Module, optimizers: list | None) -> None:
    """checkpoint/sharded.py's load_state, with this rank's expert shards mapped onto the saved layout (or cut from
    a single-file checkpoint's whole tensors)."""
    cut = (lambda weights: expert_state.shard_state(model, weights),
           lambda states: expert_state.shard_optimizer_states(model, optimizers, states))
    sharded.load_state(ckpt, model, optimizers, to_global=expert_state.as_global, to_local=expert_state.as_local,
                       cut=cut)


def pinned_stager():
    """On a GPU, a stager that copies into pinned host buffers, reused by every save (the shards keep their
    shapes), so a save costs training one device-to-host copy and no allocation. Elsewhere None: DCP's default
    stager, a fresh host copy per save."""
    if not torch.cuda.is_available() or "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None
    return BlockingAsyncStager(cache_staged_state_dict=True)


def _quiet_writer_threads() -> None:
    """DCP's extra writer threads end with their write's exception, which threading would print as a traceback;
    the same failure reaches the save's future and is reported once, plainly (AsyncSaver.wait). Other threads'
    exceptions go to the hook that was there before."""
    before = threading.excepthook
    if getattr(before, "dcp_writers", False):
        return

    def hook(args):
        if args.thread is not None and args.thread.name.endswith("(_write_files_from_queue)"):
            log.debug(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
        else:
            before(args)

    hook.dcp_writers = True
    threading.excepthook = hook


class AsyncSaver:
    """One sharded save in flight at a time; rank 0 publishes it when every rank has written its shards."""

    def __init__(self, ckpt_root: Path, dist: Dist, keep_last: int, protect: Path | None):
        self.root, self.dist, self.keep_last, self.protect = ckpt_root, dist, keep_last, protect
        self.group = tdist.new_group(backend="gloo") if dist.enabled else None
        self.future = self.publisher = None
        self.step: int | None = None
        self.need = 0   # the bytes the save in flight writes at least (all ranks)
        self.error: BaseException | None = None
        self.done: tuple[Path, float] | None = None   # (published folder, seconds from start to publish)
        self.stager = pinned_stager()
        self.threads = saver_threads(dist.local_world)
        self.pinning: threading.Thread | None = None
        self.pinned: PinnedHost | None = None
        self.expected = 0   # the bytes `reserve` foresaw for this rank's state
        self.reserving: threading.Thread | None = None
        self.spare: HostPieces | None = None   # the pieces it pinned
        self.stop_pinning = threading.Event()   # set by close: the threads start no more pieces
        _quiet_writer_threads()

    def reserve(self, model: nn.Module, optimizers: list) -> None:
        """At the end of setup, before the first step: every rank holds the bytes its state will have once the
        optimizers have stepped (`expected_bytes`) against the host's available memory, and the run is refused
        on every rank where they cannot fit (checkpoint/room.py no_host_room). On a GPU, pinned pieces of that
        size are then made in the background while the first step runs (its compilation, on a compiled run), so
        the page-ins that slow training happen while the GPU waits for the compiler; `prepare` lays the state
        out in them once it exists."""
        if self.reserving is not None or self.pinning is not None:
            return
        self.expected = expected_bytes(state_dict(model, None)["model"], optimizers)
        self._refuse_short(self.expected, 0)
        if self.stager is None or not self.expected:
            return
        device, spare = torch.cuda.current_device(), HostPieces(stop=self.stop_pinning)

        def pin():
            try:
                torch.cuda.set_device(device)   # this rank's GPU (not a context on GPU 0)
                spare.add(reserve_sizes(self.expected), self.threads)
                self.spare = spare
            except Exception as e:  # noqa: BLE001 - prepare then pins what the state needs
                log.debug(f"pinning host memory for the checkpoint staging buffers failed ({e})")
                spare.close()

        self.reserving = threading.Thread(target=pin, daemon=True, name="pin-checkpoint-reserve")
        self.reserving.start()

    def _refuse_short(self, per_rank: int, held: int) -> None:
        """Refuse the run on every rank (a collective) where this rank's `per_rank` bytes of host copies cannot
        fit beside the other ranks' of this host, `held` bytes of them already pinned by each."""
        available = checkpoint_room.host_available()
        short = checkpoint_room.no_host_room(per_rank, self.dist.local_world, available and
                                             available + held * self.dist.local_world)
        if self.dist.any(short is not None):
            raise short or CheckpointError("another rank's host cannot hold the host copies of its shards for the "
                                           "sharded checkpoints", hint="see that rank's message")

    def prepare(self, model: nn.Module, optimizers: list) -> None:
        """After the first step (the optimizer state exists): lay the pinned host buffers out in the pieces
        `reserve` pinned, and pin what they lack, in a background thread while training goes on, so the first
        save need not wait for them (a rank's 22.4 GiB of llama-8b under 4-way FSDP: 5.1 s with four ranks
        pinning at once, against 48.5 s through torch's stager;
        benchmarks/records/2026-11-30-2xh200-llama-8b-rank-of-4-pin-4-procs.json). Training slows while pieces
        are paged in: its host work contends with the page faults. Fewer threads slow it less but pin for
        longer, and the first save may then wait. Where pinning fails, the first save allocates them.

        Where the state holds more than `reserve` foresaw, every rank holds its bytes against the host's available
        memory again (each rank's reserved pieces counted as its own), and the run is refused on every rank where
        they cannot fit."""
        if self.pinning is not None:
            return
        state = state_dict(model, optimizers)   # references and shapes, read here; only allocation is threaded
        more = sum(laid_out(state).values()) > self.expected   # than reserve foresaw
        if more and self.reserving is not None:
            self.reserving.join()   # what is pinned already counts as this rank's
        held = self.spare.nbytes if more and self.spare is not None else 0
        self._refuse_short(host_bytes(state) if more else 0, held)
        if self.stager is None:
            return
        device, reserving = torch.cuda.current_device(), self.reserving

        def pin():
            try:
                t0 = time.perf_counter()
                torch.cuda.set_device(device)   # this rank's GPU (not a context on GPU 0)
                if reserving is not None:
                    reserving.join()
                self.pinned = PinnedHost(state, self.threads, spare=self.spare, stop=self.stop_pinning)
                self.spare = None
                # what the stager would otherwise allocate itself on its first stage()
                self.stager.state_dict_cache = self.pinned.state
                if self.dist.is_main:
                    gib = self.pinned.nbytes / 2**30
                    log.info(f"checkpoint staging buffers pinned: {gib:.1f} GiB of host memory per rank, laid out "
                             f"{time.perf_counter() - t0:.1f}s after the first step (a save before then waits)")
            except Exception as e:  # noqa: BLE001 - the stager then allocates at the first save
                log.debug(f"pinning the checkpoint staging buffers failed ({e}); the first save allocates them")
                self.stager.state_dict_cache = None

        self.pinning = threading.Thread(target=pin, daemon=True, name="pin-checkpoint-buffers")
        self.pinning.start()

    def start(self, step: int, model: nn.Module, optimizers: list, trainer: dict | None, rngs: list,
              objective: list | None = None) -> float:
        """Stage this rank's shards and start writing them; returns the seconds training waited."""
        t0 = time.perf_counter()
        self.wait()
        if self.pinning is not None:   # the buffers, if their allocation is still under way
            self.pinning.join()
        tmp = self.root / f".tmp-step_{step:08d}"
        state = state_dict(model, optimizers)
        # every rank's shards: what the save writes at least (rank 0 checks the room for all of it before writing)
        shards = self.need = sum(self.dist.gather_objects(host_bytes(state)))
        failed = None
        if self.dist.is_main:
            small = checkpoint.small_files(trainer, rngs, objective)
            self.need += sum(n for n, _ in small.values())
            try:
                tmp = checkpoint.write_staged(self.root, step, small, more=shards)
            except CheckpointError as e:
                failed = e
        if self.dist.any(failed is not None):   # also the barrier: the folder exists before any rank writes
            raise failed or CheckpointError(f"rank 0 failed to start the checkpoint of step {step}",
                                            hint="see rank 0's log")
        # the stager copies the shards to host memory before this returns
        stager = {"async_stager": self.stager} if self.stager is not None else {}
        # several files per rank, written by as many threads (one thread writes well under 1 GB/s); no fsync
        # here: publish() fsyncs every file once, before COMPLETE
        writer = FileSystemWriter(str(tmp / checkpoint.SHARDED_DIR), thread_count=self.threads, sync_files=False)
        self.future = dcp.async_save(state, storage_writer=writer, process_group=self.group, **stager)
        self.step, self.error = step, None
        if self.dist.is_main:
            self.publisher = threading.Thread(target=self._publish, args=(tmp, step, t0), daemon=False,
                                              name=f"publish-step-{step}")
            self.publisher.start()
        return time.perf_counter() - t0

    def _publish(self, tmp: Path, step: int, t0: float) -> None:
        try:
            self.future.result()
            written = time.perf_counter()
            path = checkpoint.publish(tmp, self.root, step, self.keep_last, self.protect)
            log.info(f"checkpoint of step {step}: shards written {written - t0:.1f}s after the save began, "
                     f"published (fsync, checksums, rename) in {time.perf_counter() - written:.1f}s")
            self.done = (path, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() on every rank
            self.error = e

    def finished(self) -> tuple[Path, float] | None:
        """Rank 0: the save that has been published since the last call, once (for the log). `done` is set as
        the publisher's last act, so a value here is a finished publish."""
        done, self.done = self.done, None
        return done

    def close(self) -> None:
        """At the end of the run, after the last wait(): unpin the staging buffers (a saver's pinned memory would
        otherwise stay locked for the life of the process). Pinning still under way (a run stopped during its
        first steps) stops after the pieces in hand, so the run's end waits for no more."""
        self.stop_pinning.set()
        for thread in (self.reserving, self.pinning):
            if thread is not None:
                thread.join()
        if self.spare is not None:   # reserved, never laid out (the run ended before its first step)
            self.spare.close()
            self.spare = None
        if self.pinned is not None:
            self.stager.state_dict_cache = None
            self.pinned.close()
            self.pinned = None

    def wait(self) -> None:
        """Block until the save in flight is published; raise CheckpointError on every rank if it failed."""
        if self.future is None:
            return
        error = None
        try:
            self.future.result()
        except BaseException as e:  # noqa: BLE001
            error = e
        if self.publisher is not None:
            self.publisher.join()
            error = error or self.error
        step, self.future, self.publisher = self.step, None, None
        tmp, final = self.root / f".tmp-step_{step:08d}", self.root / f"step_{step:08d}"
        # a shard write that failed (publish's errors are CheckpointErrors already, their folder removed): each rank
        # reads why from the staged files while they are there; rank 0 removes them once every rank has looked
        cause = None
        if error is not None and not isinstance(error, CheckpointError):
            cause = checkpoint_room.disk_cause(error, tmp, self.root, self.need)
        if self.dist.any(error is not None):
            if isinstance(error, CheckpointError):
                raise error
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is None:
                raise CheckpointError(f"another rank failed to write its shards of checkpoint {final}; older "
                                      "checkpoints are kept", hint="see the other ranks' messages")
            raise checkpoint_room.save_error(error, cause, final, self.root)
