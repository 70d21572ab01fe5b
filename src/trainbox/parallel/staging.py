"""The host buffers a sharded async save stages into (parallel/dcp.py AsyncSaver): on a GPU, pinned pieces that every
save reuses.

    spare = HostPieces(); spare.add(reserve_sizes(expected_bytes(model_state, optimizers)), threads)   # before step 1
    host = PinnedHost(state, threads, spare=spare)   # after it: host.state is the copy the stager fills

Pinning through PyTorch's caching host allocator rounds every buffer up to a power of two and pins from one
thread; torch's `_create_cpu_state_dict` also copies every DTensor to host memory first, to learn its layout. Here
the state is laid out in pieces of plain host memory of 1 GiB or more, which several threads page in and register
with CUDA side by side (a rank's 22.4 GiB of llama-8b under 4-way FSDP: 5.1 s with four ranks pinning at once,
against 48.5 s through torch's stager; benchmarks/records/2026-11-30-2xh200-llama-8b-rank-of-4-pin-4-procs.json).
"""
from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from trainbox.optim.adamw import state_sizes

# host buffers are pinned in pieces of about this size, each paged in and registered with CUDA by one of the
# saver's threads
PIN_PIECE = 1 << 30
_ALIGN = 4096


class HostPieces:
    """Pieces of host memory, each an anonymous mapping of its own (page-aligned, so no two registrations share a
    page) with huge pages asked for where the kernel offers them, paged in by the thread that makes it and then
    registered with CUDA (cudaHostRegister). Paging in is most of the cost, and cudaHostRegister left to do it
    pages in from one thread at a time, so each thread writes its pieces first. `pin=False`: the same pieces
    unpinned (a machine without CUDA). Once `stop` is set, no thread starts another piece (a run that ends, a
    stop signal, need not wait for the rest)."""

    def __init__(self, pin: bool = True, stop: threading.Event | None = None):
        self.pin = pin
        self.stop = stop or threading.Event()
        self.bufs: list[torch.Tensor] = []
        self.ptrs: list[int] = []   # the registered pieces' addresses

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)

    def add(self, sizes: list[int], threads: int) -> list[int]:
        """New pieces of `sizes` bytes, made by `threads` threads side by side; returns their indices in `bufs`.
        Raises RuntimeError where `stop` was set before all were made (those made are kept, for `close`)."""
        first = len(self.bufs)
        if sizes:
            with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="pin") as pool:
                made = list(pool.map(self._piece, sizes))
            self.bufs += [buf for buf in made if buf is not None]
            if len(self.bufs) - first < len(sizes):
                raise RuntimeError(f"pinning stopped after {len(self.bufs) - first} of {len(sizes)} pieces")
        return list(range(first, len(self.bufs)))

    def _piece(self, nbytes: int) -> torch.Tensor | None:
        if self.stop.is_set():
            return None
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
    return [piece] * full + ([_aligned(rest)] if rest else [])


class PinnedHost:
    """Host buffers shaped like a state dict's tensors (a DTensor: its local shard, as a DTensor of the same spec),
    pinned without PyTorch's caching host allocator, whose per-tensor `pin_memory()` rounds every buffer up to a
    power of two and pins it from one thread (and torch's `_create_cpu_state_dict` first copies every DTensor to
    host memory to learn its layout). The tensors are laid out in HostPieces (a tensor never spans two): first in
    `spare`, pieces made before the state existed (AsyncSaver.reserve), largest tensors first, each in the first
    spare piece with room; the rest in new pieces of `piece` bytes or more, which `threads` threads make side by
    side. Spare pieces left empty are released. `state` is the copy the stager fills on every save; `close`
    unregisters. `stop`: HostPieces' (the spare's own where there is one). `pin=False` lays out the same buffers
    unpinned (a machine without CUDA)."""

    def __init__(self, state: dict, threads: int, piece: int = PIN_PIECE, pin: bool = True,
                 spare: HostPieces | None = None, stop: threading.Event | None = None):
        tensors = laid_out(state)
        self.host = spare if spare is not None else HostPieces(pin, stop)
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


def laid_out(state: dict) -> dict[int, int]:
    """id(tensor) -> the bytes PinnedHost gives it (its local shard's, page-aligned), for each tensor of `state`
    with elements, once; scalars (an optimizer's step) are left out, kept apart in small tensors of their own."""
    out: dict[int, int] = {}
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor) and t.dim() and t.numel() and id(t) not in out:
            out[id(t)] = _aligned(_local(t).nbytes)
    return out


def expected_bytes(model_state: dict, optimizers: list) -> int:
    """The bytes PinnedHost will lay this rank's state out in once the optimizers have stepped, foreseen before the
    first step: the model's state dict as a save takes it (`model_state`: parameters and persistent buffers, their
    local shards), and for each parameter the optimizer's state where it exists (a resumed run) or the state it
    will make (optim/adamw.py state_sizes: the moments; nothing for an optimizer it does not know)."""
    total = sum(laid_out(model_state).values())
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


def saver_threads(local_ranks: int) -> int:
    """Threads per rank that page in the staging buffers and write the shards: this host's cores shared by its
    ranks, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local_ranks)))
