"""Model families: one folder each, `model/<name>/`, declared by the `FAMILY` object of its `__init__.py`.

A family's folder holds

    __init__.py   FAMILY = Family(...): what the family is and supports (light: no torch), read by config
                  validation, the memory plan, the kernel choice, `doctor` and `export`
    config.py     its config section (model.<name>) and its own rules on the model section, where it has them
    model.py      the torch module: build(cfg, vocab_size, block_size, run=None) -> nn.Module, whose forward is
                  forward(idx, targets=None, loss_mask=None, caches=None, pos=0, reduction="mean",
                  logits_to_keep=1) -> Output (without targets: the logits of the last logits_to_keep positions, 0
                  for all, as Hugging Face's forward; a family that packs, `Family.packing`, also takes doc_ids and
                  position_ids: packed rows, each (B, T), data/packing.py) and which has num_params() and
                  flops_per_token(seq_len); a causal family (generate="causal") also has make_caches(batch,
                  max_len, dtype, device), the KV caches that sampling and lm-eval's adapter (eval/) feed; optional
                  hooks, used where present:
                  resolve(run) (complete the run config before anything is built), tokenizer(run) (the model's
                  own), extra_ids(cfg) (ids above the tokenizer's), context(run) (the positions the model supports
                  where model.block_size is unset; None: data.seq_len), open_datasets(run, tokenizer, vocab) (its own
                  examples), adapt_dataset(cfg, tokenizer, dataset, vocab, split) (examples from packed windows),
                  build_meta(run) (the model on the meta device, for the plan), reads_examples(run) (data.path
                  is read as whole examples, data/sft.py, so data.packing applies). A family that scores
                  (`Family.scores`) also takes forward(idx, score_at=(B,) positions) -> Output(logits=(B,) fp32
                  scores): its `score` head (model/build.py's ScoreHead) on the final hidden state at each row's
                  position
    hf.py         its Hugging Face mapping: export(path, out, merge, force, dtype) -> lines, import_hf(folder, model,
                  cfg); gguf_model(folder) where the family writes GGUF (Family.gguf lists the types)
    memory.py     what one micro-batch's forward keeps for the backward, for the plan: activations(...)

Nothing outside model/ compares family names: it asks the family object (`family(name)`). The families are
found by listing model/'s sub-packages; `register` adds one defined elsewhere (a plugin, a test).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import trainbox.model as package
from trainbox.errors import ConfigError

# the generic model.* options a family may read beyond its shape (model.n_layer, n_head, n_embd, vocab_size,
# block_size); config validation refuses the ones a family does not list when they are set away from their default
OPTIONS = ("attention", "fused_loss", "fused_norm", "fused_mlp", "fp8_head", "fp8_mlp", "lowp_residual",
           "logit_softcap", "window", "window_warmup_steps", "window_block", "window_pattern", "eot_id", "head_dim",
           "dropout", "bias", "tie_embeddings", "path")


# the GGUF types model/gguf_file.py writes (`--gguf-type`): 16-bit, then llama.cpp's block quantisations of 8, 5 and 4
# bits that the gguf package computes
GGUF_TYPES = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


@dataclass(frozen=True)
class Family:
    """What a family is and supports; its code is loaded only when it is used (`load`, `hf`, `memory`)."""

    name: str
    summary: str                          # one line: the architecture
    module: str                           # the torch module (build and the optional hooks)
    hf_module: str | None = None          # its Hugging Face mapping (export, import_hf)
    memory_module: str | None = None      # its activation formula for the plan
    section: type | None = None           # its config section class, at model.<name>
    check: Callable | None = None         # its own rules: check(model_section) raises ValueError
    options: frozenset = frozenset()      # the generic model.* options it reads (OPTIONS)
    attention: tuple[str, ...] = ()       # the kernels model.attention may name (flash, flex, triton, sdpa); ()=its own
    own_attention: str = "sdpa"           # the attention it runs where model.attention does not apply
    flash_eligible: Callable | None = None   # flash_eligible(model_section): FlashAttention-4 fits its masks
    experts: bool = False                 # expert layers: model.moe.expert_parallel applies
    fsdp: str | None = None               # why train.parallel=fsdp cannot shard it (None: it can)
    recompute: str | None = None          # why train.activation_checkpointing does not apply (None: it does)
    lowp_residual: bool = False           # the residual stream in the autocast dtype unless model.lowp_residual
    generate: str = "causal"              # causal (sampling with a KV cache) or spans (t5: fill sentinels)
    export: str | None = None             # what `trainbox export --format hf` writes (None: nothing)
    gguf: tuple[str, ...] = ()            # the GGUF types `export --format gguf` writes (hf.py's gguf_model); ()=none
                                          # (GGUF_TYPES: all that model/gguf_file.py writes)
    steps: bool = False                   # the model takes set_step(step, total) before each step
    packing: tuple[str, ...] = ()         # the kernels it runs on packed rows (kernels/packed.py: flash, flex, sdpa;
                                          # hf: transformers' own); () = it cannot pack (data.packing is refused)
    scores: bool = False                  # forward(idx, score_at=) gives one score a row from a `score` head that
                                          # model/build.py puts on it (train.objective=reward); export writes the
                                          # *ForSequenceClassification form
    rollouts: bool = False                # forward(..., temperature=) gives the token losses of the logits divided by
                                          # it, and sampling many prompts at once (generate.py rollout) is exact:
                                          # train.objective=grpo
    adapters: bool = False                # trains adapters on a frozen base; the model's adapters_off() context
                                          # gives the base (the preference objective's reference)
    packages: tuple[tuple[str, str], ...] = ()   # (package, extra) it needs to train (`doctor`)
    flavours: dict = field(default_factory=dict)  # read-only notes shown by `config schema` (unused by code)

    def load(self):
        """Its torch module."""
        return _module(self.module, self.name)

    def hf(self):
        """Its Hugging Face mapping (raises ConfigError where it has none)."""
        if self.hf_module is None:
            raise ConfigError(f"model.family={self.name} has no Hugging Face model class to export to",
                              hint="the run's checkpoints (safetensors) are its portable form; generate with "
                                   "`trainbox generate RUN`")
        return _module(self.hf_module, self.name)

    def memory(self):
        return _module(self.memory_module, self.name) if self.memory_module else None

    def supports(self, option: str) -> bool:
        return option in self.options

    def check_packing(self) -> None:
        """Refuse data.packing=true where this family cannot keep attention and positions inside each example."""
        if self.packing:
            return
        packers = which(lambda f: bool(f.packing))
        raise ConfigError(f"data.packing=true packs several examples into each row of data.seq_len tokens, which "
                          f"needs attention limited to each example and positions restarting at each; "
                          f"model.family={self.name} cannot run packed rows",
                          hint="set data.packing=false (each example in its own row, padded)"
                               + (f", or use model.family={either(packers)}" if packers else ""))

    def hook(self, name: str):
        """The torch module's optional hook `name`, or None."""
        return getattr(self.load(), name, None)


