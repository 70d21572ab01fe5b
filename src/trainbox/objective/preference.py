"""The preference objective (train.objective=dpo): dpo, ipo, simpo and orpo on pairs of responses to one prompt.

    trainbox train dpo model.path=FOLDER data.path=prefs.jsonl                          # every weight (llama)
    trainbox train dpo model.family=hf model.path=FOLDER data.path=prefs.jsonl          # LoRA adapters

A micro-batch of B pairs is one forward of 2B sequences, the chosen ones then the rejected ones (the batch
data/preference.py builds), so both see the same weights and kernels and the model runs once. A sequence's
log-probability is the sum of its trained tokens' (the response's assistant tokens): the family's own forward with
`reduction="none"` gives each token's loss, so every causal family trains on pairs without code of its own. The
losses are objective/losses.py's; a step's loss is their mean over the global batch's pairs (each micro-batch adds
its sum over that count).

The reference (dpo, ipo; simpo and orpo have none) is the initial model:
- dpo.reference=precompute (default): its log-probabilities of every pair, train and validation, computed once
  before the first step in the autocast dtype (a no-grad forward of the initial weights in eval mode, the pairs
  spread over the ranks) and stored beside the prepared pairs as OUT_{split}_pairs.ref-KEY.npy (in
  data.cache_dir/references/ where that folder is read-only). KEY is a hash of the initial weights' identity (the
  files of run.init_from or model.path: names, sizes, modification times; else the seed and the model's
  config), the dtype, the device type, the pair files and the truncation. A resumed run, and any later run of the
  same weights and data, reads it back; a resumed run that finds none builds its initial weights again to compute
  it before its checkpoint is loaded.
- dpo.reference=model: a frozen copy of the initial model (parameters in the autocast dtype; sharded like the
  policy under fsdp) run without gradients beside the policy in every micro-batch.
- LoRA (a family whose `adapters` are switched off to give its frozen base): the base itself, PEFT's
  disable_adapter, for either setting: no copy and no extra memory.

Packed (data.packing=true, data/pairs.py PackedPairs): B rows of 2 x data.seq_len positions, each holding whole pairs,
instead of 2B padded rows; a sequence's log-probability is summed over its slot (`seq_index`), empty slots weigh
nothing, and a step's loss is the mean over the pairs in its rows.

Logged with the loss (the mean over the global batch): reward_chosen, reward_rejected, reward_margin,
reward_accuracy (the share of pairs whose chosen reward is higher), logp_chosen, logp_rejected (summed
log-probabilities of the responses). Validation: val_loss, val_reward_accuracy, val_reward_margin,
val_reward_chosen and val_reward_rejected over up to train.eval_tokens / (2 x data.seq_len) validation pairs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from trainbox.data.packing import packed_inputs
from trainbox.data.pairs import PackedPairs, PairDataset, open_pair_datasets
from trainbox.data.sources import default_cache_dir
from trainbox.model.build import packs_pairs
from trainbox.model.spec import family
from trainbox.objective.base import Objective, Part, Runtime
from trainbox.objective.losses import REFERENCE_FREE, pair_loss

log = logging.getLogger("trainbox")

STATS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model")


def sequence_logps(forward, batch: dict) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(summed log-probability of each sequence's trained tokens in fp32, how many there are, the model's Output):
    a sequence a row, or in packed rows (data/pairs.py PackedPairs) a sequence a slot of `seq_index`."""
    mask = batch["loss_mask"]
    out = forward(batch["x"], batch["y"], loss_mask=mask, reduction="none", **packed_inputs(batch))
    if "seq_index" not in batch:
        return -out.loss.float().sum(-1), mask.sum(-1), out
    slots = 2 * batch["pair_valid"].shape[0]   # and one more, where the padding goes
    index = batch["seq_index"].reshape(-1)
    logps = torch.zeros(slots + 1, device=index.device).index_add_(0, index, out.loss.float().reshape(-1))
    n = torch.zeros(slots + 1, dtype=torch.int64, device=index.device).index_add_(0, index, mask.reshape(-1).long())
    return -logps[:slots], n[:slots], out


