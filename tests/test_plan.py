"""The memory plan (trainbox.plan, `trainbox plan`): parameter counts equal the built models', the activation
formulas equal what autograd really keeps (saved-tensor hooks plus the selective policy's cache, in real
forwards), the predictions stay within the plan's margin of the GPU peaks in benchmarks/records/, and the
fit / does-not-fit verdicts and their suggestions hold when applied."""
from __future__ import annotations

import json
import re
import statistics
import sys

import pytest
import torch
from conftest import REPO, run_cli
from kept_bytes import Kept

import trainbox.train.recompute as recompute
from trainbox.config import load_config
from trainbox.config.layout import decide_layout
from trainbox.errors import ConfigError
from trainbox.kernels.choice import choose
from trainbox.model.build import build_model
from trainbox.model.spec import family as family_spec
from trainbox.plan import CONTEXT, MARGIN, NCCL, gpu, local_cpu, make_plan, run_vocab
from trainbox.plan.activations import Kernels, Widths, family_activations, weight_copy_bytes
from trainbox.plan.count import build_meta, count_parameters
from trainbox.plan.gpus import GiB
from trainbox.plan.report import format_plan
from trainbox.plan.suggest import GATHERED, GATHERED_GAIN, ONCE, _layouts

SMALL = ["data.tokenizer=embedded:shakespeare-bpe", "model.n_head=4", "model.n_embd=64", "data.seq_len=64",
         "model.n_layer=2", "model.vocab_size=512"]
FAMILIES = {"gpt": [], "moe": ["model.moe.num_experts=4", "model.bias=false"],
            "speedrun": ["model.eot_id=0", "model.head_dim=16", "model.n_layer=4"], "t5": [],
            "llama": ["model.llama.n_kv_head=2", "model.llama.intermediate_size=160"],
            "llama+qk_norm": ["model.llama.n_kv_head=2", "model.llama.intermediate_size=160",   # Qwen3's block:
                              "model.llama.qk_norm=true", "model.head_dim=16"]}   # q/k norms, wider heads
MOE_128 = ["model.moe.num_experts=128", "model.moe.top_k=2", "model.moe.capacity_factor=2"]


def small(family: str, *extra: str):
    """The tiny recipe at SMALL's size as `family` (a key of FAMILIES: the family, or FAMILY+VARIANT)."""
    return load_config("tiny", [*SMALL, f"model.family={family.split('+')[0]}", *FAMILIES[family], *extra])


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_counts_equal_the_built_model(family):
    from trainbox.model.moe.experts import GroupedLinear
    from trainbox.optim.muon import split_params
    cfg = small(family, "optim.name=muon" if family == "speedrun" else "optim.name=adamw")
    counts = count_parameters(cfg, 512)
    model = build_model(cfg.model, 512, cfg.data.seq_len)
    params = dict(model.named_parameters())
    assert counts.total == counts.trainable == sum(p.numel() for p in params.values())
    experts = sum(p.numel() for m in model.modules() if isinstance(m, GroupedLinear) for p in m.parameters())
    assert counts.expert == experts and (experts > 0) == (family == "moe")
    blocks = model.checkpoint_units()
    assert counts.n_blocks == len(blocks)
    assert counts.blocks == sum(p.numel() for b in blocks for p in b.parameters())
    if family == "speedrun":
        assert counts.muon == sum(p.numel() for _, p in split_params(model, list(params.items()))["muon"]) > 0


def test_parameter_counts_at_full_size_without_allocating():
    """The 128-expert moe-gpt2-125m: 7.3B parameters counted on the meta device; the experts are 12 layers x 128
    experts x two 768 x 3072 matrices."""
    cfg = load_config("moe-gpt2-125m", MOE_128)
    counts = count_parameters(cfg, run_vocab(cfg))
    assert counts.expert == 12 * 128 * 2 * 768 * 3072
    dense = load_config("gpt2-125m")
    gpt = count_parameters(dense, run_vocab(dense))
    # the same model less its 12 dense MLPs, plus the experts and 12 routers of 768 x 128
    assert counts.total == gpt.total - 12 * 2 * 768 * 3072 + counts.expert + 12 * 768 * 128


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny Llama folder (hf_tiny: 2 layers, width 32, random weights)."""
    sys.path.insert(0, str(REPO / "tests"))
    import hf_tiny
    return hf_tiny.make_model(tmp_path_factory.mktemp("hf") / "base")


def test_hugging_face_model_counted_from_its_config(hf_llama):
    cfg = load_config("lora", [f"model.path={hf_llama}", "train.device=cpu"])
    counts = count_parameters(cfg, 0)
    model = build_model(cfg.model, 0, 0, run=cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert counts.shapes.gated and counts.shapes.d == 32 and counts.shapes.ffn == 64


def test_the_plan_builds_the_model_with_the_context_it_trains_with(hf_llama):
    """A Llama folder's model supports its max_position_embeddings (256), which a fine-tune's data.seq_len does not
    limit: the plan's model is built with model/build.py context_length, as training builds it."""
    from trainbox.model.build import context_length, resolve_model
    cfg = resolve_model(load_config("sft", [f"model.path={hf_llama}", "data.seq_len=64"]))
    assert cfg.model.family == "llama" and context_length(cfg) == 256
    assert build_meta(cfg, run_vocab(cfg)).block_size == 256


@pytest.mark.parametrize("quant, linear_bytes", [("quant.load_in_4bit=true", 0.5625), ("quant.load_in_8bit=true", 1),
                                                 (None, 2)])
