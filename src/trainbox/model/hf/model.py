"""Hugging Face causal LMs with PEFT LoRA and bitsandbytes 4/8-bit (`model.family: hf`).

    trainbox train lora model.path=Qwen/Qwen2.5-0.5B data.path=chat.jsonl          # LoRA, bf16 on GPU
    trainbox train lora model.path=./my-model data.path=chat.jsonl quant.load_in_4bit=true   # QLoRA

Any `AutoModelForCausalLM` (a hub id or a local folder) is loaded with transformers, wrapped in a PEFT
LoRA (`lora.r`, `lora.alpha`, `lora.dropout`, `lora.target_modules`, "all-linear" included) and run by
the same training loop as every other family. Choices:

- Only the adapters train: the base is frozen, and `adapter_only = True` makes checkpoints hold the
  adapter weights alone (the frozen base is never written; it is reloaded from `model.path`).
- On a GPU with bf16 the frozen base is loaded in bf16 (the adapters stay fp32 under autocast, as
  PEFT keeps them); on CPU everything is fp32.
- QLoRA: `quant.load_in_4bit` is NF4 with double quantisation and bf16 compute; `quant.load_in_8bit`
  is LLM.int8. Both need bitsandbytes and a CUDA/ROCm GPU; `check_quant_support` says what is missing
  before any weights are read. Compiled, the 4-bit matmuls are recomputed under gradient checkpointing like every
  other op of a layer (train/build.py recomputing_custom_ops), so QLoRA peaks below the 16-bit LoRA's memory.
- Gradient checkpointing (`lora.gradient_checkpointing`) is HF's own, non-reentrant, so the RNG of
  LoRA dropout is replayed exactly in the recomputation and resume stays bit-exact on CPU.
- The loss is ours (`gpt.cross_entropy` on the loop's shifted targets and loss mask), so masking and
  the per-token reduction mean exactly what they mean for the GPT family. With `model.fused_loss` the decoder's
  hidden states go through kernels/fused_ce.py with the output layer's weight (and the model's final-logit
  soft-cap), so the (tokens x vocabulary) logits are never kept: the head must be a plain bias-free linear layer
  without adapters or a logit scale, else the run says so and computes the logits.
- Packed rows (data.packing, data/packing.py) reach transformers as it understands them: `position_ids` restarting
  at each example, and for sdpa and eager attention a 4D additive mask that is causal inside each example and
  closed between examples (passed through as it is, by transformers 4 and 5 alike); for FlashAttention
  (flash_attention_2 / 3) the rows are flattened into one sequence, whose position_ids give transformers the
  examples' boundaries (its variable-length path). Other attention implementations are refused with packed rows.
- Sampling many rows at once (generate.py `rollout`: grpo's completions): a Llama, Mistral, Qwen2 or Qwen3 model
  decodes through the llama family's decoder over its own modules (view.py), its token step replayed in a CUDA graph
  on a GPU; any other architecture through transformers' forward and cache.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging
import warnings

import torch
import torch.nn as nn

from trainbox.data.sft import load_hf_tokenizer, open_finetuning_datasets
from trainbox.data.sft import reads_examples as sft_examples
from trainbox.errors import ConfigError, require
from trainbox.kernels.fused_ce import head_cross_entropy
from trainbox.model.hf.view import llama_view, merged_linear
from trainbox.model.layers import Output, cross_entropy

log = logging.getLogger("trainbox")


def check_quant_support(quant) -> None:
    """Raise before any model is loaded when 4/8-bit loading cannot run here, naming everything missing."""
    mode = "load_in_4bit" if quant.load_in_4bit else "load_in_8bit" if quant.load_in_8bit else None
    if mode is None:
        return
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA (or ROCm) GPU: torch sees none" + (
            "" if torch.version.cuda or torch.version.hip else f" and this torch ({torch.__version__}) is a CPU build"))
    if importlib.util.find_spec("bitsandbytes") is None:
        missing.append("the Python package 'bitsandbytes' (pip install 'trainbox[quant]')")
    if missing:
        raise ConfigError(f"quant.{mode}=true (QLoRA through bitsandbytes) cannot run here: it needs "
                          + " and ".join(missing),
                          hint=f"run on a GPU machine with bitsandbytes, or drop quant.{mode} to train "
                               "plain LoRA (bf16 on GPU, fp32 on CPU)")


def quantization_config(quant):
    """BitsAndBytesConfig for the quant section (None when not quantised)."""
    if not quant.quantized:
        return None
    from transformers import BitsAndBytesConfig  # optional: transformers
    if quant.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def load_base(path: str, dtype, quant=None):
    """AutoModelForCausalLM from a hub id or folder. `dtype`: a torch dtype or "auto" (as stored)."""
    require("transformers", "finetune", "model.family=hf")
    from transformers import AutoModelForCausalLM  # optional: transformers

    qcfg = quantization_config(quant) if quant is not None else None
    kwargs = {"dtype": torch.bfloat16 if qcfg is not None else dtype}
    if qcfg is not None:  # bitsandbytes places the weights itself; the loop's .to() is then a no-op
        kwargs.update(quantization_config=qcfg, device_map={"": torch.cuda.current_device()})
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise ConfigError(f"model.path={path}: cannot load a Hugging Face causal LM ({str(e).splitlines()[0]})",
                          hint="pass a local folder holding config.json and weights, or a hub id "
                               "(`huggingface-cli download ID` first when offline)") from None


def lora_config(lora):
    from peft import LoraConfig  # optional: peft
    targets = lora.target_modules
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      task_type="CAUSAL_LM", target_modules=targets if isinstance(targets, str) else list(targets))


def train_dtype(run) -> torch.dtype:
    """Dtype of the frozen base: bf16 where the loop trains in bf16 on a GPU, fp32 otherwise."""
    wants_gpu = run.train.device.startswith("cuda") or (run.train.device == "auto" and torch.cuda.is_available())
    if wants_gpu and run.train.dtype in ("auto", "bf16") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


class HFCache:
    """The family's KV-cache handle for `generate.py`: a thin wrapper over transformers' DynamicCache."""

    def __init__(self):
        from transformers import DynamicCache  # optional: transformers
        self.cache = DynamicCache()

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a chat turn that re-uses the start of the conversation)."""
        extra = self.cache.get_seq_length() - length
        if length == 0:
            self.cache = type(self.cache)()
        elif extra > 0:   # a negative count removes that many positions in transformers 4 and 5 alike
            self.cache.crop(-extra)


