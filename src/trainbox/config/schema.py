"""The RunConfig tree: one pydantic section per component (extra="forbid", validated on assignment, no
infinities or NaNs), and the cross-field rules. The model section, assembled from the families, is config/model.py;
the count fields' bounds config/limits.py. Loading and error messages: config/load.py."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from trainbox.config.grpo import GrpoSection
from trainbox.config.limits import MAX_POSITIONS, MAX_SEQUENCES, MAX_STEPS, MAX_TOKENS
from trainbox.config.model import ModelSection
from trainbox.config.preference import UNPAIRED_LOSSES, DpoSection, RewardSection
from trainbox.errors import ConfigError
from trainbox.model.spec import either, family, which
from trainbox.section import Section

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_NAME_RULE = "one path component of letters, digits, '.', '_' and '-', starting with a letter or digit"

LENGTH_KEYS = ("max_steps", "max_tokens", "epochs")   # train.*: the one setting that gives a run's length


class RunSection(Section):
    name: str | None = Field(None, description=f"run name; defaults to the recipe name. {RUN_NAME_RULE}")
    dir: str = Field("runs", description="folder that holds run directories")
    seed: int = Field(1337, ge=0, lt=2**32, description="seeds the data order, the initial weights and dropout")
    resume: str = Field("auto", description="auto (continue from latest), never, or a checkpoint path")
    init_from: str | None = Field(None, description="checkpoint or HF folder to load weights from (new run)")

    @model_validator(mode="after")
    def _name_is_one_component(self) -> "RunSection":
        if self.name is not None and not RUN_NAME_RE.match(self.name):
            raise ValueError(f"run.name={self.name!r} must be {RUN_NAME_RULE}: a run's files stay inside "
                             f"run.dir/NAME (use run.dir to choose the folder)")
        return self


class DataSection(Section):
    path: str = Field("embedded:shakespeare", description="embedded corpus, token-file prefix, or text/JSONL input")
    val_path: str | None = Field(None, description="validation data: token files, or text / JSONL tokenized as path "
                                                   "is (default: the _val split of path; text input holds out 1% of "
                                                   "its documents)")
    tokenizer: str = Field("gpt2", description="gpt2, embedded:shakespeare-bpe, a tokenizer.json or folder")
    seq_len: int = Field(1024, ge=8, le=MAX_POSITIONS)
    format: Literal["auto", "shard", "megatron", "flat"] = "auto"
    text_key: list[str] = Field(default_factory=lambda: ["text"])
    chat_template: str | None = Field(None, description="built-in template name (chatml) for chat JSONL")
    packing: bool = Field(True, description="fine-tuning examples (chat / text JSONL that model.family=hf, or llama "
                          "with model.path, reads as examples): true packs whole examples into rows of data.seq_len "
                          "(first-fit decreasing; positions restart and attention stays inside each example; an "
                          "example keeps its first data.seq_len + 1 tokens); false gives each example its own row, "
                          "padded. Preference pairs (train.objective=dpo; the dpo recipe sets false): true packs "
                          "whole pairs into rows of 2 x data.seq_len, and train.global_batch_size counts rows. Token "
                          "files are always windows of their stream")
    cache_dir: str | None = Field(None, description="where tokenized data is cached (default ~/.cache/trainbox)")
    num_workers: int = Field(1, ge=0, description="tokenizer worker processes for raw-text inputs")
    source: Literal["fineweb10B-gpt2"] | None = Field(
        None, description="a pre-tokenized dataset on the Hugging Face Hub that `train` downloads into the folder "
        "data.path when that does not exist: fineweb10B-gpt2 (kjj0/fineweb10B-gpt2, GPT-2 token shards of 100M "
        "tokens): the validation shard and the training shards the run's steps read")
    download: bool = Field(True, description="download data.source when data.path is missing (false: a missing "
                                             "data.path is an error)")


class OptimSection(Section):
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = Field(6e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's moment decay rates, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="AdamW's two moments (with optim.name=muon, those of its AdamW part; Muon's momentum "
                            "stays fp32): fp32, 8 bytes a parameter; bf16, 4 bytes, updated in fp32 and stored with "
                            "stochastic rounding (optim/adamw.py)")
    grad_clip: float = Field(1.0, ge=0, description="0 = no clipping")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    cooldown_frac: float = Field(0.2, ge=0, le=1, description="wsd: fraction of steps in the final decay")
    muon_lr: float = Field(0.02, gt=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_momentum_start: float = Field(0.85, ge=0, lt=1, description="muon: momentum at step 0 of its warm-up")
    muon_momentum_warmup_steps: int = Field(300, ge=0, le=MAX_STEPS)
    muon_zeropower: str = Field("newton_schulz5", description="newton_schulz5, polar_express or svd")
    muon_ns_steps: int = Field(5, ge=1)
    embed_lr: float | None = Field(None, description="muon: AdamW lr of embeddings (default lr)")
    head_lr: float | None = Field(None, description="muon: AdamW lr of the output head (default lr)")
    scalar_lr: float | None = Field(None, description="muon: AdamW lr of norms, gains and scalars (default lr)")


    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimSection":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)} must each lie in [0, 1) (e.g. [0.9, 0.95])")
        return self


class TrainSection(Section):
    global_batch_size: int = Field(512, ge=1, le=MAX_SEQUENCES, description="sequences per optimizer step, all ranks "
                                                                          "together")
    micro_batch_size: int = Field(16, ge=1, le=MAX_SEQUENCES, description=(
        "sequences per forward pass on one rank; where the command line does not give it, the largest size up to "
        "this one that divides a rank's share of the global batch (config/layout.py)"))
    epochs: float | None = Field(None, gt=0, le=10**6, description="the run's length in passes over the training "
                                                                   "data (one of max_steps, max_tokens, epochs; "
                                                                   "none: 1 epoch)")
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="the run's length in optimizer steps (one of "
                                                                        "max_steps, max_tokens, epochs)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description=(
        "the run's length in training tokens, as whole steps: max_tokens // (global_batch_size x data.seq_len) "
        "(one of max_steps, max_tokens, epochs)"))
    eval_every: int = Field(250, ge=0, le=MAX_STEPS, description="0 = only at the end")
    eval_tokens: int = Field(1_048_576, ge=1, le=MAX_TOKENS, description="tokens of the fixed validation slice")
    eval_tasks: list[str] = Field(default_factory=list, description=(
        "lm-eval tasks run while training, on rank 0 (the `eval` extra): lm-eval's task names or wildcards, or task "
        "YAML files; scores go to metrics.jsonl (event eval_tasks), RUN/eval/, /metrics and the dashboard; a task "
        "that cannot run is reported once and left out"))
    eval_tasks_every: int = Field(0, ge=0, le=MAX_STEPS, description="run train.eval_tasks every N steps and at the "
                                                                     "end (0 = only at the end)")
    eval_tasks_limit: int | None = Field(None, ge=1, le=MAX_SEQUENCES, description="documents per task in "
                                                                                    "train.eval_tasks (none: all)")
    checkpoint_every: int = Field(1000, ge=0, le=MAX_STEPS, description="0 = only at epoch ends and the end")
    checkpoints: bool = Field(True, description="false: no checkpoint at all (benchmarks, throwaway runs); a stop "
                                                "signal then ends the run without one, and it cannot be resumed")
    keep_last: int = Field(3, ge=1)
    compile: bool | Literal["auto"] = Field(False, description="torch.compile the model (Inductor); auto: on a "
                                                               "GPU, not on a CPU")
    cuda_graphs: bool | Literal["auto"] = Field(False, description=(
        "replay the compiled forward and backward as CUDA graphs (torch.compile's reduce-overhead mode): the host "
        "launches one graph instead of every kernel, for steps the host paces (t5-base: docs/performance.md). A "
        "CUDA GPU, train.compile, one process, the next-token objective; auto: on where all four hold. With "
        "several micro-batches a step the gradients stay allocated between steps; the graphs keep their "
        "activations' memory"))
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer "
                           "state sharded over the ranks of a node (FSDP2), replicated across nodes (HSDP); with "
                           "model.moe.expert_parallel either applies to the dense part, the experts split apart")
    float8: bool = Field(False, description="the blocks' linear layers train with float8 matmuls through torchao "
                                            "(FP8 tensor cores: H100, H200, L40S, Blackwell); under fsdp also "
                                            "float8 all-gathers")
    reshard_after_forward: bool = Field(True, description="fsdp: free gathered parameters after each block's "
                                                          "forward (less memory, one more all-gather)")
    grad_reduce: Literal["micro_batch", "step"] = Field(
        "micro_batch", description="fsdp with several micro-batches a step: reduce-scatter the gradients after "
                                   "every micro-batch (a rank keeps its shard), or once a step, after the last (a "
                                   "rank keeps the whole fp32 gradient of what fsdp shards until then: 4 bytes a "
                                   "parameter more; fewer collectives and host work, as ddp reduces once a step)")
    activation_checkpointing: Literal["none", "experts", "selective", "full"] = Field(
        "none", description="recompute in the backward to save memory: experts (families with experts) = keep "
                            "only the rows that enter the experts, recompute their hidden layer (one grouped "
                            "matmul and its GELU); selective = keep matmul and attention outputs, recompute the "
                            "elementwise ops; full = keep only each block's input")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    gc_every: int = Field(50, ge=0, le=MAX_STEPS, description=(
        "Python's garbage collection while training: automatic collection off, the young generations collected "
        "every this many steps and a full pass at each evaluation and save, on every rank at the same step "
        "(train/collect.py); 0 = Python's automatic collection"))
    pg_timeout_s: int = Field(1800, ge=10, description="process-group timeout (covers rank-0 saves and evals)")
    collective_timeout: float = Field(300, gt=0, description="seconds a rank may go without a heartbeat (killed, "
                                      "stopped, cut off) before the other ranks end the job naming it")
    sample_tokens: int = Field(200, ge=0, le=MAX_POSITIONS, description="tokens generated at the end of the run (0 = "
                                                                        "none)")
    sample_prompt: str = "\n"
    threads: int | None = Field(None, ge=1, description="CPU threads (default: all cores)")
    peak_tflops: float | None = Field(None, gt=0, description="per-device peak for MFU (default: from the GPU name)")
    objective: Literal["next_token", "dpo", "reward", "grpo"] = Field(
        "next_token", description="what a step trains: next_token (pretraining, SFT: the token loss, masked where the "
                                  "data has a loss mask); dpo (preference pairs: chosen and rejected responses in "
                                  "one forward, the loss of the dpo section; train.global_batch_size then counts "
                                  "pairs, or examples under dpo.loss=kto); reward (a reward model: a score head "
                                  "in place of the token head, trained on preference pairs so that the chosen "
                                  "response scores higher; global_batch_size counts pairs); grpo (online "
                                  "reinforcement learning: completions sampled from the model for each prompt, "
                                  "scored by the grpo section's reward functions, each trained on its advantage "
                                  "over its group; global_batch_size counts prompts)")
    memory_check: bool = Field(True, description="before the model is built, refuse a run whose memory plan "
                                                 "(`trainbox plan`: weights, gradients, optimizer state, "
                                                 "activations, communication, overhead) exceeds what the device "
                                                 "has free by more than the plan's error margin")
    memory_limit_gib: float = Field(0, ge=0, description="cap each process's GPU memory at this many GiB "
                                                         "(torch.cuda.set_per_process_memory_fraction), as on a "
                                                         "smaller GPU; 0 = the whole GPU")

    def compiled(self, cuda: bool) -> bool:
        """Whether a run on a GPU (`cuda`) or a CPU compiles."""
        return self.compile is True or (self.compile == "auto" and cuda)

    @model_validator(mode="after")
    def _cuda_graphs(self) -> "TrainSection":
        if self.cuda_graphs is True and self.compile is False:
            raise ValueError("train.cuda_graphs replays torch.compile's graphs: set train.compile=true (or auto), or "
                             "drop train.cuda_graphs")
        if self.cuda_graphs is True and self.objective != "next_token":
            raise ValueError(f"train.cuda_graphs replays the next-token objective's step, not train.objective="
                             f"{self.objective}'s: drop train.cuda_graphs")
        return self

    @model_validator(mode="after")
    def _one_length(self) -> "TrainSection":
        given = [f"train.{k}={getattr(self, k)}" for k in LENGTH_KEYS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each set the run's length: give one of train.max_steps, "
                             "train.max_tokens and train.epochs (one given on the command line replaces the "
                             "recipe's)")
        return self


class MonitorSection(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535, description="0 = pick a free port")
    token: str | None = None
    log_every: int = Field(10, ge=1, le=MAX_STEPS)
    stall_after: float | None = Field(None, gt=0, description="seconds without progress (or without a rank's "
                                      "heartbeat) before /health reports the run stalled; default: derived from "
                                      "the step time, 60 s for a rank")
    plot: bool = Field(True, description="write loss.png from metrics.jsonl when the run ends (false: throwaway "
                       "runs and benchmarks, which skip matplotlib's half second)")
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "trainbox"
    progress: Literal["auto", "bar", "lines"] = "auto"
    memory_snapshot: int = Field(0, ge=0, le=MAX_STEPS, description=(
        "record the CUDA allocator through this many steps and write memory_snapshot.rankR.pickle and "
        "memory_peak.rankR.json to the run directory"))


class LoraSection(Section):
    r: int = Field(16, ge=1)
    alpha: float = 32.0
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"
    gradient_checkpointing: bool = True


class QuantSection(Section):
    load_in_4bit: bool = False
    load_in_8bit: bool = False

    @model_validator(mode="after")
    def _one_mode(self) -> "QuantSection":
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("quant.load_in_4bit and quant.load_in_8bit are exclusive: choose one")
        return self

    @property
    def quantized(self) -> bool:
        """Whether the base loads in 4 or 8 bits."""
        return self.load_in_4bit or self.load_in_8bit


class RunConfig(Section):
    """The whole run. `trainbox config schema` lists its keys (config/describe.py); `--json` prints the JSON schema."""

    recipe: str | None = Field(None, description="recipe this config came from")
    requires_gpu: bool = Field(False, description="the recipe is made for a GPU: without one it is refused unless "
                                                  "train.device=cpu is given (then the memory check decides)")
    required: list[str] = Field(default_factory=list, description="keys the recipe needs given (e.g. [model.path]), "
                                                                  "checked when a run starts")
    run: RunSection = Field(default_factory=RunSection)
    data: DataSection = Field(default_factory=DataSection)
    model: ModelSection = Field(default_factory=ModelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)
    dpo: DpoSection = Field(default_factory=DpoSection, description="preference tuning (train.objective=dpo)")
    reward: RewardSection = Field(default_factory=RewardSection, description="reward modeling "
                                                                            "(train.objective=reward)")
    grpo: GrpoSection = Field(default_factory=GrpoSection, description="online reinforcement learning from rewards "
                                                                       "(train.objective=grpo)")
    lora: LoraSection = Field(default_factory=LoraSection)
    quant: QuantSection = Field(default_factory=QuantSection)

    @model_validator(mode="after")
    def _recompute_applies(self) -> "RunConfig":
        why = family(self.model.family).recompute
        if why and self.train.activation_checkpointing != "none":
            raise ValueError(f"train.activation_checkpointing={self.train.activation_checkpointing} does not apply "
                             f"to model.family={self.model.family}: {why}")
        if self.train.activation_checkpointing == "experts" and not family(self.model.family).experts:
            raise ValueError(f"train.activation_checkpointing=experts recomputes the experts' hidden layer; "
                             f"model.family={self.model.family} has no experts: use selective or full")
        return self

    def _objective_is(self, objective: str) -> bool:
        """Whether train.objective is `objective`, whose section (dpo, reward, grpo) is named the same; keys given in
        that section under another objective are refused."""
        given = getattr(self, objective).model_dump(exclude_defaults=True)
        if given and self.train.objective != objective:
            raise ValueError(f"{objective}.{next(iter(given))} applies to train.objective={objective}, not "
                             f"{self.train.objective}")
        return self.train.objective == objective

    def _check_prompt_budget(self, section: str) -> None:
        budget = getattr(self, section).max_prompt_len
        if budget is not None and budget >= self.data.seq_len:
            raise ValueError(f"{section}.max_prompt_len={budget} leaves no room for a response in "
                             f"data.seq_len={self.data.seq_len}: give less than {self.data.seq_len}")

    @model_validator(mode="after")
    def _preference_applies(self) -> "RunConfig":
        if not self._objective_is("dpo"):
            return self
        given = self.dpo.model_dump(exclude_defaults=True)
        spec = family(self.model.family)
        if spec.generate != "causal":
            users = which(lambda f: f.generate == "causal")
            raise ValueError(f"train.objective=dpo needs a causal language model (model.family={either(users)}), "
                             f"not {self.model.family}")
        loss = self.dpo.loss
        kto = loss in UNPAIRED_LOSSES
        wrong = [k for k in given if k in ("desirable_weight", "undesirable_weight") and not kto
                 or k == "label_smoothing" and loss not in ("dpo", "simpo", "robust", "exo_pair")
                 or k == "discopop_tau" and loss != "discopop"]
        if wrong:
            weighs = wrong[0].endswith("desirable_weight")
            raise ValueError(f"dpo.{wrong[0]} does not apply to dpo.loss={loss}"
                             + (": it weighs dpo.loss=kto's examples" if weighs else ""))
        if loss == "exo_pair" and not self.dpo.label_smoothing:
            raise ValueError("dpo.loss=exo_pair takes the log of dpo.label_smoothing: give it more than 0 (1e-3 in "
                             "its paper)")
        if kto and self.data.packing:
            raise ValueError("data.packing=true packs preference pairs; dpo.loss=kto's examples run one a row (their "
                             "mismatched sequences apart, without gradients): set data.packing=false")
        self._check_prompt_budget("dpo")
        return self

    @model_validator(mode="after")
    def _reward_applies(self) -> "RunConfig":
        if not self._objective_is("reward"):
            return self
        if not family(self.model.family).scores:
            raise ValueError(f"train.objective=reward puts a score head on the model, which model.family="
                             f"{self.model.family} does not take: use model.family={either(which(lambda f: f.scores))}")
        if self.data.packing:
            raise ValueError("data.packing=true: a reward model scores each sequence at its last token, one "
                             "sequence a row; set data.packing=false")
        self._check_prompt_budget("reward")
        return self

    @model_validator(mode="after")
    def _grpo_applies(self) -> "RunConfig":
        if not self._objective_is("grpo"):
            return self
        g = self.grpo
        if not family(self.model.family).rollouts:
            raise ValueError(f"train.objective=grpo samples completions from the model and trains their "
                             f"log-probabilities at the sampling temperature, which model.family={self.model.family} "
                             f"does not give: use model.family={either(which(lambda f: f.rollouts))}")
        if self.data.packing:
            raise ValueError("data.packing=true: grpo trains each sampled completion in a row of its own; set "
                             "data.packing=false")
        if g.max_completion_len >= self.data.seq_len:
            raise ValueError(f"grpo.max_completion_len={g.max_completion_len} leaves no room for a prompt in "
                             f"data.seq_len={self.data.seq_len}: give data.seq_len more than the prompt and the "
                             "completion together")
        return self

    @model_validator(mode="after")
    def _tokens_fill_a_step(self) -> "RunConfig":
        step = self.train.global_batch_size * self.data.seq_len
        if self.train.max_tokens is not None and self.train.max_tokens < step:
            raise ValueError(f"train.max_tokens={self.train.max_tokens} is less than one step's {step:,} tokens "
                             f"(train.global_batch_size={self.train.global_batch_size} x data.seq_len="
                             f"{self.data.seq_len}): give at least {step}, or train.max_steps")
        return self

    @model_validator(mode="after")
    def _sharding_applies(self) -> "RunConfig":
        if self.train.parallel != "fsdp":
            return self
        why = family(self.model.family).fsdp
        if why:
            raise ValueError(f"train.parallel=fsdp does not apply to model.family={self.model.family}: {why}")
        if self.optim.name == "muon":
            raise ValueError("optim.name=muon with train.parallel=fsdp: Muon orthogonalises whole matrices, which "
                             "FSDP splits over the ranks; use train.parallel=ddp (the speedrun models fit one GPU) "
                             "or optim.name=adamw")
        return self

    @model_validator(mode="after")
    def _required_keys_exist(self) -> "RunConfig":
        for key in self.required:
            node = self
            for part in key.split("."):
                if not isinstance(node, BaseModel) or part not in type(node).model_fields:
                    raise ValueError(f"required: {key!r} is not a config key")
                node = getattr(node, part)
        return self

    def check_required(self) -> None:
        """Raise ConfigError naming the `required` keys this config leaves unset (null or empty)."""
        missing = []
        for key in self.required:
            node = self
            for part in key.split("."):
                node = getattr(node, part)
            if node is None or node == "" or node == []:
                missing.append(key)
        if missing:
            raise ConfigError(f"{self.recipe or 'this config'} needs {' and '.join(missing)}",
                              hint="give " + " ".join(f"{k}=..." for k in missing) + " (see `trainbox config show "
                                   f"{self.recipe or 'FILE'}` for what the recipe sets)")

    @property
    def run_name(self) -> str:
        """run.name, or the recipe's name made into one safe path component."""
        if self.run.name:
            return self.run.name
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.recipe or "run").lstrip("._-")[:128] or "run"

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run_name