@contextmanager
def eval_mode(model: torch.nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class Preference(Objective):
    name = "dpo"
    sequences = 2
    unit = "pairs"
    stat_names = STATS
    eval_keys = ("val_loss", "val_reward_accuracy", "val_reward_margin")
    val_stats = ("reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected")   # validation's, of STATS

    def __init__(self, cfg, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.cfg, self.dpo = cfg, cfg.dpo
        self.device, self.dtype = device or torch.device("cpu"), dtype or torch.float32
        self.needs_reference = cfg.dpo.loss not in REFERENCE_FREE
        self.disable_dropout = cfg.dpo.disable_dropout
        self.adapters = family(cfg.model.family).adapters
        self.reference_forward = None   # dpo.reference=model: the reference's log-probabilities of a batch
        self.missing: list[tuple[PairDataset, Path]] = []   # precompute: (pairs, where to store their reference)
        self.dist = None

    @classmethod
    def frozen_copy(cls, cfg) -> bool:
        return (cfg.dpo.loss not in REFERENCE_FREE and cfg.dpo.reference == "model"
                and not family(cfg.model.family).adapters)

    @classmethod
    def resolve(cls, cfg):
        """dpo.disable_dropout: the policy trains with model.dropout and lora.dropout at 0."""
        return without_dropout(cfg) if cfg.dpo.disable_dropout else cfg

    # ------------------------------------------------------------------ data
    def open_datasets(self, cfg, tokenizer, vocab: int):
        train, val = open_pair_datasets(cfg.data, cfg.dpo, tokenizer, vocab)
        for ds in (train, val):
            if ds is not None:
                log.info(ds.describe())
        if self.needs_reference and self.dpo.reference == "precompute":
            for ds in (train, val):
                if ds is not None:
                    self._find_reference(ds)
        if packs_pairs(cfg):   # the reference is the pairs' own, found (and computed) unpacked
            train, val = (PackedPairs(ds) if ds is not None else None for ds in (train, val))
            log.info(train.describe())
        return train, val

    def _find_reference(self, ds: PairDataset) -> None:
        key = hashlib.sha256(json.dumps([weights_identity(self.cfg), str(self.dtype), self.device.type,
                                         ds.identity(), ds.seq_len, self.dpo.max_prompt_len, "ref-v1"]
                                        + ([] if type(ds) is PairDataset else [type(ds).__name__]),
                                        default=str).encode()).hexdigest()[:16]
        beside = Path(f"{ds.prefix}_{ds.split}_{ds.kind}.ref-{key}.npy")
        apart = default_cache_dir(self.cfg.data) / "references" / f"{ds.prefix.parent.name}-{ds.prefix.name}-" \
                                                                   f"{ds.split}-{key}.npy"
        for path in (beside, apart):
            if path.is_file():
                ref = np.load(path)
                if ref.shape == (ds.num_samples, 2) and np.isfinite(ref).all():
                    ds.reference = ref
                    log.info(f"dpo: reference log-probabilities of {ds.name} from {path}")
                    return
                log.info(f"warning: {path} does not hold {ds.num_samples} {ds.unit}' reference log-probabilities; "
                         "computing them again")
        self.missing.append((ds, beside if os.access(beside.parent, os.W_OK) else apart))

    def needs_initial_weights(self, cfg) -> bool:
        return bool(self.missing) or self.frozen_copy(cfg)

    def denominator(self, batches, step: int) -> int:
        """Pairs: the global batch's, or those in its packed rows."""
        ds = batches.dataset
        return ds.pairs_in(batches.global_indices(step)) if isinstance(ds, PackedPairs) else batches.global_batch

    # ------------------------------------------------------------------ the reference
    def _reference(self, run: Runtime):
        """The reference's log-probabilities of a batch (no gradients, eval mode)."""
        model = run.reference if run.reference is not None else run.model
        adapters = model.adapters_off if self.adapters else None

        @torch.no_grad()
        def logps(batch: dict) -> torch.Tensor:
            with eval_mode(model), (adapters() if adapters is not None else _nothing()):
                return sequence_logps(model, batch)[0]
        return logps

    def _both(self, reference):
        """The reference's log-probabilities of both sequences of each sample of a batch (first ones, then
        second ones), as `precompute` stores them: a pair batch's rows are already both."""
        return reference

    def attach(self, run: Runtime) -> None:
        self.dist = run.dist
        if self.disable_dropout:   # what the config's keys do not reach: a Hugging Face model's own dropout
            for m in run.model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        if not self.needs_reference:
            return
        reference = self._reference(run)
        for ds, path in self.missing:   # the initial model's, before any checkpoint is loaded
            ds.reference = precompute(self._both(reference), ds, run)
            if run.dist.is_main:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, ds.reference)
                os.replace(tmp, path)
                log.info(f"dpo: reference log-probabilities stored in {path}")
        self.missing = []
        if self.dpo.reference == "model":
            self.reference_forward = reference

    # ------------------------------------------------------------------ the loss
    def loss(self, forward, batch: dict, scale: float) -> Part:
        rc = rr = None
        if self.needs_reference:   # first: its forward's transients are gone before the policy's activations
            ref = batch.get("ref_logps")
            rc, rr = (ref if ref is not None else self.reference_forward(batch)).chunk(2)
        logps, n, out = sequence_logps(forward, batch)
        pc, pr = logps.chunk(2)
        nc, nr = n.chunk(2)
        valid = batch.get("pair_valid")
        if valid is not None:   # packed rows' empty slots: a stand-in pair that every loss keeps finite, weighed 0
            pc, pr, nc, nr = (torch.where(valid, v, v.new_ones(()) * f) for v, f in
                              ((pc, -1), (pr, -1), (nc, 1), (nr, 1)))
            if rc is not None:
                rc, rr = (torch.where(valid, v, v.new_ones(()) * -1) for v in (rc, rr))
        per_pair, chosen, rejected = pair_loss(self.dpo, pc, pr, rc, rr, nc, nr)
        w = valid.float() if valid is not None else torch.ones_like(per_pair)
        stats = torch.stack([(chosen * w).sum(), (rejected * w).sum(), ((chosen - rejected) * w).sum(),
                             ((chosen > rejected) * w).sum(), (pc * w).sum(), (pr * w).sum()]).detach().float()
        return Part((per_pair * w).sum() * scale, out.aux_loss, stats * scale, out.stats)

    def samples(self, batch: dict, rows: int) -> torch.Tensor | int:
        """How many pairs the first `rows` rows of a validation batch hold."""
        valid = batch.get("pair_valid")
        return rows if valid is None else valid.view(len(batch["x"]), -1)[:rows].sum()

    @torch.no_grad()
    def evaluate(self, run: Runtime) -> dict:
        ds, cfg = run.val, run.cfg
        micro, world, rank = cfg.train.micro_batch_size, run.dist.world, run.dist.rank
        n = min(ds.num_samples, max(1, cfg.train.eval_tokens // (2 * ds.seq_len)))   # pairs, or packed rows
        mine = np.arange(n)[rank::world]
        sums = torch.zeros(2 + len(self.stat_names), dtype=torch.float64, device=run.device)   # loss, samples, stats
        forward = run.forward if not cfg.train.compile else run.model
        rounds = math.ceil(math.ceil(n / world) / micro)   # as many forwards on every rank
        ids = [mine[k * micro:(k + 1) * micro] for k in range(rounds)]
        batches = [{key: v.to(run.device) for key, v in ds.batch(i if len(i) else np.arange(1)).items()} for i in ids]
        with eval_mode(run.model):
            with run.autocast():
                self.before_step(forward, batches, [len(i) for i in ids])
            for i, batch in zip(ids, batches):
                with run.autocast():
                    part = self.loss(forward, batch, 1.0)
                if len(i):
                    count = torch.as_tensor(self.samples(batch, len(i)), dtype=torch.float64, device=run.device)
                    sums += torch.cat([part.loss.detach().double().view(1), count.view(1), part.stats.double()])
        run.dist.all_reduce_sum(sums)
        total = sums.tolist()
        count = max(total[1], 1)
        stats = self.step_stats({k: v / count for k, v in zip(self.stat_names, total[2:])})
        return {"val_loss": total[0] / count, **{f"val_{k}": v for k, v in stats.items() if k in self.val_stats},
                f"val_{ds.unit}": int(total[1])}

    def eval_line(self, res: dict) -> str:
        return (f"val loss {res['val_loss']:.4f} ({self.dpo.loss}), reward accuracy {res['val_reward_accuracy']:.3f}, "
                f"margin {res['val_reward_margin']:.4f} over {res['val_pairs']} pairs")


def without_dropout(cfg):
    """`cfg` with model.dropout and lora.dropout at 0 (a new config where either was not)."""
    if cfg.model.dropout == 0 and cfg.lora.dropout == 0:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"dropout": 0.0}),
                                  "lora": cfg.lora.model_copy(update={"dropout": 0.0})})