def test_quantized_base_counts_its_linear_layers_quantized_and_the_rest_fp32(hf_llama, quant, linear_bytes):
    """4/8-bit loading (transformers' bitsandbytes integration) quantizes the linear layers but the output head, and
    PEFT's prepare_model_for_kbit_training casts every other parameter of the base to fp32; a bf16 base stays bf16.
    The frozen linear layers are counted here on the Hugging Face model itself."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(hf_llama)
    linear = sum(m.weight.numel() for name, m in base.named_modules()
                 if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"))
    cfg = load_config("lora", [f"model.path={hf_llama}", "train.dtype=bf16", *([quant] if quant else [])])
    plan = make_plan(cfg, run_vocab(cfg), gpu("H200"))
    c = plan.counts
    assert c.frozen_linear == linear and 0 < linear < c.frozen
    rest = 4 if quant else 2
    assert plan.memory.params == int(4 * c.trainable + linear_bytes * linear + rest * (c.frozen - linear))


# ----------------------------------------------------------------------------- activations


def measure(cfg, mode: str, bf16: bool, batch: int = 3) -> int:
    """Bytes autograd keeps for the backward after a forward of `batch` sequences: every tensor the saved-tensor
    hooks see, and what the selective-checkpointing policy caches, by storage, parameters and buffers left out."""
    caches = []
    real = recompute.create_selective_checkpoint_contexts

    def recording(policy, *args, **kwargs):   # the policy's cache, observed: the real contexts are returned
        forward, recomputing = real(policy, *args, **kwargs)
        caches.append(forward.storage)
        return forward, recomputing

    torch.manual_seed(0)
    model = build_model(cfg.model, 512, cfg.data.seq_len)
    kept = Kept([*model.parameters(), *model.buffers()])
    x = torch.randint(1, 300, (batch, cfg.data.seq_len))
    y = torch.randint(1, 300, (batch, 14 if cfg.model.family == "t5" else cfg.data.seq_len))  # t5: 64 -> 14 targets
    recompute.create_selective_checkpoint_contexts = recording
    try:
        recompute.apply_activation_checkpointing(model, mode)
        with kept.hooks(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(x, y, reduction="sum")
    finally:
        recompute.create_selective_checkpoint_contexts = real
    kept.add_caches(caches)
    return kept.total


@pytest.mark.parametrize("family, mode", [(f, m) for f in FAMILIES for m in ("none", "selective", "full")]
                         + [("moe", "experts")])
def test_activation_formulas_equal_what_autograd_keeps(family, mode):
    """fp32 as a CPU run trains (the plan as `trainbox plan` makes it here), and under bf16 autocast (the
    formulas' 16-bit widths), within 1% of the bytes really kept; gpt with its fused loss."""
    cfg = small(family, f"train.activation_checkpointing={mode}", "train.micro_batch_size=3",
                "train.global_batch_size=3", *(["model.fused_loss=true"] if family == "gpt" else []))
    assert make_plan(cfg, 512, local_cpu()).activations.saved == pytest.approx(measure(cfg, mode, False), rel=0.01)
    k = choose(cfg.model, torch.device("cpu"), family_spec(cfg.model.family))
    kernels = Kernels(k.attention, k.fused_loss, k.fused_mlp, k.fp8)
    widths = Widths(a=2, r=2 if family == "speedrun" else 4, cuda=False)   # speedrun: a bf16 residual stream
    counts = count_parameters(cfg, 512)
    bf16 = family_activations(cfg, counts, 512, 3, mode, widths, kernels)
    assert bf16.saved + weight_copy_bytes(counts, widths, mode) == pytest.approx(measure(cfg, mode, True), rel=0.01)


def test_compiled_llama_activations_equal_what_inductor_keeps(monkeypatch):
    """A compiled Llama (Inductor on a CPU, bf16 autocast) keeps its norms' outputs once and makes SiLU(gate) again
    in the backward: the plan's compiled formula within 3% of the bytes its graph saves (the eager formula, applied
    to the compiled run, is 20% above)."""
    cfg = small("llama", "train.activation_checkpointing=none", "train.micro_batch_size=3",
                "train.global_batch_size=3", "model.n_layer=2", "model.n_embd=128", "model.n_head=4",
                "model.llama.intermediate_size=352", "train.compile=true")
    real = build_model

    def compiled(*args, **kwargs):
        model = real(*args, **kwargs)
        model.forward = torch.compile(model.forward)
        return model
    monkeypatch.setattr(sys.modules[__name__], "build_model", compiled)
    k = choose(cfg.model, torch.device("cpu"), family_spec("llama"))
    kernels = Kernels(k.attention, k.fused_loss, k.fused_mlp, k.fp8)
    widths = Widths(a=2, r=4, cuda=False, compiled=True)
    counts = count_parameters(cfg, 512)
    plan = family_activations(cfg, counts, 512, 3, "none", widths, kernels).saved + \
        weight_copy_bytes(counts, widths, "none")
    assert plan == pytest.approx(measure(cfg, "none", True), rel=0.03)


def test_lora_activations_equal_what_autograd_keeps(hf_llama):
    """A Hugging Face Llama under LoRA (frozen base, adapters with dropout) takes the Llama-style block."""
    cfg = load_config("lora", [f"model.path={hf_llama}", "train.device=cpu", "lora.gradient_checkpointing=false",
                               "data.seq_len=64", "train.micro_batch_size=3", "train.global_batch_size=3"])
    model = build_model(cfg.model, 0, 0, run=cfg)
    x = torch.randint(1, 300, (3, 64))
    kept = Kept([*model.parameters(), *model.buffers()])
    with kept.hooks():
        model(x, x, reduction="sum")
    assert make_plan(cfg, 0, local_cpu()).activations.saved == pytest.approx(kept.total, rel=0.02)


def measure_dpo(cfg) -> tuple[int, int]:
    """(bytes autograd keeps for the backward of the preference objective's loss on 3 pairs (6 sequences), bytes of
    the reference's parameters the trainer builds beside the model), measured as `measure` does."""
    from trainbox.objective import Runtime, build_objective
    from trainbox.train.build import frozen_copy
    torch.manual_seed(0)
    model = build_model(cfg.model, 512, cfg.data.seq_len)
    objective = build_objective(cfg)
    reference = frozen_copy(model, torch.float32) if objective.frozen_copy(cfg) else None
    objective.attach(Runtime(cfg, model, model, reference, torch.device("cpu"), None, None, None, None))
    kept = Kept([t for m in (model, reference) if m is not None for t in [*m.parameters(), *m.buffers()]])

    T = cfg.data.seq_len
    batch = {"x": torch.randint(1, 300, (6, T)), "y": torch.randint(1, 300, (6, T)),
             "loss_mask": torch.rand(6, T) > 0.3, "ref_logps": -torch.rand(6) * 50}
    if reference is not None:
        del batch["ref_logps"]
    with kept.hooks():
        objective.loss(model, batch, 1 / 3)
    held = sum(p.numel() * p.element_size() for p in reference.parameters()) if reference is not None else 0
    return kept.total, held


@pytest.mark.parametrize("reference", ["precompute", "model"])
def test_dpo_plan_counts_both_sequences_of_a_pair_and_the_reference(reference):
    """train.objective=dpo: a micro-batch of 3 pairs keeps what 6 sequences keep, within 1% of the bytes autograd
    keeps in the objective's real forward on a CPU; the reference adds the frozen copy's parameters (exactly what
    the trainer builds) only with dpo.reference=model, halved under fsdp on 2 processes."""
    extra = ["train.objective=dpo", f"dpo.reference={reference}", "train.micro_batch_size=3",
             "train.global_batch_size=3"]
    cfg = small("llama", *extra)
    plain = make_plan(small("llama", "train.micro_batch_size=6", "train.global_batch_size=6"), 512, local_cpu())
    plan = make_plan(cfg, 512, local_cpu())
    saved, held = measure_dpo(cfg)
    assert plan.sequences == 2 and plan.activations.saved == plain.activations.saved
    assert plan.activations.saved == pytest.approx(saved, rel=0.01)
    assert plan.memory.reference == held == (4 * count_parameters(cfg, 512).total if reference == "model" else 0)
    assert plan.memory.needed == plain.memory.needed + held
    sharded = small("llama", *extra, "train.parallel=fsdp", "train.global_batch_size=6", "optim.name=adamw")
    assert make_plan(sharded, 512, local_cpu(), nproc=2).memory.reference == held // 2
    card = make_plan(small("llama", *extra), 512, gpu("H100")).memory   # bf16 on a GPU: 2 bytes a parameter
    assert card.reference == held // 2


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_dpo_reference_under_expert_parallelism_holds_this_ranks_experts(parallel):
    """The frozen copy of an expert-parallel model (train/build.py frozen_copy) keeps this rank's expert shard, as the
    model does, and its dense part as the model's strategy spreads it."""
    extra = ["train.objective=dpo", "dpo.reference=model", "model.moe.expert_parallel=2", f"train.parallel={parallel}",
             "train.micro_batch_size=3", "train.global_batch_size=6", "optim.name=adamw"]
    cfg = small("moe", *extra)
    counts = count_parameters(cfg, 512)
    assert counts.expert > 0
    dense = counts.total - counts.expert
    want = 4 * (dense / (2 if parallel == "fsdp" else 1) + counts.expert / 2)
    assert make_plan(cfg, 512, local_cpu(), nproc=2).memory.reference == int(want)


def test_dpo_plan_of_lora_has_no_reference_and_the_preflight_check_uses_the_plan(hf_llama):
    """LoRA's reference is its base with the adapters off: nothing beside it. The pre-flight check refuses a dpo
    run whose frozen copy does not fit where the precomputed reference does."""
    from trainbox.train.memory import check_memory
    lora = load_config("dpo", [f"model.path={hf_llama}", "model.family=hf", "train.device=cpu",
                               "dpo.reference=model", "data.seq_len=64"])
    assert make_plan(lora, 0, local_cpu()).memory.reference == 0
    cfgs = {r: small("llama", "train.objective=dpo", f"dpo.reference={r}") for r in ("precompute", "model")}
    needed = {r: make_plan(c, 512, local_cpu()).memory.needed for r, c in cfgs.items()}
    assert needed["model"] > needed["precompute"]
    free = int((needed["model"] + needed["precompute"]) / 2 * (1 - MARGIN))
    assert check_memory(cfgs["precompute"], 512, torch.device("cpu"), torch.float32, free=free) is not None
    with pytest.raises(ConfigError, match="this run needs about"):
        check_memory(cfgs["model"], 512, torch.device("cpu"), torch.float32, free=free)


def test_the_grpo_plan_counts_the_weights_copy_it_samples_through(hf_llama):
    """grpo.sampling_copy, in the compute dtype (bf16 on an H200): a LoRA run copies its base's linear layers with
    the adapters merged (the head is bf16 already), a 4-bit one its linear layers dequantized and its fp32 head;
    full fine-tuning of fp32 weights under autocast every weight a matmul reads; fsdp's gathered weights are bf16
    already, and grpo.sampling_copy=false copies nothing. The sampling row names the copy."""
    from trainbox.model.build import resolve_model
    common = [f"model.path={hf_llama}", "grpo.rewards=[rewards.py:f]", "train.dtype=bf16", "data.seq_len=64",
              "grpo.max_completion_len=32"]

    def copy(*extra: str, family: str = "hf", nproc: int = 1) -> tuple[int, object]:
        cfg = resolve_model(load_config("grpo", [*common, f"model.family={family}", *extra]))
        plan = make_plan(cfg, run_vocab(cfg), gpu("H200"), nproc)
        return plan.memory.sampling_copy, plan

    lora, plan = copy()
    vocab = run_vocab(resolve_model(load_config("grpo", [*common, "model.family=hf"])))
    linear, head = plan.counts.frozen_linear, plan.counts.shapes.d * vocab
    assert lora == 2 * linear > 0
    assert copy("quant.load_in_4bit=true")[0] == 2 * (linear + head)
    full, plan = copy(family="llama")
    assert full == 2 * plan.counts.matmul and plan.counts.matmul == linear + head   # untied: the head's own
    assert copy("train.parallel=fsdp", family="llama", nproc=2)[0] == 0
    assert copy("grpo.sampling_copy=false")[0] == copy("grpo.sampling_copy=false", family="llama")[0] == 0
    big, plan = copy("train.global_batch_size=64", "grpo.num_generations=64")   # sampling above the step's peak
    assert plan.memory.sampling > 0 and f"the weights' copy {lora / GiB:.1f}" in format_plan(plan)


def test_plan_command_shows_the_pairs_and_the_reference(hf_llama):
    out = run_cli("plan", "dpo", f"model.path={hf_llama}", "dpo.reference=model", "train.micro_batch_size=4",
                  "--gpu", "H100").stdout
    assert "micro-batch 4 pairs (8 sequences)" in out and "reference" in out


# ----------------------------------------------------------------------------- GPU records


# (record file, overrides, kernels that ran: attention, fused loss, fused MLP, fp8)
RECORDS = [
    ("2026-11-27-h100-gpt2-125m-train-speed.json", [], ("flash", "quack", "quack", "off")),
    ("2026-11-27-h100-gpt2-125m-step-time-vs-70ca097.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-27-h100-moe-gpt2-125m-train-speed.json", [], ("flash", "quack", "quack", "off")),
    ("2026-11-27-h100-moe-gpt2-125m-step-time-vs-70ca097.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-27-h100-speedrun-124m-step-time-vs-70ca097.json", [], ("flex", "triton", "off", "fp8")),
    ("2026-11-26-h100-speedrun-124m-bf16-profile.json", ["model.fp8_head=false", "model.fp8_mlp=none"],
     ("flash", "triton", "off", "off")),
    ("2026-11-26-h100-speedrun-124m-fp8-mlp-both-profile.json", [], ("flash", "quack", "off", "fp8")),  # no QuACK:
    ("2026-11-26-h100-speedrun-350m-profile.json", [], ("flash", "off", "off", "off")),                  # soft cap
    ("2026-11-27-2xh200-gpt2-125m-scaling-2gpu.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-27-4xh200-gpt2-125m-scaling-4gpu.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-27-2xh200-llama-1b-fsdp-2gpu-bf16-async-save.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-27-4xh200-llama-8b-fsdp-4gpu-bf16.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-27-2xh200-llama-8b-fsdp-2gpu-bf16.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-27-2xh200-llama-1b-fsdp-2gpu-float8-200-seed1.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-27-2xh200-gpt2-125m-fsdp-vs-ddp-2gpu.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-27-h200-moe-gpt2-125m-1gpu-baseline.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-27-2xh200-llama-1b-fsdp-2gpu-bf16-table-apart.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-27-2xh200-llama-8b-fsdp-2gpu-bf16-table-apart.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-27-2xh200-llama-1b-fsdp-2gpu-bf16-flash.json", [], ("sdpa", "quack", "off", "off")),
    ("2026-11-27-2xh200-llama-8b-fsdp-2gpu-bf16-flash.json", [], ("sdpa", "quack", "off", "off")),
    ("2026-11-27-2xh200-llama-1b-fsdp-2gpu-bf16-flash-grads-in-compute-pool.json", [], ("sdpa", "quack", "off", "off")),
    ("2026-11-27-2xh200-llama-8b-fsdp-2gpu-bf16-flash-grads-in-compute-pool.json", [], ("sdpa", "quack", "off", "off")),
    ("2026-11-28-4xh200-llama-8b-fsdp-4gpu-bf16.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-28-4xh200-llama-8b-fsdp-4gpu-float8.json", [], ("sdpa", "triton", "off", "off")),
    ("2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-padded-vs-uneven-h100mem.json", [],
     ("sdpa", "triton", "unfused", "off")),
    ("2026-11-28-4xh200-moe-gpt2-125m-128x-4gpu-plan-first-two-h100mem.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-29-2xh200-moe-gpt2-125m-128x-ep2-ddp-mb16-h100mem.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-29-2xh200-moe-gpt2-125m-ep2-vs-ddp-2gpu.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-29-2xh200-moe-gpt2-125m-ep2-vs-ddp-2gpu-2.json", [], ("sdpa", "triton", "unfused", "off")),
    ("2026-11-29-2xh200-moe-gpt2-125m-128x-ep2-fsdp-vs-ddp-mb16-h100mem.json", [],
     ("sdpa", "triton", "unfused", "off")),
    ("2026-11-29-2xh200-moe-gpt2-125m-128x-ep2-fsdp-vs-ddp-bf16-mb40-h100mem.json", [],
     ("sdpa", "triton", "unfused", "off")),
    ("2026-11-28-h200-speedrun-124m-scaling-1gpu.json", [], ("flex", "triton", "off", "fp8")),
    ("2026-11-28-2xh200-speedrun-124m-scaling-2gpu.json", [], ("flex", "triton", "off", "fp8")),
    ("2026-11-28-4xh200-speedrun-124m-scaling-4gpu.json", [], ("flex", "triton", "off", "fp8")),
    # the experts' hidden layer recomputed (train.activation_checkpointing=experts) at micro-batch 30
    ("2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-experts-mb30-h100mem.json", [],
     ("sdpa", "triton", "unfused", "off")),
    ("2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-experts-mb30-alternating-1-h100mem.json", [],
     ("sdpa", "triton", "unfused", "off")),
    ("2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-experts-mb30-graph-vs-host-h100mem.json", [],
     ("sdpa", "triton", "unfused", "off")),
]
# Not listed: the expert-parallel runs measured before the exchanges were functional collectives inside the experts'
# compiled graph (commit e95f0b8): there the partitioner recomputed the experts' GELU in the backward, which it now
# keeps (model/moe/memory.py); 2026-11-27-2xh200-moe-gpt2-125m-ep2-vs-ddp-2gpu.json (30.3 GiB) is measured again by
# 2026-11-29-2xh200-moe-gpt2-125m-ep2-vs-ddp-2gpu.json (39.2 GiB), and the 128-expert runs of 2026-11-27 and of
# 2026-11-28 at 2c5a35f (ep2-2gpu-drops, ep4-4gpu, ep4-4gpu-mb120, ep2-vs-torchtitan) ran that code too.
# fsdp runs measured while FSDP's gradient shards had the reduce-scatter stream's pool to themselves (the
# records of 2026-11-27 without "compute-pool" in their name; every later run has them in the compute pool)
SIDE_STREAM_GRADS = {r for r, _, _ in RECORDS if "fsdp" in r and "compute-pool" not in r and r < "2026-11-28"}


@pytest.mark.parametrize("record, extra, ran", RECORDS, ids=[r[0][11:-5] for r in RECORDS])
def test_prediction_within_the_margin_of_measured_gpu_peaks(record, extra, ran):
    """torch.cuda.max_memory_allocated of the recipes on H100s and H200s (benchmarks/records/, rank 0's on several
    GPUs) against peak_allocated; where the record has it, max_memory_reserved with the CUDA context (and NCCL's
    buffers on several GPUs) against the total, at or above it: the total is what the pre-flight check holds
    against the free memory (under fsdp it holds FSDP's stream pools: 1.1 GiB of llama-1b's 26.1 reserved with
    the gradient shards in the compute stream's pool, 4.2 of 30.5 with them in a pool of their own)."""
    rec = json.loads((REPO / "benchmarks" / "records" / record).read_text())
    cfg = load_config(rec["recipe"], [*rec["overrides"], *extra])
    card = gpu("H200" if "H200" in rec["gpu"]["name"] else "H100")
    nproc = rec["metrics"].get("nproc", 1)
    plan = make_plan(cfg, run_vocab(cfg), card, nproc, kernels=Kernels(*ran),
                     side_stream_grads=record in SIDE_STREAM_GRADS)
    measured = rec["metrics"]["peak_mem_gib"] * GiB
    assert abs(plan.memory.peak_allocated / measured - 1) < MARGIN, plan.memory
    if rec["metrics"].get("peak_reserved_gib"):
        held = rec["metrics"]["peak_reserved_gib"] * GiB + CONTEXT + (NCCL if nproc > 1 else 0)
        assert plan.memory.total >= held, plan.memory
        # Under expert parallelism with a capacity, dropped assignments are never sent, so the experts hold fewer
        # activations than the plan's no-drop bound: the 128-expert EP4 run at micro-batch 120 dropped 24-69% of
        # its assignments, and its total is 15.04% above. The bound is kept (a router that balances drops nothing);
        # the allocated peak above is held to the margin all the same.
        drops = statistics.fmean(rec["metrics"].get("moe_dropped_frac") or [0])
        assert plan.memory.total / held - 1 < MARGIN + (0.05 if plan.drops_unsent and drops > 0.2 else 0), plan.memory


@pytest.mark.parametrize("part", ["full", "longest"])
def test_dpo_prediction_within_the_margin_of_its_measured_peaks(tmp_path, part):
    """Full DPO as benchmarks/dpo_speed.py ran it on an H100's memory: the Qwen2.5-0.5B-shaped model compiled at 4
    pairs of 1,024 tokens, and the Llama-3.2-1B-shaped one at the longest sequence that fitted (one pair of 65,536
    tokens, full checkpointing; the head's gradient recomputed by chunks), from their config.json alone."""
    from transformers import LlamaConfig, Qwen2Config
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import HF_SIZES as SIZES
    from common import POSITIONS
    rec = json.loads((REPO / "benchmarks/records/2026-11-28-h200-dpo-0.5b-speed.json").read_text())
    m = rec["metrics"]
    size = "0.5b" if part == "full" else m["longest"]["size"]
    spec = dict(SIZES[size])
    config = Qwen2Config if spec.pop("arch") == "qwen2" else LlamaConfig
    config(**spec, max_position_embeddings=POSITIONS, eos_token_id=0, bos_token_id=0).save_pretrained(tmp_path)
    if part == "full":
        run = [f"data.seq_len={m['seq_len']}", f"train.micro_batch_size={m['micro_batch_pairs']}"]
        measured = m["full"]["peak_memory_gib"]
    else:
        length = m["longest"]["ours"]["longest"]
        run = [f"data.seq_len={length}", "train.micro_batch_size=1", "train.activation_checkpointing=full"]
        measured = m["longest"]["ours"]["tried"][str(length)]["peak_memory_gib"]
    from trainbox.model.build import resolve_model
    cfg = resolve_model(load_config("dpo", [f"model.path={tmp_path}", "data.tokenizer=gpt2", "model.fused_loss=true",
                                            *run, "train.global_batch_size=" + run[1].split("=")[1]]))
    plan = make_plan(cfg, run_vocab(cfg), gpu("H100"), kernels=Kernels("sdpa", "triton", "off", "off"))
    assert abs(plan.memory.peak_allocated / (measured * GiB) - 1) < MARGIN, plan.memory


def test_grpo_prediction_within_the_margin_of_its_measured_peak(tmp_path):
    """GRPO as benchmarks/grpo_speed.py ran it on an H100's memory, a step whose sampling holds more than its training
    (1,024 completions of 512 tokens sampled together, 4 prompts a micro-batch): the Qwen2.5-0.5B-shaped model from
    its config.json alone. The plan's sampling row (KV caches, prefill, draw) makes its peak; without it the plan is
    22% short."""
    from transformers import LlamaConfig, Qwen2Config
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import HF_SIZES as SIZES
    from common import POSITIONS
    rec = json.loads((REPO / "benchmarks/records/2026-12-02-h200-grpo-0.5b-speed-2.json").read_text())
    m = rec["metrics"]
    spec = dict(SIZES[m["size"]])
    config = Qwen2Config if spec.pop("arch") == "qwen2" else LlamaConfig
    config(**spec, max_position_embeddings=POSITIONS, eos_token_id=0, bos_token_id=0).save_pretrained(tmp_path)
    from trainbox.model.build import resolve_model
    cfg = resolve_model(load_config("grpo", [
        f"model.path={tmp_path}", "data.tokenizer=gpt2", f"data.seq_len={m['prompt_len'] + m['completion_len']}",
        f"grpo.max_completion_len={m['completion_len']}", f"grpo.num_generations={m['generations']}",
        "grpo.rewards=[rewards.py:f]", f"train.micro_batch_size={m['micro_prompts']}",
        f"train.global_batch_size={m['prompts']}", "train.dtype=bf16", "grpo.sampling_copy=false",   # as it ran
        *rec["overrides"]]))
    plan = make_plan(cfg, run_vocab(cfg), gpu("H100"), kernels=Kernels("sdpa", "triton", "off", "off"))
    measured = m["full"]["peak_memory_gib"] * GiB
    assert plan.memory.sampling > 0 and abs(plan.memory.peak_allocated / measured - 1) < MARGIN, plan.memory
    assert (plan.memory.peak_allocated - plan.memory.sampling) / measured - 1 < -MARGIN   # the row is needed
    from trainbox.plan.report import format_plan
    row = next(line for line in format_plan(plan).splitlines() if line.strip().startswith("sampling"))
    # the caches: 1,024 rows x 640 positions x 24 blocks x keys and values x 128 wide x 2 bytes
    assert f"{plan.memory.sampling / GiB:.2f}" in row and "KV caches 7.50 GiB" in row, row


@pytest.mark.parametrize("mode, record", [("lora", "2026-11-29-h200-lora-0.5b-speed.json"),
                                          ("qlora", "2026-11-29-h200-lora-0.5b-speed-2.json")])
def test_lora_and_qlora_predictions_within_the_margin_of_their_measured_peaks(tmp_path, mode, record):
    """LoRA and QLoRA as benchmarks/lora_speed.py ran them on an H200 (compiled, gradient checkpointing, 8 x 1,024
    tokens): the 0.5B Llama-shaped model from its config.json alone, its vocabulary (the logits) included. LoRA's
    bf16 base carries a bf16 residual stream; QLoRA's keeps what bitsandbytes and PEFT's
    prepare_model_for_kbit_training leave: NF4 linear layers, fp32 embeddings and norms, an fp32 residual stream."""
    from transformers import LlamaConfig
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lora_speed import LORA, SIZES
    rec = json.loads((REPO / "benchmarks" / "records" / record).read_text())
    m = rec["metrics"]
    LlamaConfig(**SIZES[m["size"]], max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=0,
                bos_token_id=0).save_pretrained(tmp_path)
    from trainbox.model.build import resolve_model
    cfg = resolve_model(load_config("lora", [
        f"model.path={tmp_path}", f"data.seq_len={m['seq_len']}", f"train.micro_batch_size={m['micro_batch']}",
        f"train.global_batch_size={m['micro_batch'] * m['accum']}", f"lora.r={LORA['r']}",
        f"lora.alpha={LORA['alpha']}", f"lora.dropout={LORA['dropout']}", "train.dtype=bf16",
        *(["quant.load_in_4bit=true"] if mode == "qlora" else [])]))
    assert run_vocab(cfg) == SIZES[m["size"]]["vocab_size"]   # the base's own, read from its config.json
    plan = make_plan(cfg, run_vocab(cfg), gpu("H200"))
    assert abs(plan.memory.peak_allocated / (m[mode]["peak_memory_gib"] * GiB) - 1) < MARGIN, plan.memory


def test_t5_prediction_within_the_margin_of_its_measured_step():
    rec = json.loads((REPO / "benchmarks/records/2026-11-26-h100-t5-base-speed.json").read_text())
    ours = rec["metrics"]["results"][0]   # trainbox's T5, compiled, one micro-batch of 32 per step
    cfg = load_config("t5-base", ["train.micro_batch_size=32", "train.global_batch_size=32"])
    plan = make_plan(cfg, run_vocab(cfg), gpu("H100"), kernels=Kernels("sdpa", "off", "off", "off"))
    assert abs(plan.memory.peak_allocated / (ours["max_memory_allocated_gib"] * GiB) - 1) < MARGIN


# ----------------------------------------------------------------------------- layouts, verdicts, suggestions


def test_layouts_shard_what_they_claim():
    cfg = load_config("moe-gpt2-125m", MOE_128)
    vocab = run_vocab(cfg)
    c = count_parameters(cfg, vocab)
    ddp = make_plan(cfg, vocab, gpu("H200"), nproc=2, suggest=False).memory
    assert ddp.params == 4 * c.trainable and ddp.optimizer == 8 * c.trainable and ddp.comm >= 4 * c.trainable
    fsdp = make_plan(load_config("moe-gpt2-125m", [*MOE_128, "train.parallel=fsdp"]), vocab, gpu("H200"), nproc=2,
                     suggest=False).memory
    assert fsdp.params == 4 * c.trainable // 2 and fsdp.gradients == fsdp.params
    ep = make_plan(load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=2"]), vocab, gpu("H200"),
                   nproc=2, suggest=False).memory
    assert ep.params == 4 * (c.dense + c.expert // 2)
    assert ep.comm < 4 * c.dense + 4 * 2 * 48 * 1024 * 768 * 2 * 1.01   # buckets of the dense part, all-to-all
    with pytest.raises(ConfigError, match="does not divide"):
        make_plan(load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=4"]), vocab, gpu("H100"),
                  nproc=2)


@pytest.mark.parametrize("nproc, ep", [(2, 2), (4, 2), (4, 4)])
def test_fsdp_with_expert_parallelism_shards_the_dense_part_and_keeps_a_ranks_experts_whole(nproc, ep):
    """fsdp + expert parallelism on H100s: FSDP shards the dense parameters over every rank and ignores the experts,
    whose 1/ep share a rank keeps whole as under ddp: fp32 parameters, gradients and AdamW's moments of
    dense / world + expert / ep, less than ddp + expert parallelism's by the dense part's (world - 1) / world; the
    experts' 16-bit copies held in every checkpointing mode; FSDP's gathered blocks without their experts, beside
    the same all-to-all buffers as under ddp. Plain fsdp and ddp + expert parallelism keep their own counts."""
    over = [*MOE_128, f"model.moe.expert_parallel={ep}", "train.micro_batch_size=12"]
    cfg = load_config("moe-gpt2-125m", over)
    vocab = run_vocab(cfg)
    plans = {(p, mode): make_plan(load_config("moe-gpt2-125m", [*over, f"train.parallel={p}",
                                                                f"train.activation_checkpointing={mode}"]),
                                  vocab, gpu("H100"), nproc, suggest=False)
             for p in ("ddp", "fsdp") for mode in ("none", "selective")}
    fsdp, ddp = plans["fsdp", "none"], plans["ddp", "none"]
    assert (fsdp.layout.parallel, fsdp.layout.expert_parallel, ddp.layout.parallel) == ("fsdp", ep, "ddp")
    assert fsdp.accumulation > 1   # the earlier micro-batches' gradients are there at the peak
    c = fsdp.counts
    local = c.dense / nproc + c.expert / ep
    assert (fsdp.memory.params, fsdp.memory.gradients, fsdp.memory.optimizer) == \
        (int(4 * local), int(4 * local), int(8 * local))
    held = c.dense + c.expert / ep   # ddp + expert parallelism: the dense parameters whole on every rank
    assert (ddp.memory.params, ddp.memory.gradients, ddp.memory.optimizer) == (int(4 * held), int(4 * held),
                                                                               int(8 * held))
    dense_share = c.dense * (nproc - 1) / nproc
    assert ddp.memory.params - fsdp.memory.params == pytest.approx(4 * dense_share, abs=2) and dense_share > 0
    assert ddp.memory.optimizer - fsdp.memory.optimizer == pytest.approx(8 * dense_share, abs=2)
    for mode in ("none", "selective"):   # the experts' bf16 copies (expert.keep_casts), FSDP's gathers apart
        assert plans["fsdp", mode].activations.weight_copies == int(c.expert / ep * 2)
    exchange = ddp.memory.comm - 4 * c.dense   # ddp: the dense gradient buckets and the all-to-all buffers
    assert exchange == 4 * 2 * 12 * 1024 * 768 * 2
    unit = c.largest_block - c.expert / c.n_blocks   # a block without its experts
    gathered = 2 * (2 * unit + c.root) + 2 * c.root + (2 + 2 * 4) * unit
    assert fsdp.memory.comm == int(gathered + exchange)
    text = format_plan(fsdp)
    assert f"(dense parameters, gradients and optimizer state 1/{nproc} per GPU;" in text
    assert f"experts 1/{ep} per GPU" in text
    plain = make_plan(load_config("moe-gpt2-125m", [*MOE_128, "train.parallel=fsdp", "train.micro_batch_size=12"]),
                      vocab, gpu("H100"), nproc, suggest=False)
    assert plain.memory.params == int(4 * c.trainable / nproc) and plain.activations.weight_copies == 0
    assert plain.memory.comm == int(2 * (2 * c.largest_block + c.root) + 2 * c.root + 10 * c.largest_block)


@pytest.mark.parametrize("extra", [[], ["model.moe.expert_parallel=2"], ["train.parallel=fsdp"]])
def test_bf16_optimizer_state_counts_two_bytes_a_moment(extra):
    """8 bytes of AdamW state a parameter a rank keeps in fp32, 4 in bf16, under every layout; Muon's momentum
    stays 4."""
    plans = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config("moe-gpt2-125m", [*MOE_128, *extra, f"optim.state_dtype={dtype}"])
        plans[dtype] = make_plan(cfg, run_vocab(cfg), gpu("H200"), nproc=2, suggest=False)
    fp32, bf16 = plans["fp32"].memory, plans["bf16"].memory
    # the parameters a rank keeps: 4 bytes each (a rank's share under fsdp may be a fraction: 2 bytes of rounding)
    assert fp32.optimizer == pytest.approx(2 * fp32.params, abs=2)
    assert bf16.optimizer == pytest.approx(fp32.params, abs=2)
    assert fp32.peak_allocated - bf16.peak_allocated == fp32.optimizer - bf16.optimizer
    assert "AdamW: two bf16 moments" in format_plan(plans["bf16"])
    muon = {d: load_config("tiny", ["optim.name=muon", f"optim.state_dtype={d}"]) for d in ("fp32", "bf16")}
    c = count_parameters(muon["fp32"], run_vocab(muon["fp32"]))
    got = {d: make_plan(cfg, run_vocab(cfg), gpu("H200"), suggest=False).memory.optimizer for d, cfg in muon.items()}
    assert got == {"fp32": 4 * c.muon + 8 * (c.trainable - c.muon), "bf16": 4 * c.muon + 4 * (c.trainable - c.muon)}


def test_verdicts_and_suggestions_that_fit_when_applied():
    dense = load_config("gpt2-125m")
    assert make_plan(dense, run_vocab(dense), gpu("H100")).fits
    cfg = load_config("moe-gpt2-125m", MOE_128)
    vocab = run_vocab(cfg)
    one = make_plan(cfg, vocab, gpu("H100"))
    assert not one.fits and one.memory.total > 100 * GiB   # 7.3B parameters: 16 bytes each before activations
    two = make_plan(cfg, vocab, gpu("H100"), nproc=2)
    assert not two.fits
    kinds = {s.what for s in [*one.suggestions, *two.suggestions]}
    assert "expert parallelism" in kinds or "fsdp" in kinds
    split = load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=2"])   # given by the user
    ep2 = make_plan(split, vocab, gpu("H100"), nproc=2)
    assert not ep2.fits and ep2.suggestions
    for plan, given in ((one, []), (two, []), (ep2, ["model.moe.expert_parallel=2"])):
        for s in plan.suggestions:   # each suggestion, applied over the user's overrides, fits
            applied_cfg = load_config("moe-gpt2-125m", [*MOE_128, *given, *s.overrides])
            decide_layout(applied_cfg, s.nproc)   # a layout the trainer runs
            applied = make_plan(applied_cfg, vocab, gpu("H100"), nproc=s.nproc, suggest=False)
            assert applied.fits and applied.memory.needed == s.needed, s
    big = load_config("gpt2-125m", ["train.micro_batch_size=240", "train.global_batch_size=480"])
    plan = make_plan(big, vocab, gpu("A100-40GB"))
    micro = next(s for s in plan.suggestions if s.what == "micro-batch")
    size = int(micro.overrides[0].split("=")[1])
    larger = min(b for b in range(size + 1, 241) if 480 % b == 0)   # the next size the batch plan accepts
    assert not make_plan(load_config("gpt2-125m", ["train.global_batch_size=480", f"train.micro_batch_size={larger}"]),
                         vocab, gpu("A100-40GB"), suggest=False).fits


def test_layouts_offer_every_expert_parallel_degree_with_ddp_and_with_fsdp():
    """On 4 GPUs the 128-expert MoE runs as configured (ddp), under fsdp, and at expert parallelism 2 and 4 with
    each strategy, each fsdp layout also with its blocks kept gathered (train.reshard_after_forward=false), and so
    with its gradients reduced once a step (train.grad_reduce=step): every
    layout offered is the one config/layout.py decides for its overrides, and the one the config with them plans. A
    plan already at expert parallelism 2 is offered fsdp at that degree, and one configured with fsdp is offered ddp
    beside it."""
    cfg = load_config("moe-gpt2-125m", MOE_128)
    cfg = decide_layout(cfg, 4, "cuda", adapt_micro_batch=True).applied(cfg)
    base = make_plan(cfg, run_vocab(cfg), gpu("H100"), 4, suggest=False).layout
    layouts = _layouts(cfg, base, 4)
    fsdp1, fsdp2, fsdp4 = (("train.parallel=fsdp", *([f"model.moe.expert_parallel={n}"] if n > 1 else []))
                           for n in (1, 2, 4))
    def twins(over, ep):
        return [(("fsdp", ep, True, "micro_batch"), over), (("fsdp", ep, False, "micro_batch"), (*over, GATHERED)),
                (("fsdp", ep, False, "step"), (*over, GATHERED, ONCE))]
    assert [((x.parallel, x.expert_parallel, x.reshard_after_forward, x.grad_reduce), over)
            for x, over in layouts] == [
        (("ddp", 1, True, "micro_batch"), ()), *twins(fsdp1, 1),
        (("ddp", 2, True, "micro_batch"), ("model.moe.expert_parallel=2",)),
        (("ddp", 4, True, "micro_batch"), ("model.moe.expert_parallel=4",)), *twins(fsdp2, 2),
        *twins(fsdp4, 4)]
    for x, over in layouts:
        run = decide_layout(load_config("moe-gpt2-125m", [*MOE_128, *over]), 4, "cuda", adapt_micro_batch=True)
        assert (run.strategy, run.expert_parallel) == (x.parallel, x.expert_parallel) and x.nproc == 4
        micro = f"train.micro_batch_size={cfg.train.micro_batch_size}"
        applied = load_config("moe-gpt2-125m", [*MOE_128, *over, micro])
        assert make_plan(applied, run_vocab(applied), gpu("H100"), 4, suggest=False).layout == x
    ep2 = load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=2"])
    plan = make_plan(ep2, run_vocab(ep2), gpu("H100"), 2)
    assert [(x.parallel, x.expert_parallel, over) for x, over in _layouts(ep2, plan.layout, 2)] == [
        ("ddp", 2, ()), ("fsdp", 2, ("train.parallel=fsdp",)), ("fsdp", 2, ("train.parallel=fsdp", GATHERED)),
        ("fsdp", 2, ("train.parallel=fsdp", GATHERED, ONCE))]
    fsdp = next(s for s in plan.suggestions if s.what == "fsdp")
    assert fsdp.overrides[0] == "train.parallel=fsdp" and fsdp.time is not None
    applied = make_plan(load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=2", *fsdp.overrides]),
                        run_vocab(ep2), gpu("H100"), 2, suggest=False)
    assert (applied.layout.parallel, applied.layout.expert_parallel) == ("fsdp", 2) and applied.fits
    sharded = load_config("moe-gpt2-125m", [*MOE_128, "train.parallel=fsdp"])
    sharded = decide_layout(sharded, 4, "cuda", adapt_micro_batch=True).applied(sharded)
    base = make_plan(sharded, run_vocab(sharded), gpu("H100"), 4, suggest=False).layout
    assert [(x.parallel, x.expert_parallel, over) for x, over in _layouts(sharded, base, 4)] == [
        ("fsdp", 1, ()), ("fsdp", 1, (GATHERED,)), ("fsdp", 1, (GATHERED, ONCE)),
        ("ddp", 2, ("train.parallel=ddp", "model.moe.expert_parallel=2")),
        ("ddp", 4, ("train.parallel=ddp", "model.moe.expert_parallel=4")),
        ("fsdp", 2, ("model.moe.expert_parallel=2",)), ("fsdp", 2, ("model.moe.expert_parallel=2", GATHERED)),
        ("fsdp", 2, ("model.moe.expert_parallel=2", GATHERED, ONCE)),
        ("fsdp", 4, ("model.moe.expert_parallel=4",)), ("fsdp", 4, ("model.moe.expert_parallel=4", GATHERED)),
        ("fsdp", 4, ("model.moe.expert_parallel=4", GATHERED, ONCE))]


def test_expert_parallel_plan_names_the_largest_micro_batch_that_fits():
    """Under expert parallelism each micro-batch exchanges its tokens per MoE layer: the plan names the largest
    micro-batch that fits (up to one a step), and it fits when applied; none without expert parallelism, or
    where the plan's micro-batch is already the largest that fits."""
    ep4 = load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=4", "train.micro_batch_size=40"])
    vocab = run_vocab(ep4)
    plan = make_plan(ep4, vocab, gpu("H200"), nproc=4)
    f = plan.fewer_exchanges
    assert plan.accumulation == 3 and f.overrides == ("train.micro_batch_size=120",) and f.nproc == 4
    applied = make_plan(load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=4", *f.overrides]),
                        vocab, gpu("H200"), nproc=4, suggest=False)
    assert applied.fits and applied.memory.needed == f.needed and applied.accumulation == 1
    mb24 = load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=4", "train.micro_batch_size=24"])
    # 120 does not fit 80 GB; 60 does (it peaked at 62.5 GiB on 4 H100s: issue 49's table)
    on_h100 = make_plan(mb24, vocab, gpu("H100"), nproc=4).fewer_exchanges
    assert on_h100.overrides == ("train.micro_batch_size=60",) and on_h100.needed <= gpu("H100").memory
    mb60 = load_config("moe-gpt2-125m", [*MOE_128, "model.moe.expert_parallel=4", *on_h100.overrides])
    assert make_plan(mb60, vocab, gpu("H100"), nproc=4).fewer_exchanges is None   # already the largest that fits
    dense = load_config("moe-gpt2-125m", ["train.micro_batch_size=40"])
    assert make_plan(dense, run_vocab(dense), gpu("H200"), nproc=4).fewer_exchanges is None


def test_micro_batch_on_n_processes():
    """The micro-batch `train --nproc N` and `plan --nproc N` both use (config/layout.py): the recipe's where it
    divides a rank's share of the global batch, else the largest below it that does; a given one that does not
    is refused. A config with the decided micro-batch applied decides the same layout again (what the workers of
    `train --nproc N` do with the config their launcher hands them)."""
    cfg = load_config("moe-gpt2-125m")   # global batch 480, micro-batch 48
    layouts = [decide_layout(cfg, n, "cuda", adapt_micro_batch=True) for n in (1, 2, 4, 8)]
    assert [(x.micro_batch, x.accumulation) for x in layouts] == [(48, 10), (48, 5), (40, 3), (30, 2)]
    assert all(decide_layout(x.applied(cfg), x.world, "cuda") == x for x in layouts)
    assert decide_layout(cfg, 2, "cuda").micro_batch == 48
    with pytest.raises(ConfigError, match="does not divide the 120 sequences per process"):
        decide_layout(cfg, 4, "cuda")
    with pytest.raises(ConfigError, match="does not split over 7 processes"):
        decide_layout(cfg, 7, "cuda", adapt_micro_batch=True)


def test_gpu_names():
    assert gpu("h100").name == "H100" and gpu("a100_80gb").name == "A100-80GB" and gpu("MI300X").gib > 190
    with pytest.raises(ConfigError, match="H100"):
        gpu("V100")


# ----------------------------------------------------------------------------- the command line


def test_plan_command(tmp_path):
    proc = run_cli("plan", "moe-gpt2-125m", *MOE_128, "--gpu", "H100", "--json", cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr   # does not fit
    plan = json.loads(proc.stdout)
    assert not plan["fits"] and plan["gpu"]["name"] == "H100" and plan["parameters"]["expert"] > 7e9
    assert plan["memory"]["total"] > plan["memory"]["peak_allocated"] > 79 * GiB
    assert all(s["command"].startswith("trainbox train moe-gpt2-125m model.moe.num_experts=128")
               and f"--nproc {s['nproc']}" in s["command"] for s in plan["suggestions"])


def test_plan_text(capsys):
    from trainbox.cli import main
    assert main(["plan", "gpt2-125m", "--gpu", "H100", "--nproc", "2", "train.parallel=fsdp"]) == 0
    out = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations", "communication", "overhead", "needed",
                "+ FSDP's pools"):
        assert f"\n  {row} " in out
    assert "fsdp over 2 GPUs" in out and "fits:" in out and "experts:" not in out
    ep2 = ["model.moe.expert_parallel=2", "--gpu", "H200", "--nproc", "2"]
    assert main(["plan", "moe-gpt2-125m", *MOE_128, *ep2]) == 0
    out = capsys.readouterr().out
    assert "experts 1/2 per GPU" in out and "the capacity drops are not sent" in out
    # on 4 GPUs the recipe's micro-batch 48 does not divide a rank's 120 sequences: the plan shows the 40 that
    # `trainbox train --nproc 4` picks, and the micro-batch that exchanges once a step
    assert main(["plan", "moe-gpt2-125m", *MOE_128, "model.moe.expert_parallel=4", "--gpu", "H200",
                 "--nproc", "4"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 40 x 1,024 tokens" in out and "3 micro-batches a step" in out
    assert "train.micro_batch_size=120 --nproc 4" in out


def test_doctor_shows_the_plan_for_this_machine():
    from trainbox.doctor import memory_check
    ok = memory_check(load_config("tiny", ["train.device=cpu"]))
    assert ok.status == "ok" and "fits" in ok.value and "trainbox plan tiny" in ok.value
    big = ["train.device=cpu", "data.seq_len=4096", "model.n_layer=48", "model.n_embd=2048", "model.n_head=16"]
    assert memory_check(load_config("tiny", big)).status == "fail"   # 0.8 TB of activations


def test_the_plan_counts_the_fused_loss_as_it_runs():
    """The fused loss's chunk and the share of memory up to which it keeps its gradient whole are the plan's."""
    from trainbox.kernels import fused_ce
    from trainbox.model import memory
    assert (memory.CHUNK_BYTES, memory.WHOLE_SHARE, memory.LOSS_CHUNK) == \
        (fused_ce.CHUNK_BYTES, fused_ce.WHOLE_SHARE, fused_ce.LCE_CHUNK)
    for vocab in (512, 32000, 50304, 128256, 151936, 262144):
        for elem in (2, 4):
            assert memory.chunk_rows(vocab, elem) == fused_ce.chunk_rows(vocab, elem)


def test_a_memory_limit_caps_the_planned_gpu():
    """train.memory_limit_gib plans for the capped memory, as the run's allocator is capped (an H200 capped at an
    H100's 79.1 GiB fits what an H100 fits, and says it is capped); a limit above the card's changes nothing."""
    over = ["model.moe.num_experts=128", "model.moe.expert_parallel=2", "train.micro_batch_size=16"]
    cfg = load_config("moe-gpt2-125m", [*over, "train.memory_limit_gib=79.1"])
    vocab = run_vocab(cfg)
    capped = make_plan(cfg, vocab, gpu("H200"), 2)
    h100 = make_plan(load_config("moe-gpt2-125m", over), vocab, gpu("H100"), 2)
    assert capped.target.memory == h100.target.memory and capped.target.capped and not h100.target.capped
    assert capped.memory.needed == h100.memory.needed and capped.fits == h100.fits
    assert "(79.1 GiB each, assumed, capped by train.memory_limit_gib)" in format_plan(capped)
    bigger = load_config("moe-gpt2-125m", [*over, "train.memory_limit_gib=200"])
    assert make_plan(bigger, vocab, gpu("H200"), 2).target == gpu("H200")
    wider = load_config("moe-gpt2-125m", [*over, "train.micro_batch_size=24", "train.memory_limit_gib=79.1"])
    assert make_plan(wider, vocab, gpu("H200"), 2, suggest=False).fits is False
    assert make_plan(wider.model_copy(update={"train": wider.train.model_copy(update={"memory_limit_gib": 0})}),
                     vocab, gpu("H200"), 2, suggest=False).fits


def test_bf16_moments_are_offered_beside_a_plan_where_they_buy_a_faster_micro_batch(capsys):
    """The 128-expert MoE at expert parallelism 2 on 2 H100s fits micro-batch 12 with fp32 moments; with bf16 moments
    (optim.state_dtype=bf16) micro-batch 30 fits and is predicted faster (measured on 2 H200s capped at an H100's
    memory, micro-batch 40 against 16: 1.10 against 2.24 s, 2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-bf16-state-mb40-
    h100mem.json, a run whose router dropped assignments, which the plan's bound does not count on). The hint
    fits when applied, in the time it gave; it is a hint beside the plan, not one of its suggestions. Muon, moments
    already in bf16 and a GPU without rates get none."""
    over = ["model.moe.num_experts=128", "model.moe.expert_parallel=2", "train.micro_batch_size=12"]
    cfg = load_config("moe-gpt2-125m", over)
    vocab = run_vocab(cfg)
    plan = make_plan(cfg, vocab, gpu("H100"), 2)
    hint = plan.smaller_state
    assert plan.fits and hint.overrides == ("optim.state_dtype=bf16", "train.micro_batch_size=30")
    assert hint.time.step < plan.time.step and not plan.suggestions
    applied = make_plan(load_config("moe-gpt2-125m", [*over, *hint.overrides]), vocab, gpu("H100"), 2)
    assert applied.fits and applied.time == hint.time and applied.memory.needed == hint.needed
    assert applied.smaller_state is None
    assert "optim.state_dtype=bf16 train.micro_batch_size=30" in format_plan(plan, over)
    muon = load_config("speedrun-124m", [])
    assert make_plan(muon, run_vocab(muon), gpu("H100"), 1).smaller_state is None
    assert make_plan(cfg, vocab, gpu("A100-80GB"), 2).smaller_state is None


def test_a_fitting_fsdp_plan_names_its_blocks_kept_gathered_where_that_is_markedly_faster():
    """The 128-expert MoE at expert parallelism 2 under fsdp at micro-batch 20 fits 2 H100s resharding its blocks
    after the forward; kept gathered (train.reshard_after_forward=false) it fits too and is predicted over GATHERED_GAIN
    faster (measured 1.18x on 2 H200s capped at an H100's memory:
    2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-mb20-gathered-h100mem.json), and faster still with its gradients
    reduced once a step (train.grad_reduce=step; measured 1.03x and 1.08x that:
    2026-11-30-2xh200-moe-gpt2-125m-128x-ep2-fsdp-mb20-gathered-once-h100mem.json, -gathered-vs-once-h100mem.json),
    which fits as well: the plan names that beside itself, and applied it fits in the time it gave. llama-1b under
    fsdp on 2 H200s kept gathered is predicted under GATHERED_GAIN faster (measured 1%:
    2026-11-30-2xh200-llama-1b-fsdp-2gpu-bf16-gathered-vs-torchtitan.json): no hint; none under ddp, on one GPU, or
    for a plan already gathered."""
    over = [*MOE_128, "model.moe.lb_loss_weight=0.05", "model.moe.expert_parallel=2", "train.parallel=fsdp",
            "train.micro_batch_size=20"]
    cfg = load_config("moe-gpt2-125m", over)
    vocab = run_vocab(cfg)
    plan = make_plan(cfg, vocab, gpu("H100"), 2)
    hint = plan.kept_gathered
    assert plan.fits and hint.overrides == (GATHERED, ONCE) and hint.nproc == 2
    assert hint.time.step < (1 - GATHERED_GAIN) * plan.time.step and hint.needed <= gpu("H100").memory
    gathered = make_plan(load_config("moe-gpt2-125m", [*over, GATHERED]), vocab, gpu("H100"), 2)
    assert gathered.fits and gathered.time.step < (1 - GATHERED_GAIN) * plan.time.step
    assert hint.time.step < gathered.time.step and gathered.memory.needed < hint.needed   # reduced once: more memory
    applied = make_plan(load_config("moe-gpt2-125m", [*over, GATHERED, ONCE]), vocab, gpu("H100"), 2)
    assert applied.fits and applied.time == hint.time and applied.memory.needed == hint.needed
    assert applied.kept_gathered is None and not applied.layout.reshard_after_forward
    assert applied.layout.grad_reduce == "step"
    text = format_plan(plan, over)
    row = f"train.micro_batch_size=20 {GATHERED} {ONCE} --nproc 2"
    assert text.index("fsdp: with the blocks kept gathered") < text.index(row)
    assert tuple(plan.as_dict()["kept_gathered"]["overrides"]) == (GATHERED, ONCE)
    llama = load_config("llama-1b", ["train.parallel=fsdp", "train.micro_batch_size=2", "train.global_batch_size=4",
                                     "model.vocab_size=128256", "model.llama.tie_embeddings=false"])
    dense = make_plan(llama, run_vocab(llama), gpu("H200"), 2)
    assert dense.fits and dense.layout.parallel == "fsdp" and dense.kept_gathered is None
    ddp = load_config("moe-gpt2-125m", [*over, "train.parallel=ddp", "train.micro_batch_size=16"])
    assert make_plan(ddp, vocab, gpu("H100"), 2).kept_gathered is None
    one = load_config("llama-1b", ["train.parallel=fsdp", "train.micro_batch_size=2", "train.global_batch_size=4"])
    assert make_plan(one, run_vocab(one), gpu("H200"), 1).kept_gathered is None


def test_bf16_moments_are_offered_beside_the_fastest_suggestion_when_the_run_does_not_fit():
    """The recipe's own layout of the 128-expert MoE does not fit 2 H100s; the plan's fastest suggestion is expert
    parallelism 2 under fsdp, its blocks kept gathered and its gradients reduced once a step, at micro-batch 30 with
    the experts' hidden layer recomputed, and the hint is that layout with bf16 moments at micro-batch 40, the
    experts kept (which peaked at 71.0 GiB on 2 H200s capped at an H100's memory,
    2026-11-28-2xh200-moe-gpt2-125m-128x-ep2-bf16-state-mb40-h100mem.json; recomputing them there would fit
    micro-batch 60 and be predicted slower): its other overrides and GPU count kept, the mode named (none in place of
    the suggestion's experts), and applied, it fits in the time the hint gave."""
    over = ["model.moe.num_experts=128"]
    cfg = load_config("moe-gpt2-125m", over)
    vocab = run_vocab(cfg)
    plan = make_plan(cfg, vocab, gpu("H100"), 2)
    first, hint = plan.suggestions[0], plan.smaller_state
    assert not plan.fits and first.overrides[:2] == ("train.parallel=fsdp", "model.moe.expert_parallel=2")
    assert hint.nproc == first.nproc == 2 and hint.time.step < first.time.step
    assert first.overrides[2:] == (GATHERED, ONCE, "train.micro_batch_size=30",
                                   "train.activation_checkpointing=experts")
    assert hint.overrides == ("train.parallel=fsdp", "model.moe.expert_parallel=2", GATHERED, ONCE,
                              "optim.state_dtype=bf16", "train.micro_batch_size=40",
                              "train.activation_checkpointing=none")
    applied = make_plan(load_config("moe-gpt2-125m", [*over, *hint.overrides]), vocab, gpu("H100"), 2)
    assert applied.fits and applied.time == hint.time and applied.memory.needed == hint.needed
    text = format_plan(plan, over)
    assert text.index("what would fit") < text.index("in the first of these layouts") < text.index(
        f"train.parallel=fsdp model.moe.expert_parallel=2 {GATHERED} {ONCE} optim.state_dtype=bf16 "
        "train.micro_batch_size=40 train.activation_checkpointing=none --nproc 2")


def test_the_plan_says_the_host_memory_sharded_checkpoints_stage_into():
    """Sharded async saves keep a host copy of each rank's parameters and optimizer state (parallel/dcp.py): the
    plan states it per GPU and per host, and its bytes are the shard that benchmarks/pin_speed.py pinned for llama-8b
    at 4-way FSDP (the record's shard_gib)."""
    rec = json.loads((REPO / "benchmarks/records/2026-11-30-2xh200-llama-8b-rank-of-4-pin-4-procs.json").read_text())
    cfg = load_config("llama-8b", rec["overrides"])
    plan = make_plan(cfg, run_vocab(cfg), gpu("H100"), 4)
    assert plan.layout.parallel == "fsdp"
    assert plan.staged / GiB == pytest.approx(rec["metrics"]["shard_gib"], rel=0.005)
    text = format_plan(plan)
    assert f"{plan.staged / GiB:.1f} GiB each, {4 * plan.staged / GiB:.1f} GiB where all 4 share one host" in text
    # nothing staged where checkpoints are single files (one process, ddp) or off
    off = load_config("llama-8b", [*rec["overrides"], "train.checkpoints=false"])
    assert make_plan(off, run_vocab(off), gpu("H100"), 4).staged == 0
    one = load_config("gpt2-125m", [])
    assert make_plan(one, run_vocab(one), gpu("H100")).staged == 0
    assert "host memory" not in format_plan(make_plan(one, run_vocab(one), gpu("H100")))


# ----------------------------------------------------------------------------- a CPU: processes share its RAM

CPU_RUN = [*SMALL, "data.seq_len=256", "optim.name=adamw", "train.global_batch_size=16", "train.micro_batch_size=8"]


def test_cpu_processes_share_the_hosts_ram(monkeypatch, capsys):
    """The processes of one host share its RAM: `trainbox plan --nproc 2` holds each to half of the host's available
    figure, says the run does not fit where the whole would hold one process, names what each has, and suggests a
    micro-batch that fits a process's half and that the pre-flight check accepts on the same figure."""
    from trainbox.cli import main
    from trainbox.train.memory import check_memory
    cfg = load_config("tiny", CPU_RUN)
    needed = make_plan(cfg, 512, local_cpu(10**12), 2, suggest=False).memory.needed
    ram = int(1.5 * needed)   # holds one process's need whole, not in half of it
    monkeypatch.setattr("trainbox.plan.gpus.host_available", lambda: ram)   # this machine's MemAvailable, given
    assert main(["plan", "tiny", *CPU_RUN, "--nproc", "2"]) == 1
    out = capsys.readouterr().out
    assert f"tiny on 2 processes of this CPU ({ram // 2 / GiB:.1f} GiB each of the {ram / GiB:.1f} GiB of RAM " \
           "available to a run: MemAvailable)" in out
    assert f"does not fit: {needed / GiB:.1f} of {ram // 2 / GiB:.1f} GiB per process" in out
    assert "what would fit (GiB per process):" in out and "per GPU" not in out
    micro = int(re.search(r"micro-batch +trainbox train tiny .*train\.micro_batch_size=(\d+) --nproc 2", out)[1])
    assert micro < 8
    applied = load_config("tiny", [*CPU_RUN, f"train.micro_batch_size={micro}"])
    plan = make_plan(applied, 512, local_cpu(ram), 2)
    assert plan.fits and plan.target.memory == ram // 2 and plan.memory.needed <= ram // 2
    assert check_memory(applied, 512, torch.device("cpu"), torch.float32, free=ram, world=2) is not None
    assert main(["plan", "tiny", *CPU_RUN, "--nproc", "2", f"train.micro_batch_size={micro}"]) == 0


def test_the_cpu_plan_measures_the_ram_a_run_can_have():
    """`trainbox plan` measures this CPU by MemAvailable, the figure the pre-flight check holds a run to (MemTotal
    counts the memory other processes hold); a given figure is taken as it is."""
    from trainbox.train.memory import available
    before = available(torch.device("cpu"))
    if before is None:
        pytest.skip("no /proc/meminfo here")
    ram = local_cpu().memory
    after = available(torch.device("cpu"))
    assert min(before, after) - GiB // 4 <= ram <= max(before, after) + GiB // 4
    assert local_cpu(3 * GiB).memory == 3 * GiB and local_cpu(3 * GiB).shared(2).memory == 3 * GiB // 2


def test_cpu_plan_states_the_expert_split_per_process(capsys):
    """A CPU plan's layout names the experts each process holds, as a GPU plan's names those of each GPU."""
    from trainbox.cli import main
    moe = ["model.family=moe", "optim.name=adamw", "model.n_layer=2", "model.n_embd=64", "model.moe.num_experts=4",
           "--nproc", "2"]
    main(["plan", "tiny", *moe, "model.moe.expert_parallel=2"])
    assert "layout       ddp over 2 CPU processes; experts 1/2 per process\n" in capsys.readouterr().out
    main(["plan", "tiny", *moe])
    assert "layout       ddp over 2 CPU processes; every expert on every process\n" in capsys.readouterr().out