class HFCausalLM(nn.Module):
    """A PEFT-wrapped causal LM behind the family interface (forward -> Output, make_caches, ...)."""

    family = "hf"
    adapter_only = True  # checkpoints hold trainable (adapter) weights only

    def __init__(self, peft_model: nn.Module, path: str, quantized: bool, fused_loss: bool = False):
        super().__init__()
        self.peft, self.path, self.quantized = peft_model, path, quantized
        conf = peft_model.get_base_model().config
        self.hf_config = conf
        self.width = getattr(conf, "hidden_size", None) or getattr(conf, "n_embd", None)   # a score head's input
        self.block_size = getattr(conf, "max_position_embeddings", None) or getattr(conf, "n_positions", 2048)
        self.fused_loss = fused_loss and self._plain_head(path)
        # the KV cache's argument, by the forward's signature: `cache` where it has one (transformers 5 releases that
        # deprecate `past_key_values`), else `past_key_values`
        forward = inspect.signature(peft_model.get_base_model().forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"

    @property
    def recompute_custom_ops(self) -> bool:
        """Compiled, bitsandbytes' 4/8-bit matmuls (custom ops) are recomputed in the backward, not saved
        (train/build.py recomputing_custom_ops)."""
        return self.quantized

    def _plain_head(self, path: str) -> bool:
        """Whether the loss may take the decoder's hidden states and the head's weight (model.fused_loss)."""
        base = self.peft.get_base_model()
        head, scaled = base.get_output_embeddings(), [a for a in ("logit_scale", "logits_scaling")
                                                       if getattr(self.hf_config, a, None) not in (None, 1, 1.0)]
        why = ("its output layer is not a plain bias-free nn.Linear (adapters or a bias on it)"
               if type(head) is not nn.Linear or head.bias is not None else
               f"its config scales the logits ({', '.join(scaled)})" if scaled else None)
        if why:
            log.info(f"model.fused_loss: {path}: {why}; the logits are computed")
        return why is None

    def _fused_head_loss(self, hidden: torch.Tensor, targets, loss_mask, reduction: str) -> torch.Tensor:
        cap = getattr(self.hf_config, "final_logit_softcapping", None) or 0.0
        head = self.peft.get_base_model().get_output_embeddings()
        return head_cross_entropy(hidden, head.weight, targets, loss_mask, float(cap), reduction)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                caches: HFCache | None = None, pos: int = 0, reduction: str = "mean",
                doc_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 1, visible: torch.Tensor | None = None,
                score_at: torch.Tensor | None = None, attend: torch.Tensor | None = None,
                temperature: float = 1.0) -> Output:
        """As every family's forward (model/llama/model.py). With `caches`, left-padded rows (generate.py `rollout`):
        `attend` (B, S_max) bool, True where a cache position holds a real token, reaches transformers as the
        attention mask of the positions up to pos + T, and `position_ids` (B, T) as they are; transformers' generate
        passes left padding the same way. `pos` must equal the length the cache holds. The loss at a `temperature`
        is that of the logits divided by it (grpo's log-probabilities at its sampling temperature)."""
        if score_at is not None:   # a reward model: the decoder (its adapters inside), the score head at score_at
            hidden = self.peft.get_base_model().get_decoder()(input_ids=idx, use_cache=False).last_hidden_state
            return Output(logits=self.score(hidden[torch.arange(idx.size(0), device=idx.device), score_at]))
        if visible is not None:   # rows of any layout (eval/adapter.py): (B, T, T) keys each query sees
            out = self.peft(input_ids=idx, position_ids=position_ids, attention_mask=self._additive_mask(visible),
                            use_cache=False, logits_to_keep=logits_to_keep)
            return Output(logits=out.logits)
        if targets is None:  # inference: the last `logits_to_keep` positions' logits (0: all; HF tracks
            # positions in its cache)
            padded = {} if attend is None else {"attention_mask": attend[:, :pos + idx.size(1)].long()}
            if position_ids is not None:
                padded["position_ids"] = position_ids
            out = self.peft(input_ids=idx, **{self._cache_arg: caches.cache if caches is not None else None},
                            use_cache=caches is not None, logits_to_keep=logits_to_keep, **padded)
            return Output(logits=out.logits)
        capped = bool(getattr(self.hf_config, "final_logit_softcapping", None))
        if self.fused_loss and doc_ids is None and not (capped and temperature != 1):   # the decoder alone (PEFT's
            # adapters sit inside it); a head without bias, so dividing its input divides the logits
            hidden = self.peft.get_base_model().get_decoder()(input_ids=idx, use_cache=False).last_hidden_state
            hidden = hidden / temperature if temperature != 1 else hidden
            return Output(loss=self._fused_head_loss(hidden, targets, loss_mask, reduction))
        logits = self.peft(input_ids=idx, use_cache=False).logits if doc_ids is None else \
            self.packed_logits(idx, doc_ids, position_ids)
        logits = logits / temperature if temperature != 1 else logits
        return Output(loss=cross_entropy(logits, targets, loss_mask, reduction))

    def packed_logits(self, idx: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of packed rows, each example seeing only itself (module docstring)."""
        impl = getattr(self.hf_config, "_attn_implementation", None) or "eager"
        B, T = idx.shape
        if "flash" in impl:   # one row of B * T tokens: transformers cuts it where position_ids restart
            out = self.peft(input_ids=idx.reshape(1, B * T), position_ids=position_ids.reshape(1, B * T),
                            use_cache=False)
            return out.logits.view(B, T, -1)
        if impl not in ("sdpa", "eager"):
            raise ConfigError(f"data.packing=true: model.path={self.path} runs attention {impl!r}, which trainbox "
                              "cannot limit to each example of a packed row",
                              hint="set data.packing=false, or load the model with sdpa, eager or flash_attention_2")
        causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        allowed = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])          # (B, T, T)
        return self.peft(input_ids=idx, position_ids=position_ids, attention_mask=self._additive_mask(allowed),
                         use_cache=False).logits

    @property
    def masks_attention(self) -> bool:
        """Whether the forward takes `visible`: transformers' sdpa and eager attention read a 4D mask as given."""
        return (getattr(self.hf_config, "_attn_implementation", None) or "eager") in ("sdpa", "eager")

    def _additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """(B, T, T) bool -> the (B, 1, T, T) additive mask transformers takes, in the dtype attention runs in."""
        device = allowed.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else \
            self.peft.get_base_model().dtype
        return torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=allowed.device).masked_fill(
            ~allowed[:, None], torch.finfo(dtype).min)

    def make_caches(self, batch: int, max_len: int, dtype, device) -> HFCache:
        return HFCache()

    def rollout_model(self) -> nn.Module:
        """What generate.py `rollout` runs: for a Llama, Mistral, Qwen2 or Qwen3 model, the llama family's decoder
        over this model's own modules (model/hf/view.py), whose token step a CUDA graph replays; else this model.
        Built once, and kept outside the module tree (its weights are this model's)."""
        if "_rollout" not in self.__dict__:
            self.__dict__["_rollout"] = llama_view(self) or self
        return self.__dict__["_rollout"]

    def sampling_model(self, dtype: torch.dtype) -> nn.Module:
        """`rollout_model` with its linear layers copied in `dtype`, made now: LoRA's adapters merged into their
        base, a 4- or 8-bit base dequantized (view.py `merged_linear`), so a token step runs one matmul a layer;
        this model where it samples through transformers."""
        if self.rollout_model() is self:
            return self
        return llama_view(self, merged_linear(dtype))

    def adapters_off(self):
        """A context in which the model is its frozen base (PEFT's disable_adapter): the preference objective's
        reference, at no extra memory."""
        return self.peft.disable_adapter()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.peft.parameters())

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.peft.parameters() if p.requires_grad)

    def flops_per_token(self, seq_len: int) -> float:
        """LoRA training FLOPs per token: forward 2N plus the input-gradient half of the backward 2N (frozen
        weights get no weight gradient), 6N for the adapters, and 12 * L * d * T for attention."""
        layers = getattr(self.hf_config, "num_hidden_layers", 0) or getattr(self.hf_config, "n_layer", 0)
        width = getattr(self.hf_config, "hidden_size", 0) or getattr(self.hf_config, "n_embd", 0)
        frozen = self.num_params() - self.num_trainable()
        return 4 * frozen + 6 * self.num_trainable() + 12 * layers * width * seq_len

    def _apply(self, fn, recurse=True):
        # bitsandbytes weights were placed on the GPU at load time and must not be cast or moved again (a reward
        # model's score head, built on the CPU, moves)
        if self.quantized and hasattr(self, "score"):
            self.score._apply(fn, recurse)
        return self if self.quantized else super()._apply(fn, recurse)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Adapter checkpoints lack the frozen base: only missing *trainable* weights are an error."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        missing = [k for k in result.missing_keys if k in trainable]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"adapter weights do not match the model: missing {missing[:5]}, "
                               f"unexpected {result.unexpected_keys[:5]}")
        return type(result)(missing, result.unexpected_keys)


