"""train.cuda_graphs: the compiled forward and backward replayed as CUDA graphs. Refused where it cannot run; on a
GPU, training with it follows the same losses as the compiled run without it."""
from __future__ import annotations

import pytest
import torch
from nodes import events, losses

from trainbox.config import load_config
from trainbox.config.layout import RunLayout
from trainbox.errors import ConfigError
from trainbox.model.load import load_for_inference
from trainbox.train.loop import train
from trainbox.train.preflight import graphs_resolved, preflight


def test_refused_on_a_cpu_with_what_to_do(tiny):
    cfg = load_config(None, [*tiny, "train.device=cpu", "train.compile=true", "train.cuda_graphs=true"])
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert "train.cuda_graphs replays torch.compile's graphs on a CUDA GPU; this run is on cpu" in str(e.value)
    assert e.value.hint == "drop train.cuda_graphs"


def test_refused_for_several_processes_before_any_starts(tiny):
    """The launcher's pre-flight check (`trainbox train --nproc 2`) refuses it before any worker starts."""
    cfg = load_config(None, [*tiny, "train.device=cpu", "train.compile=true", "train.cuda_graphs=true"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world=2)
    assert "train.cuda_graphs runs in one process; this run has 2" in str(e.value)
    assert e.value.hint == "drop train.cuda_graphs, or train on one GPU"


@pytest.mark.parametrize("setting, message", [
    ("train.compile=false", "train.cuda_graphs replays torch.compile's graphs: set train.compile=true"),
    ("train.objective=dpo", "train.cuda_graphs replays the next-token objective's step, not train.objective=dpo's"),
])
def test_refused_in_the_config_with_what_to_do(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", ["train.compile=auto", "train.cuda_graphs=true", setting])


def _logged(run_dir) -> dict[int, float]:
    return {step: loss for step, (loss, _) in losses(run_dir).items()}


def test_auto_is_on_only_where_graphs_run(tiny):
    """train.cuda_graphs=auto: on for a compiled next-token run in one process on a CUDA GPU, off otherwise (the
    layout says where the run is; train.compile is resolved for the device before)."""
    cfg = load_config(None, [*tiny, "train.compile=true", "train.cuda_graphs=auto"])

    def on(cfg, device="cuda", world=1) -> bool:
        layout = RunLayout(world=world, device=device, strategy="ddp", expert_parallel=1, micro_batch=4,
                           accumulation=2, global_batch=8 * world)
        return graphs_resolved(cfg, layout).train.cuda_graphs

    assert on(cfg) is True
    assert on(cfg, device="cpu") is False
    assert on(cfg, world=2) is False
    assert on(cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})) is False
    assert on(load_config(None, [*tiny, "train.compile=true", "train.cuda_graphs=auto", "train.objective=dpo"])) \
        is False
    assert on(load_config(None, [*tiny, "train.compile=true"])) is False   # the default stays off
    assert preflight(load_config(None, [*tiny, "train.compile=auto", "train.cuda_graphs=auto",
                                        "train.device=cpu"]), world=1).cfg.train.cuda_graphs is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["gpt", "t5"])
@pytest.mark.parametrize("micro", [4, 8])
def test_cuda_graphs_train_as_the_compiled_run_does(tmp_path, tiny, family, micro):
    """Two micro-batches a step (gradients summed in kept tensors) or one (the graph's own, read before the next
    replay; train.cuda_graphs=auto), 8 steps, the losses read every 4 (after later replays), an evaluation and a
    checkpoint after steps 4 and 8: each step's loss, both validation losses and the trained weights equal those of
    the same run without graphs, within what the order of the GPU's sums moves. The weights are compared as one
    vector: a bias that starts at zero holds only AdamW's updates, whose sign flips where its gradient is near zero
    (1.2% apart on one GPU). A micro-batch's gradient lost each step moves every tensor by 1.2% to 98%, so the whole
    vector by more than the 0.1% allowed."""
    t5 = ["model.family=t5", "model.tie_embeddings=false", "model.t5.d_ff=64", "model.t5.d_kv=16"]
    args = [*tiny, *(t5 if family == "t5" else []), "train.device=cuda", "train.compile=true", "train.max_steps=8",
            "monitor.log_every=4", "train.eval_every=4", "train.checkpoint_every=4", f"train.micro_batch_size={micro}"]
    graphs_on = [*args, "run.name=graphs", f"train.cuda_graphs={'true' if micro == 4 else 'auto'}"]
    assert preflight(load_config(None, graphs_on), world=1).cfg.train.cuda_graphs is True
    plain = train(load_config(None, [*args, "run.name=plain"]))
    graphs = train(load_config(None, graphs_on))
    a = _logged(tmp_path / "runs" / "plain")
    b = _logged(tmp_path / "runs" / "graphs")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-3), step
    assert graphs["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-3)
    evals = [{e["step"]: e["val_loss"] for e in events(tmp_path / "runs" / run, "eval")} for run in ("plain", "graphs")]
    assert sorted(evals[1]) == sorted(evals[0]) == [4, 8]   # an evaluation between replays, then training on
    assert evals[1] == pytest.approx(evals[0], rel=1e-3)
    want = load_for_inference(tmp_path / "runs" / "plain")[0].state_dict()
    got = load_for_inference(tmp_path / "runs" / "graphs")[0].state_dict()
    assert sorted(got) == sorted(want)
    diff = torch.cat([(got[n].float() - want[n].float()).flatten() for n in want]).norm()
    assert diff <= 1e-3 * torch.cat([w.float().flatten() for w in want.values()]).norm()