@contextmanager
def _nothing():
    yield


def precompute(reference, ds: PairDataset, run: Runtime) -> np.ndarray:
    """The reference's summed log-probabilities of every pair of `ds` -> (pairs, 2: chosen, rejected) float32. Rank r
    takes pairs r, r + world, ... in micro-batches; every rank runs as many forwards (fsdp gathers in each)."""
    n, world, rank, micro = ds.num_samples, run.dist.world, run.dist.rank, run.cfg.train.micro_batch_size
    mine = np.arange(n)[rank::world]
    rounds = math.ceil(math.ceil(n / world) / micro)
    out = torch.zeros(n, 2, dtype=torch.float32, device=run.device)
    start = last = time.perf_counter()
    log.info(f"dpo: computing the reference log-probabilities of {n:,} {ds.unit} of {ds.name}")
    for k in range(rounds):
        ids = mine[k * micro:(k + 1) * micro]
        batch = {key: v.to(run.device) for key, v in ds.batch(ids if len(ids) else np.arange(1)).items()}
        with run.autocast():
            logps = reference(batch)
        if len(ids):
            idx = torch.from_numpy(ids).to(run.device)
            out[idx] = torch.stack(logps.chunk(2), dim=1)
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            log.info(f"dpo: reference log-probabilities {100 * (k + 1) / rounds:.0f}% done")
    run.dist.all_reduce_sum(out)
    log.info(f"dpo: reference log-probabilities of {n:,} {ds.unit} in {time.perf_counter() - start:.1f}s")
    return out.cpu().numpy()


def weights_identity(cfg) -> list:
    """What the initial weights are: the files of run.init_from (or model.path, the base of adapters) with their sizes
    and modification times, or the seed that draws them; with the model's config and the quantisation."""
    source = cfg.run.init_from or (cfg.model.path if family(cfg.model.family).adapters else None)
    ident: list = [cfg.model.model_dump(mode="json"), cfg.quant.model_dump(mode="json")]
    if source is None:
        return ident + [["seed", cfg.run.seed]]
    path = Path(source).expanduser()
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES) if path.is_dir() \
        else [path] if path.is_file() else []
    return ident + [str(source)] + [[str(f.relative_to(path) if path.is_dir() else f.name), f.stat().st_size,
                                     f.stat().st_mtime_ns] for f in files]
