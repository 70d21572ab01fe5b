"""The host buffers a sharded async save stages into (parallel/staging.PinnedHost), laid out without pinning on this
CPU machine: every tensor of the state gets its own bytes inside one piece, a DTensor stays a DTensor of the same
spec over its local shard, the stager's copy fills them exactly, and DCP writes and reads them back. The pinning
itself (cudaHostRegister) runs in tests/test_gpu_staging.py."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp


def _stage_and_save(init_file: str, folder: str, out_file: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._state_dict_utils import _copy_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from trainbox.parallel.staging import PinnedHost

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    tied = torch.randn(7, 5, generator=gen)
    weight = distribute_tensor(torch.randn(300, 64, generator=gen), mesh, [Shard(0)])
    state = {"model": {"wte": tied, "head": tied, "w": weight, "b": torch.randn(3, generator=gen, dtype=torch.bfloat16),
                       "empty": torch.empty(0, 4)},
             "optim": {"state": {"w": {"step": torch.tensor(12.0), "exp_avg": weight * 2,
                                       "exp_avg_sq": torch.randn(300, 64, generator=gen).abs()}},
                       "param_groups": [{"lr": 3e-4, "params": ["w"], "betas": (0.9, 0.95)}]}}
    host = PinnedHost(state, threads=2, piece=40_000, pin=False)
    # where each tensor's bytes lie: (piece, first byte, last byte) by the piece's storage
    spans = {}
    for key, t in [("wte", host.state["model"]["wte"]), ("w", host.state["model"]["w"]),
                   ("b", host.state["model"]["b"]), ("exp_avg", host.state["optim"]["state"]["w"]["exp_avg"]),
                   ("exp_avg_sq", host.state["optim"]["state"]["w"]["exp_avg_sq"])]:
        local = t.to_local() if isinstance(t, DTensor) else t
        base = local.untyped_storage().data_ptr()
        spans[key] = (base, local.data_ptr() - base, local.data_ptr() - base + local.nbytes,
                      local.untyped_storage().nbytes())
    layout = {"pieces": len(host.pieces), "nbytes": host.nbytes, "spans": spans,
              "tied_shared": host.state["model"]["wte"].data_ptr() == host.state["model"]["head"].data_ptr(),
              "dtensor": [isinstance(host.state["model"]["w"], DTensor),
                          host.state["model"]["w"].placements == weight.placements,
                          tuple(host.state["model"]["w"].shape) == tuple(weight.shape)],
              "step_apart": host.state["optim"]["state"]["w"]["step"].untyped_storage().data_ptr()
              not in {s[0] for s in spans.values()}}
    staged = _copy_state_dict(state, host.state)
    dcp.save(staged, checkpoint_id=folder)
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
             "optim": {"state": {"w": {k: torch.zeros_like(v) for k, v in state["optim"]["state"]["w"].items()}},
                       "param_groups": state["optim"]["param_groups"]}}
    dcp.load(fresh, checkpoint_id=folder)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    torch.save({"layout": layout,
                "staged_equal": all(torch.equal(full(a), full(b)) for a, b in
                                    [(state["model"][k], staged["model"][k]) for k in state["model"]] +
                                    [(state["optim"]["state"]["w"][k], staged["optim"]["state"]["w"][k])
                                     for k in state["optim"]["state"]["w"]]),
                "loaded_equal": all(torch.equal(full(v), full(fresh["model"][k])) for k, v in state["model"].items())
                and all(torch.equal(full(v), full(fresh["optim"]["state"]["w"][k]))
                        for k, v in state["optim"]["state"]["w"].items())}, out_file)
    dist.destroy_process_group()


def test_staging_buffers_hold_each_tensor_once_in_one_piece_and_save_through_dcp(tmp_path):
    ctx = mp.get_context("spawn")   # a process group of its own, apart from the test process
    p = ctx.Process(target=_stage_and_save, args=(str(tmp_path / "init"), str(tmp_path / "ckpt"),
                                                  str(tmp_path / "out.pt")))
    p.start()
    p.join(timeout=300)
    assert p.exitcode == 0
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    layout = got["layout"]
    # in order: 7x5 fp32 (one 4 KiB unit), 300x64 fp32 (19 units), 3 bf16 (one), then 300x64 twice; a piece
    # takes tensors until it holds 40,000 bytes or more: [1 + 19], [1 + 19], [19]
    spans = layout["spans"]
    assert layout["pieces"] == 3, layout
    assert layout["nbytes"] == (1 + 19 + 1 + 19 + 19) * 4096
    by_piece = {}
    for key, (base, first, last, size) in spans.items():
        assert 0 <= first < last <= size, (key, spans)
        assert first % 4096 == 0
        by_piece.setdefault(base, []).append((first, last))
    for ranges in by_piece.values():   # no two tensors share a byte
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), by_piece
    assert layout["tied_shared"] and all(layout["dtensor"]) and layout["step_apart"], layout
    assert got["staged_equal"] and got["loaded_equal"]


def _state(gen: torch.Generator) -> dict:
    """A state dict as a save stages it: 300x64 fp32 weights (19 pages of 4 KiB) and their two moments, a 7x5
    table tied under two names (one page), 3 bf16 values (one page), an empty tensor and a scalar step."""
    tied, w = torch.randn(7, 5, generator=gen), torch.randn(300, 64, generator=gen)
    return {"model": {"wte": tied, "head": tied, "w": w, "b": torch.randn(3, generator=gen, dtype=torch.bfloat16),
                      "empty": torch.empty(0, 4)},
            "optim": {"state": {"w": {"step": torch.tensor(12.0), "exp_avg": w * 2, "exp_avg_sq": w.abs()}},
                      "param_groups": [{"lr": 3e-4, "params": ["w"]}]}}


def _spans(host) -> dict:
    """name -> (the piece's address, first byte, end) of each laid-out tensor."""
    out = {}
    model, moments = host.state["model"], host.state["optim"]["state"]["w"]
    for key, t in [("wte", model["wte"]), ("w", model["w"]), ("b", model["b"]), ("exp_avg", moments["exp_avg"]),
                   ("exp_avg_sq", moments["exp_avg_sq"])]:
        base = t.untyped_storage().data_ptr()
        out[key] = (base, t.data_ptr() - base, t.data_ptr() - base + t.nbytes)
    return out


def test_the_state_is_laid_out_in_the_reserved_pieces_first_and_the_unused_ones_are_released():
    """Pieces reserved before the state existed (AsyncSaver.reserve) take its tensors largest first, each in the
    first piece with room; what they cannot hold gets new pieces; a reserved piece left empty is released. Every
    tensor lies whole in one piece, no two share a byte, and the stager's copy fills them exactly."""
    from torch.distributed._state_dict_utils import _copy_state_dict

    from trainbox.parallel.staging import HostPieces, PinnedHost, reserve_sizes

    page = 4096
    state = _state(torch.Generator().manual_seed(0))
    assert reserve_sizes(39 * page + 5, piece=20 * page) == [20 * page, 20 * page]   # the last one page-aligned
    for reserved, pieces, used, new in [
        # over-reserved: the three 19-page tensors one to a piece, the two 1-page ones beside the first two
        ([20 * page] * 4, 3, 3, 0),
        # short by one 19-page tensor and one page: a new piece holds them, in the state's order (b, exp_avg_sq)
        ([20 * page, 19 * page], 3, 2, 1),
    ]:
        spare = HostPieces(pin=False)
        spare.add(reserved, threads=2)
        kept = [b.data_ptr() for b in spare.bufs]
        host = PinnedHost(state, threads=2, piece=10 * page, pin=False, spare=spare)
        assert len(host.pieces) == pieces and host.host is spare
        assert [b.data_ptr() for b in host.pieces[:used]] == kept[:used]   # the reserved pieces, in order
        assert host.nbytes == sum(reserved[:used]) + (20 * page if new else 0)
        spans = _spans(host)
        assert spans["w"][0] == kept[0] and spans["wte"][0] == kept[0]   # largest first, then the first with room
        if new:
            assert spans["exp_avg_sq"][0] == spans["b"][0] == host.pieces[2].data_ptr()
            assert spans["b"][1] == 0 and spans["exp_avg_sq"][1] == page
        by_piece = {}
        for key, (base, first, end) in spans.items():
            assert first % page == 0 and end <= next(b.numel() for b in host.pieces if b.data_ptr() == base), key
            by_piece.setdefault(base, []).append((first, end))
        for ranges in by_piece.values():   # no two tensors share a byte
            ranges.sort()
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), by_piece
        assert host.state["model"]["head"].data_ptr() == host.state["model"]["wte"].data_ptr()
        staged = _copy_state_dict(state, host.state)
        for k, v in state["model"].items():
            assert torch.equal(staged["model"][k], v), k
        for k, v in state["optim"]["state"]["w"].items():
            assert torch.equal(staged["optim"]["state"]["w"][k], v), k