def wrap_lora(base: nn.Module, lora, quantized: bool) -> nn.Module:
    """Freeze `base` and add LoRA adapters (PEFT); gradient checkpointing when configured."""
    require("peft", "finetune", "LoRA (model.family=hf)")
    from peft import get_peft_model, prepare_model_for_kbit_training  # optional: peft

    gc_kwargs = {"use_reentrant": False}
    if quantized:  # fp32 norms/head for stability, input grads; checkpointing per lora.gradient_checkpointing
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=lora.gradient_checkpointing,
                                               gradient_checkpointing_kwargs=gc_kwargs)
    elif lora.gradient_checkpointing and hasattr(base, "activation_checkpointing_enable"):   # its name in 5.x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs)
    elif lora.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    base.config.use_cache = False
    try:
        with warnings.catch_warnings():   # PEFT asks transformers 5.x's deprecated alias; nothing a user can change
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(base, lora_config(lora))
    except ValueError as e:
        raise ConfigError(f"lora.target_modules={lora.target_modules!r}: {e}",
                          hint='use "all-linear", or names of the model\'s nn.Linear layers '
                               'such as [q_proj, v_proj]') from None


def build_hf(run, dtype=None, quantize: bool = True) -> HFCausalLM:
    """Base model + LoRA from a RunConfig. `dtype` overrides the training dtype (export, merge)."""
    if not run.model.path:
        raise ConfigError("model.family=hf needs model.path (a hub id or a local model folder)",
                          hint="e.g. trainbox train lora model.path=Qwen/Qwen2.5-0.5B data.path=chat.jsonl")
    quant = run.quant if quantize else None
    if quant is not None:
        check_quant_support(quant)  # before any weights are read
    require("peft", "finetune", "LoRA (model.family=hf)")
    quantized = quant is not None and quant.quantized
    base = load_base(run.model.path, dtype or train_dtype(run), quant if quantized else None)
    return HFCausalLM(wrap_lora(base, run.lora, quantized), run.model.path, quantized, run.model.fused_loss)


