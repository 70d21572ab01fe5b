"""Sharded, asynchronous checkpoints with torch.distributed.checkpoint (DCP), for `train.parallel=fsdp` and
expert parallelism (`model.moe.expert_parallel`: each rank writes its experts, the dense part is written once).

    checkpoints/step_00001000/
        state/              DCP: .metadata + __R_K.distcp files, several per rank (weights and optimizer state)
        trainer.json        as in every checkpoint (checkpoint.py)
        rng.pt
        COMPLETE            written last, over every file (state/ included)

A save (`AsyncSaver.start`) stages this rank's shards into host memory (on a GPU, pinned buffers that a
background thread allocates after the first step and every save reuses), which is the only time training
waits unless the previous save is still being written, and then writes them from background threads while
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

import concurrent.futures
import inspect
import logging
import mmap
import os
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
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from trainbox import checkpoint
from trainbox.checkpoint import room as checkpoint_room
from trainbox.checkpoint import sharded
from trainbox.errors import CheckpointError
from trainbox.optim.adamw import state_sizes
from trainbox.parallel import expert_state
from trainbox.parallel.distributed import Dist

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


# host buffers are pinned in pieces of about this size, each paged in and registered with CUDA by one of the
# saver's threads
PIN_PIECE = 1 << 30
_ALIGN = 4096


class HostPieces:
    """Pieces of host memory, each an anonymous mapping of its own (page-aligned, so no two registrations share a
    page) with huge pages asked for where the kernel offers them, paged in by the thread that makes it and then
    registered with CUDA (cudaHostRegister). Paging in is most of the cost, and cudaHostRegister left to do it
    pages in from one thread at a time, so each thread writes its pieces first. `pin=False`: the same pieces
    unpinned (a machine without CUDA)."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.bufs: list[torch.Tensor] = []
        self.ptrs: list[int] = []   # the registered pieces' addresses

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)

    def add(self, sizes: list[int], threads: int) -> list[int]:
        """New pieces of `sizes` bytes, made by `threads` threads side by side; returns their indices in `bufs`."""
        first = len(self.bufs)
        if sizes:
            with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="pin") as pool:
                for buf in pool.map(self._piece, sizes):
                    self.bufs.append(buf)
        return list(range(first, len(self.bufs)))

    def _piece(self, nbytes: int) -> torch.Tensor:
        area = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE)
        buf = torch.frombuffer(area, dtype=torch.uint8)   # keeps the mapping alive as long as any view of it
        buf.zero_()
        if self.pin:
            err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
            if err:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
            self.ptrs.append(buf.data_ptr())
        return buf

    def keep(self, used: set[int]) -> None:
        """Unregister and drop the pieces whose indices are not in `used` (the others keep their indices' order)."""
        for i, buf in enumerate(self.bufs):
            if i not in used and buf.data_ptr() in self.ptrs:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                self.ptrs.remove(buf.data_ptr())
        self.bufs = [b for i, b in enumerate(self.bufs) if i in used]

    def close(self) -> None:
        """Unpin every piece (no copy into them is in flight: staging is blocking); each is freed with the last
        reference to it."""
        for ptr in self.ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.ptrs = []