def test_pinning_stops_after_the_pieces_in_hand_when_asked():
    """AsyncSaver.close sets HostPieces' stop (a run that ends during its first steps, a stop signal): no thread
    starts another piece, the pieces made are kept (for close to unpin), and PinnedHost over a stopped pool gives
    up, keeping nothing."""
    import threading

    from trainbox.parallel.staging import HostPieces, PinnedHost

    class StopAfterOne(HostPieces):
        def _piece(self, nbytes):
            buf = super()._piece(nbytes)
            self.stop.set()   # as close() would, while the first piece is made
            return buf

    pieces = StopAfterOne(pin=False)
    with pytest.raises(RuntimeError, match="pinning stopped after 1 of 4 pieces"):
        pieces.add([4096] * 4, threads=1)
    assert len(pieces.bufs) == 1 and pieces.nbytes == 4096
    stop = threading.Event()
    stop.set()
    with pytest.raises(RuntimeError, match="pinning stopped after 0 of 3 pieces"):
        PinnedHost(_state(torch.Generator().manual_seed(0)), threads=2, piece=10 * 4096, pin=False, stop=stop)


def test_the_reserved_bytes_are_the_bytes_the_state_is_laid_out_in_after_the_first_step():
    """AsyncSaver.reserve foresees the state before any optimizer step: AdamW with fp32 and with bfloat16 moments,
    a resumed optimizer (its state already there), parameters the optimizer does not hold (frozen) and buffers
    (those a save takes)."""
    from trainbox.config import OptimSection
    from trainbox.optim.adamw import adamw_groups, make_adamw
    from trainbox.parallel.dcp import state_dict
    from trainbox.parallel.staging import expected_bytes, laid_out

    for state_dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 70), torch.nn.LayerNorm(70),
                                    torch.nn.Linear(70, 50, bias=False))
        model[0].weight.requires_grad_(False)
        model[2].register_buffer("kept", torch.ones(3))                   # saved: a page of its own
        model[2].register_buffer("cache", torch.ones(99), persistent=False)   # not saved
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = make_adamw(adamw_groups(named, 0.1, 1e-3), OptimSection(state_dtype=state_dtype), torch.device("cpu"))
        before = expected_bytes(state_dict(model, None)["model"], [opt])
        model(torch.randint(0, 50, (4, 8))).sum().backward()
        opt.step()
        after = sum(laid_out(state_dict(model, [opt])).values())
        resumed = expected_bytes(state_dict(model, None)["model"], [opt])   # the optimizer's state there
        assert before == after == resumed, (state_dtype, before, after, resumed)
        # each tensor on 4 KiB pages of its own: the parameters 2 + 2 + 1 + 1 + 1 + 4 pages (fp32: embedding,
        # linear, its bias, the norm's two, the head) and the saved buffer's page; two moments of all but the frozen
        # embedding: 2 x 9 pages in fp32, 2 x (1 + 1 + 1 + 1 + 2) in bf16
        assert after == {"fp32": 30, "bf16": 24}[state_dtype] * 4096, after