def build(cfg, vocab_size: int, block_size: int, run=None) -> HFCausalLM:
    """Registry entry. The vocabulary and positions are the model's own, so vocab_size and block_size
    are ignored; `run` is the whole RunConfig (lora, quant, train sections)."""
    if run is None:
        raise ConfigError("model.family=hf is built from the whole run config (lora and quant sections)")
    return build_hf(run)


def plan_vocab(run) -> int:
    """The vocabulary the memory plan counts (the logits of the head and loss): model.vocab_size where given, else
    the base model's own, from its config.json."""
    if run.model.vocab_size:
        return run.model.vocab_size
    conf = _base_config(run)
    return getattr(conf, "vocab_size", None) or getattr(conf.get_text_config(), "vocab_size", 0) or 0


def _base_config(run):
    """The base model's transformers config, read from model.path alone (no weights)."""
    require("transformers", "finetune", "model.family=hf")
    from transformers import AutoConfig  # optional: the finetune extra
    if not run.model.path:
        raise ConfigError("model.family=hf needs model.path (a hub id or a local model folder)",
                          hint=f"e.g. trainbox plan {run.recipe or 'lora'} model.path=Qwen/Qwen2.5-0.5B")
    try:
        return AutoConfig.from_pretrained(run.model.path)
    except OSError as e:
        raise ConfigError(f"model.path={run.model.path}: no model config to plan from ({str(e).splitlines()[0]})",
                          hint="pass a local folder holding config.json, or a hub id already in the cache") from None


