"""`monitor.memory_snapshot`: the replay of the CUDA allocator's events that memory_peak.rankR.json holds, on a
history written out by hand, and the refusal on a CPU. (The recording itself needs a CUDA GPU.)"""
from __future__ import annotations

import pytest

from trainbox.config import load_config
from trainbox.errors import ConfigError
from trainbox.monitor.memory_snapshot import GiB, site, summarize
from trainbox.train.loop import train

LOOP = [{"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
        {"filename": "/x/src/trainbox/model/llama.py", "line": 100, "name": "forward"},
        {"filename": "/x/src/trainbox/train/loop.py", "line": 231, "name": "train_step"}]
ADAM = [{"filename": "/x/site-packages/torch/optim/adam.py", "line": 178, "name": "_init_group"}]
GRAD = [{"filename": "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "line": 612,
         "name": "foreach_reduce"}]


def test_replay_finds_the_peaks_what_was_live_and_the_pools_by_stream():
    G = GiB
    events = [
        {"action": "segment_map", "size": 6 * G, "stream": 0, "frames": LOOP},
        {"action": "alloc", "addr": 1, "size": 4 * G, "stream": 0, "frames": LOOP},      # activations
        {"action": "alloc", "addr": 2, "size": 1 * G, "stream": 0, "frames": ADAM},      # optimizer state
        {"action": "segment_map", "size": 2 * G, "stream": 7, "frames": GRAD},           # reduce-scatter pool
        {"action": "alloc", "addr": 3, "size": 2 * G, "stream": 7, "frames": GRAD},      # peak: 7 GiB live
        {"action": "free_completed", "addr": 1, "size": 4 * G},
        {"action": "alloc", "addr": 4, "size": 3 * G, "stream": 0, "frames": LOOP},      # 6 GiB: below the peak
        {"action": "free_completed", "addr": 3, "size": 2 * G},
    ]
    got = summarize({"device_traces": [events]})
    assert got["peak_allocated_gib"] == 7 and got["peak_reserved_gib"] == 8 and got["events"] == 8
    assert dict(got["live_at_peak_gib"]) == {site(LOOP): 4, site(GRAD): 2, site(ADAM): 1}
    assert got["pools_at_reserved_peak_gib"] == {"0": 6, "7": 2}
    assert site(LOOP) == "trainbox/model/llama.py:100 forward < trainbox/train/loop.py:231 train_step"
    assert site([{"filename": "/usr/lib/python3.12/threading.py", "line": 1, "name": "run"}]) == "(outside trainbox)"


def test_refused_on_a_cpu_with_what_to_do(tmp_path):
    cfg = load_config("tiny", ["train.device=cpu", "monitor.memory_snapshot=2", "train.max_steps=2",
                               f"run.dir={tmp_path}", "monitor.enabled=false"])
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert "records CUDA's caching allocator" in str(e.value) and "drop monitor.memory_snapshot" in e.value.hint