def test_a_host_that_cannot_hold_the_shards_host_copies_is_refused_at_the_first_step(tmp_path):
    """Each rank's shards are copied to host memory for every sharded save (pinned once on a GPU): a state larger
    than the host's available memory is refused where the saver reserves them, before the first step, and where
    it prepares them after it, in one message with the bytes, instead of the kernel killing a rank when the copy
    outgrows the memory."""
    from trainbox.checkpoint import room
    from trainbox.errors import CheckpointError
    from trainbox.parallel.dcp import AsyncSaver
    from trainbox.parallel.distributed import Dist

    available = room.host_available()
    assert available is not None and available > 2**28   # this Linux machine says what it has
    assert room.no_host_room(available // 4, 2, available) is None   # half of it fits
    assert room.no_host_room(available, 3, None) is None               # unknown: nothing refused
    e = room.no_host_room(available // 2 + 2**20, 2, available)
    assert "for this host's 2 rank(s)" in str(e) and "train.checkpoints=false" in e.hint
    # the saver's own check, on the real /proc/meminfo: a model (on the meta device: no memory taken) whose
    # weights alone are four times what the host has
    with torch.device("meta"):
        big = torch.nn.Linear(available // 2**16 + 1, 2**16, bias=False)   # fp32: 4 bytes a weight
    for when in ("reserve", "prepare"):
        saver = AsyncSaver(tmp_path, Dist(), 1, None)
        try:
            getattr(saver, when)(big, [])
            raise AssertionError(f"{when}: not refused")
        except CheckpointError as e:
            assert "bytes) per rank" in str(e) and "for this host's 1 rank(s)" in str(e), e
        assert saver.pinning is None and saver.reserving is None   # nothing was pinned
    small = torch.nn.Linear(8, 8)
    saver = AsyncSaver(tmp_path, Dist(), 1, None)
    saver.reserve(small, [])   # a state that fits goes on
    saver.prepare(small, [])