def tokenizer(run):
    """Registry hook: the model's own tokenizer (data.tokenizer may name another folder; gpt2 = default)."""

    # the loop asks for the tokenizer before data or weights: the earliest point to refuse QLoRA here
    check_quant_support(run.quant)
    spec = run.data.tokenizer if run.data.tokenizer != "gpt2" else run.model.path
    if not spec:
        raise ConfigError("model.family=hf needs model.path (its tokenizer is loaded from there)",
                          hint="e.g. trainbox train lora model.path=Qwen/Qwen2.5-0.5B data.path=chat.jsonl")
    return load_hf_tokenizer(spec)



def open_datasets(run, tokenizer, vocab_size: int):
    """Fine-tuning data: chat / text JSONL with assistant-only loss, or prepared token files (data/sft.py)."""
    return open_finetuning_datasets(run.data, tokenizer, vocab_size)


def reads_examples(run) -> bool:
    """Chat / text JSONL is read as whole examples (data/sft.py), so data.packing applies."""
    return sft_examples(run.data)


def build_meta(cfg) -> nn.Module:
    """A Hugging Face model from its config alone (no weights read), with the run's LoRA adapters."""
    from transformers import AutoModelForCausalLM  # optional: the finetune extra
    conf = _base_config(cfg)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(conf)
    return wrap_lora(base, cfg.lora, quantized=False)