def reserve_sizes(nbytes: int, piece: int = PIN_PIECE) -> list[int]:
    """Pieces of `piece` bytes that hold `nbytes` (the last one smaller, page-aligned), for a state whose layout is
    not known yet."""
    full, rest = divmod(nbytes, piece)
    return [piece] * full + ([-(-rest // _ALIGN) * _ALIGN] if rest else [])


class PinnedHost:
    """Host buffers shaped like a state dict's tensors (a DTensor: its local shard, as a DTensor of the same spec),
    pinned without PyTorch's caching host allocator, whose per-tensor `pin_memory()` rounds every buffer up to a
    power of two and pins it from one thread (and torch's `_create_cpu_state_dict` first copies every DTensor to
    host memory to learn its layout). The tensors are laid out in HostPieces (a tensor never spans two): first in
    `spare`, pieces made before the state existed (AsyncSaver.reserve), largest tensors first, each in the first
    spare piece with room; the rest in new pieces of `piece` bytes or more, which `threads` threads make side by
    side. Spare pieces left empty are released. `state` is the copy the stager fills on every save; `close`
    unregisters. `pin=False` lays out the same buffers unpinned (a machine without CUDA)."""

    def __init__(self, state: dict, threads: int, piece: int = PIN_PIECE, pin: bool = True,
                 spare: HostPieces | None = None):
        tensors = _laid_out(state)
        self.host = spare if spare is not None else HostPieces(pin)
        place = {}   # id(tensor) -> (index of its piece in host.bufs, offset)
        free = [b.numel() for b in self.host.bufs]
        for key, n in sorted(tensors.items(), key=lambda kv: -kv[1]):
            i = next((i for i, f in enumerate(free) if f >= n), None)
            if i is not None:
                place[key] = (i, len(self.host.bufs[i]) - free[i])
                free[i] -= n
        sizes, later = [], {}   # the new pieces' sizes; id(tensor) -> (new piece, offset), in the state's order
        for key in (k for k in tensors if k not in place):
            if not sizes or sizes[-1] >= piece:
                sizes.append(0)
            later[key] = (len(sizes) - 1, sizes[-1])
            sizes[-1] += tensors[key]
        try:
            used = sorted({i for i, _ in place.values()})
            self.host.keep(set(used))
            renumber = {old: new for new, old in enumerate(used)}
            place = {key: (renumber[i], at) for key, (i, at) in place.items()}
            added = self.host.add(sizes, threads)
        except BaseException:
            self.host.close()
            raise
        place.update({key: (added[i], at) for key, (i, at) in later.items()})
        self.pieces = self.host.bufs

        def like(t):
            if not isinstance(t, torch.Tensor):
                return t
            local = _local(t)
            if id(t) in place:
                i, at = place[id(t)]
                host = self.pieces[i][at:at + local.nbytes].view(local.dtype).view(local.shape)
            else:   # a scalar (an optimizer's step) or an empty tensor: a small host tensor of its own
                host = torch.zeros_like(local, device="cpu")
            return DTensor(host, t._spec, requires_grad=False) if isinstance(t, DTensor) else host

        self.state = tree_map(like, state)
        self.nbytes = self.host.nbytes

    def close(self) -> None:
        """Unpin the buffers; they are freed with the last reference to them."""
        self.host.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _laid_out(state: dict) -> dict[int, int]:
    """id(tensor) -> the bytes PinnedHost gives it (its local shard's, page-aligned), for each tensor of `state`
    with elements, once; scalars (an optimizer's step) are left out, kept apart in small tensors of their own."""
    out: dict[int, int] = {}
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor) and t.dim() and t.numel() and id(t) not in out:
            out[id(t)] = _aligned(_local(t).nbytes)
    return out


def expected_bytes(model: nn.Module, optimizers: list) -> int:
    """The bytes PinnedHost will lay this rank's state out in once the optimizers have stepped, foreseen before the
    first step: the parameters' local shards, and for each parameter the optimizer's state where it exists (a
    resumed run) or the state it will make (optim/adamw.py state_sizes: the moments; nothing for an optimizer it
    does not know). Buffers are left out."""
    total = sum(_aligned(_local(p).nbytes) for p in model.parameters())
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p)
                if state:
                    total += sum(_aligned(_local(t).nbytes) for t in state.values()
                                 if isinstance(t, torch.Tensor) and t.dim() and t.numel())
                else:
                    total += sum(_aligned(n) for n in state_sizes(opt, _local(p)))
    return total


def host_bytes(state: dict) -> int:
    """The bytes this rank holds for `state`: a DTensor counts its local shard (its nbytes is the global size)."""
    return sum(_local(t).nbytes for t in tree_leaves(state) if isinstance(t, torch.Tensor))


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


def saver_threads(local_ranks: int) -> int:
    """Threads per rank that page in the staging buffers and write the shards: this host's cores shared by its
    ranks, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local_ranks)))


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
        self.expected = expected_bytes(model, optimizers)
        self._refuse_short(self.expected, 0)
        if self.stager is None or not self.expected:
            return
        device, spare = torch.cuda.current_device(), HostPieces()

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
        more = sum(_laid_out(state).values()) > self.expected   # than reserve foresaw
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
                self.pinned = PinnedHost(state, self.threads, spare=self.spare)
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

    def start(self, step: int, model: nn.Module, optimizers: list, trainer: dict | None, rngs: list) -> float:
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
            small = checkpoint.small_files(trainer, rngs)
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
        otherwise stay locked for the life of the process)."""
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
