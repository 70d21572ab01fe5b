"""The pinned host buffers of a sharded async save (parallel/staging.PinnedHost) on a GPU: registered with CUDA, so
the stager's device-to-host copies are pinned copies, filled exactly, and unpinned by `close`; laid out in pieces
pinned before the state existed (HostPieces), the unused one unpinned; pinning told to stop keeps the piece in
hand pinned until `close`.

    python -m pytest -q -m gpu tests/test_gpu_staging.py
"""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _pin(init_file: str, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from trainbox.parallel.staging import HostPieces, PinnedHost

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    w = distribute_tensor(torch.randn(4096, 1024, device="cuda"), mesh, [Shard(0)])
    state = {"model": {"w": w, "b": torch.randn(1024, device="cuda", dtype=torch.bfloat16)},
             "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": w * 3}}}}
    host = PinnedHost(state, threads=4, piece=8 << 20)
    leaves = [host.state["model"]["w"].to_local(), host.state["model"]["b"],
              host.state["optim"]["state"]["w"]["exp_avg"].to_local()]
    pinned = [t.is_pinned() for t in leaves]
    staged = _copy_state_dict(state, host.state)
    torch.cuda.synchronize()
    equal = (torch.equal(staged["model"]["w"].to_local(), w.to_local().cpu())
             and torch.equal(staged["model"]["b"], state["model"]["b"].cpu())
             and torch.equal(staged["optim"]["state"]["w"]["exp_avg"].to_local(), (w * 3).to_local().cpu())
             and isinstance(staged["model"]["w"], DTensor))
    pieces = len(host.pieces)
    host.close()
    # pieces reserved before the state existed: pinned when made, the state laid out in them, the one left empty
    # unpinned at once
    spare = HostPieces()
    spare.add([16 << 20] * 4, threads=4)
    reserved = [b.is_pinned() for b in spare.bufs]
    left = spare.bufs[3]
    again = PinnedHost(state, threads=4, piece=8 << 20, spare=spare)
    in_spare = [again.state["model"]["w"].to_local(), again.state["optim"]["state"]["w"]["exp_avg"].to_local(),
                again.state["model"]["b"]]
    staged = _copy_state_dict(state, again.state)
    torch.cuda.synchronize()
    refilled = torch.equal(staged["optim"]["state"]["w"]["exp_avg"].to_local(), (w * 3).to_local().cpu())
    spare_pieces, left_pinned = len(again.pieces), left.is_pinned()
    in_spare_pinned = [t.is_pinned() for t in in_spare]
    again.close()

    # pinning told to stop (AsyncSaver.close) after its first piece: that piece pinned, then unpinned by close
    class StopAfterOne(HostPieces):
        def _piece(self, nbytes):
            buf = super()._piece(nbytes)
            self.stop.set()
            return buf

    cut, stopped = StopAfterOne(), ""
    try:
        cut.add([8 << 20] * 3, threads=1)
    except RuntimeError as e:
        stopped = str(e)
    cut_pinned, first = [b.is_pinned() for b in cut.bufs], cut.bufs[0]
    cut.close()
    torch.save({"pinned": pinned, "equal": equal, "pieces": pieces,
                "unpinned": [not t.is_pinned() for t in leaves],
                "reserved": reserved, "in_spare": in_spare_pinned, "refilled": refilled,
                "spare_pieces": spare_pieces, "left_pinned": left_pinned,
                "spare_unpinned": [not t.is_pinned() for t in in_spare],
                "stopped": stopped, "cut_pinned": cut_pinned, "cut_unpinned": not first.is_pinned()}, out_file)
    dist.destroy_process_group()


def test_staging_buffers_are_pinned_filled_and_unpinned(tmp_path):
    p = mp.get_context("spawn").Process(target=_pin, args=(str(tmp_path / "init"), str(tmp_path / "out.pt")))
    p.start()
    p.join(timeout=300)
    assert p.exitcode == 0
    got = torch.load(tmp_path / "out.pt")
    assert got["pinned"] == [True] * 3 and got["equal"], got
    assert got["pieces"] == 2   # 16 MiB, then 2 KiB + 16 MiB: pieces of 8 MiB or more
    assert got["unpinned"] == [True] * 3
    assert got["reserved"] == [True] * 4 and got["in_spare"] == [True] * 3 and got["refilled"], got
    assert got["spare_pieces"] == 3 and not got["left_pinned"] and got["spare_unpinned"] == [True] * 3, got
    assert "after 1 of 3 pieces" in got["stopped"] and got["cut_pinned"] == [True] and got["cut_unpinned"], got