def _module(path: str, family_name: str):
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name == path:
            raise ConfigError(f"model.family={family_name!r}: {path} is not available in this version of "
                              f"trainbox") from None
        raise


_REGISTRY: dict[str, Family] = {}


def families() -> dict[str, Family]:
    """Every family, by name: model/'s sub-packages (each declares FAMILY) and those registered."""
    if not _REGISTRY:
        # A family's package may import trainbox.config (those here import only trainbox.section), whose model
        # section is assembled from this registry as it loads: it scans first, so that a scan begun here cannot
        # hand it the families found so far.
        import trainbox.config  # noqa: F401 - heavy: pydantic (the config schema)
    if not _REGISTRY:
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if info.ispkg:
                declared = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "FAMILY", None)
                if isinstance(declared, Family):
                    _REGISTRY.setdefault(declared.name, declared)
    return _REGISTRY


def register(spec: Family) -> None:
    """Add a family defined outside model/ (its `module` must be importable); a name taken is refused."""
    known = families()
    if spec.name in known and known[spec.name] is not spec:
        raise ConfigError(f"model family {spec.name!r} is already registered")
    known[spec.name] = spec


def family(name: str) -> Family:
    spec = families().get(name)
    if spec is None:
        raise ConfigError(f"model.family={name!r} is not one of {', '.join(families())}")
    return spec


def which(test: Callable[[Family], bool]) -> list[str]:
    """The names of the families for which `test` holds (for messages: "applies to model.family=gpt or moe")."""
    return [n for n, f in families().items() if test(f)]


def either(names: list[str]) -> str:
    """gpt / gpt or moe / gpt, moe or speedrun."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
