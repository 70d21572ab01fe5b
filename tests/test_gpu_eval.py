"""lm-eval's adapter on a CUDA GPU: the tiny runs of tests/test_eval.py scored by `trainbox eval` on the GPU equal
lm-eval's hf model on their exports in fp32 (the GPU's attention kernels), and bf16 (autocast over fp32 weights,
`trainbox eval`'s default there) answers every request type.

    python -m pytest -q -m gpu tests/test_gpu_eval.py          # on the GPU machine, with lm-eval installed
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from test_eval import runs  # noqa: F401 - the module fixture: tiny gpt and llama runs, exports, local tasks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_gpu_scores_equal_lm_evals_hf_model(runs, family, tmp_path):  # noqa: F811 - the fixture imported above
    tasks = ",".join(str(runs.tasks[t]) for t in ("tiny_mc", "tiny_gen", "tiny_ll"))
    scores = {}
    for name, source, dtype in (("ours", runs.run(family), "fp32"), ("hf", runs.hf(family), "fp32"),
                                ("ours-bf16", runs.run(family), "bf16")):
        out = tmp_path / name
        run_cli("eval", str(source), "--tasks", tasks, "--device", "cuda", "--dtype", dtype, "--out", str(out))
        scores[name] = json.loads(next(out.glob("*.json")).read_text())["trainbox"]["scores"]
    assert scores["ours"] == scores["hf"]
    assert scores["ours-bf16"].keys() == scores["ours"].keys()
