"""trainbox's causal models behind lm-eval's model interface, registered with lm-eval as "trainbox".

    lm = TrainboxLM(model, tokenizer, batch_size=32)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])
    lm_eval.simple_evaluate(model="trainbox", model_args="path=runs/gpt2-125m", tasks=["hellaswag"])  # by name

lm-eval owns tasks, prompts and metrics; this class answers its three kinds of request with the model's own forward
and KV cache (any family whose `generate` is "causal"):

- loglikelihood (context, continuation) -> (sum of log p(each continuation token), whether every one is the argmax),
  over the model's whole head as it trained (a vocabulary padded past the tokenizer's ids included, as lm-eval's hf
  model counts a head wider than its tokenizer; the gpt family's Hugging Face export drops those rows, so there the
  hf model's loglikelihoods exceed ours by the little probability the model leaves on them).
  The pair is tokenised by lm-eval's TemplateLM exactly as for its `hf` model (trailing spaces of the context move to
  the continuation; the pair is encoded whole and split; an empty context is the end-of-text token). The model reads
  (context + continuation)[:-1], cut from the left to max_length tokens, and the continuation is scored at its own
  positions. Requests with the same context share its row: the context once, then each continuation but its last
  token, at the positions it has after the context alone, with a mask under which every token sees the context
  and its own continuation up to itself (the forward's `visible` and `position_ids`, where the model's
  `masks_attention` says it takes them: gpt, llama, and hf under sdpa or eager attention; otherwise a row holds one
  continuation of more than one token). A multiple-choice question of four answers thus costs one context
  instead of four; a continuation of one token adds no token at all, being read from the
  context's last position. A row holds at most max_length tokens (continuations beyond it start another row of the
  same context). Rows are sorted longest first and batched, batch_size rows a forward, right-padded: a causal model
  never looks to the right, so rows of one continuation need no mask. The forward computes the head for the last K
  positions of a batch only, K covering every continuation in it (`logits_to_keep`), so for short answers the head
  matmul and the log-softmax run over a few positions instead of the whole sequence. A batch's inputs are built
  on the host while the GPU runs the one before (pinned memory, copies that do not wait), and the scores stay on
  the device until every batch has run: one host read per call, so the GPU never waits for the host between
  batches.
- loglikelihood_rolling (text) -> its log-likelihood over disjoint windows of max_length tokens (lm-eval's
  get_rolling_token_windows; the first window is conditioned on the end-of-text token), scored as loglikelihood
  requests, all windows of all documents batched together.
- generate_until (context, generation settings) -> the continuation up to the first stop string, end-of-text or
  max_gen_toks tokens. The contexts of a batch differ in length: the batch prefills together up to its shortest
  context, then steps one position at a time through the KV cache, each row feeding its own context token until its
  context ends and its own prediction after that. No row ever attends to padding and every token sits at its true
  position, so a row's tokens are those it would get alone. Greedy when do_sample is false or the temperature is 0;
  otherwise sampled with temperature / top_k / top_p (generate.filter_logits) from one seeded generator.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import lm_eval.models  # noqa: F401 - lm-eval's own models (hf, ...) registered before ours: its registry loads
import numpy as np  # them itself only while it is empty
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from trainbox.generate import filter_logits
from trainbox.model.load import inference_device, load_for_inference


@register_model("trainbox")
class TrainboxLM(TemplateLM):
    """lm-eval's model interface over one of our models (`model.eval()` is set here; the caller restores train mode).

    `autocast`: a context factory entered around each call's forwards (the training loop's, or bf16 over fp32 weights);
    `max_length`: the longest input, by default the model's block_size; `on_batch`: called after every forward (the
    training loop's heartbeat)."""

    backend = "causal"

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 32, max_length: int | None = None,
                 max_gen_toks: int = 256, autocast: Callable | None = None, seed: int = 1234,
                 on_batch: Callable[[], None] | None = None):
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = max(1, int(batch_size))
        self._max_length = max_length or getattr(model, "block_size", None) or 2048
        self.max_gen_toks = max_gen_toks
        self.autocast = autocast or nullcontext
        self.seed = seed
        self.on_batch = on_batch or (lambda: None)
        param = next(model.parameters())
        self._device, self.dtype = param.device, param.dtype
        self.vocab = tokenizer.vocab_size   # ids past it pad the head: never generated
        # the forward takes a mask of the keys each query sees: several continuations share one context's row
        self.shares = bool(getattr(model, "masks_attention", False))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "TrainboxLM":
        """lm-eval's `--model trainbox --model_args path=RUN[,dtype=bfloat16]`."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "TrainboxLM":
        args, extra = dict(arg_dict), {k: v for k, v in (additional_config or {}).items() if v is not None}
        device = inference_device(extra.get("device") or args.pop("device", None))
        model, tokenizer, _ = load_for_inference(args.pop("path"), device)
        dtype = getattr(torch, args.pop("dtype", "float32"))   # autocast over fp32 weights, as `trainbox eval`
        autocast = None if dtype == torch.float32 else lambda: torch.autocast(device.type, dtype)
        batch = extra.get("batch_size", args.pop("batch_size", 32))
        return cls(model, tokenizer, batch_size=int(batch) if str(batch).isdigit() else 32, autocast=autocast,
                   **args)

    # ------------------------------------------------------------------ what TemplateLM asks
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------ loglikelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """[(request strings or None, context ids, continuation ids)] -> [(log-likelihood, greedy)]."""
        rows = sorted(self._rows(requests), key=lambda r: (-len(r.ids), r.ids))
        owners: list[int] = []   # the request of each score, in the order the batches produce them
        scores: list[torch.Tensor] = []   # per batch: (2, its requests) on the device, log-likelihood and misses
        # one autocast region for every batch: autocast casts each weight once and keeps the copy while it lasts
        with torch.no_grad(), self.autocast():
            for start in range(0, len(rows), self.batch_size):
                requests_of, sums = self._score(rows[start:start + self.batch_size])
                owners += requests_of
                scores.append(sums)
        out: list = [None] * len(requests)
        lps, misses = torch.cat(scores, 1).tolist() if scores else ([], [])
        for i, lp, miss in zip(owners, lps, misses):
            out[i] = (lp, miss == 0)
            if requests[i][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def _rows(self, requests) -> list["_Row"]:
        """The model's input rows: each context once, followed by its continuations (module docstring)."""
        by_context: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-(self.max_length + 1):]
            cut = max(1, len(whole) - len(continuation))   # a continuation longer than the model: its last tokens
            by_context.setdefault(tuple(whole[:cut]), []).append((i, whole[cut:]))
        rows = []
        for context, continuations in by_context.items():
            row = _Row(context)
            for i, continuation in continuations:
                if not row.fits(continuation, self.max_length, self.shares):
                    rows.append(row)
                    row = _Row(context)
                row.add(i, continuation)
            rows.append(row)
        return rows

    def _score(self, rows: list["_Row"]):
        """One forward over `rows` (longest first) -> (the request of each continuation they score, (2, those
        requests) on the device: the log-likelihood and the count of tokens that are not the argmax)."""
        B, T = len(rows), len(rows[0].ids)
        first = min(len(r.context) for r in rows) - 1   # the first position any continuation reads
        shared = any(r.segments > 1 for r in rows)   # else each row is one causal sequence, at its own positions
        x = np.zeros((B, T), dtype=np.int64)
        where, targets, owner, requests = [], [], [], []   # flat index into the kept logits of each scored token
        for b, row in enumerate(rows):
            x[b, :len(row.ids)] = row.ids
            for i, at, continuation in row.scored:
                where += [b * (T - first) + p - first for p in at]
                targets += continuation
                owner += [len(requests)] * len(continuation)
                requests.append(i)
        x, where, targets, owner = (self._send(np.asarray(v, dtype=np.int64)) for v in (x, where, targets, owner))
        kwargs = {}
        if shared:   # a query sees its row's context and its own continuation, up to itself
            positions, segments = np.zeros((B, T), dtype=np.int64), np.full((B, T), -1, dtype=np.int64)
            for b, row in enumerate(rows):
                positions[b, :len(row.ids)], segments[b, :len(row.ids)] = row.positions, row.segment
            segment = self._send(segments)
            causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            visible = causal & ((segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == 0))
            kwargs = {"position_ids": self._send(positions), "visible": visible}
        logits = self.model(x, logits_to_keep=T - first, **kwargs).logits   # positions first..T-1
        scored = logits.flatten(0, 1)[where].float()   # (tokens, V): only the positions a continuation reads
        token_lp = (scored.gather(1, targets[:, None])[:, 0] - torch.logsumexp(scored, -1)).double()
        sums = torch.zeros(2, len(requests), dtype=torch.float64, device=self.device)
        sums[0].index_add_(0, owner, token_lp)
        sums[1].index_add_(0, owner, (scored.argmax(-1) != targets).double())
        self.on_batch()
        return requests, sums

    def _send(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the model's device; from pinned memory on a GPU, so the copy waits for nothing."""
        t = torch.from_numpy(a)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[k] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}   # one set of generation settings per batch
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items(), key=str)), []).append(i)
        out: list = [None] * len(requests)
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        with torch.no_grad(), self.autocast():   # one region: each weight cast once
            for members in groups.values():
                self._generate_group(requests, members, gen, out)
        return out

    def _generate_group(self, requests, members: list[int], gen: torch.Generator, out: list) -> None:
        """The requests `members`, which share their generation settings, batched longest context first."""
        settings = dict(requests[members[0]].args[1])
        until = settings.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eot = self.tokenizer.decode([self.eot_token_id])
        if eot and eot not in until:
            until.append(eot)
        max_gen = int(settings.pop("max_gen_toks", settings.pop("max_new_tokens", self.max_gen_toks)))
        if max_gen >= self.max_length:
            raise ValueError(f"max_gen_toks={max_gen} leaves no room for a context in the model's "
                             f"{self.max_length} positions")
        sampling = _sampling(settings)
        contexts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen):] or [self.eot_token_id]
                    for i in members}
        order = sorted(members, key=lambda i: -len(contexts[i]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, text in zip(batch, self._generate([contexts[i] for i in batch], until, max_gen, sampling, gen)):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)

    def _generate(self, contexts: list[list[int]], until: list[str], max_gen: int, sampling: dict | None,
                  gen: torch.Generator) -> list[str]:
        """Continue every context (see the module docstring); -> each continuation cut before its first stop string."""
        B, lens = len(contexts), [len(c) for c in contexts]
        low, high = min(lens), max(lens)
        prompt = torch.zeros(B, high, dtype=torch.long)
        for b, c in enumerate(contexts):
            prompt[b, :len(c)] = torch.tensor(c)
        prompt = prompt.to(self.device)
        in_context = torch.tensor(lens, device=self.device)   # a row is still reading its context below this
        caches = self.model.make_caches(B, high + max_gen, self._cache_dtype(), self.device)
        lookback = max((len(self.tok_encode(s)) for s in until), default=1) + 2
        outs: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        logits = self.model(prompt[:, :low], caches=caches, pos=0).logits[:, -1]
        pos = low   # every row's logits predict this position
        while True:
            nxt = _next_token(logits[:, :self.vocab].float(), sampling, gen)
            feed = torch.where(pos < in_context, prompt[:, min(pos, high - 1)], nxt)
            for b, token in enumerate(feed.tolist()):
                if done[b] or pos < lens[b]:
                    continue
                if token == self.eot_token_id:
                    done[b] = True
                    continue
                outs[b].append(token)
                tail = self.tok_decode(outs[b][-lookback:])
                done[b] = len(outs[b]) >= max_gen or any(s and s in tail for s in until)
            if all(done):
                break
            logits = self.model(feed[:, None], caches=caches, pos=pos).logits[:, -1]
            self.on_batch()
            pos += 1
        texts = []
        for tokens in outs:
            text = self.tok_decode(tokens)
            for s in until:
                if s:
                    text = text.split(s)[0]
            texts.append(text)
        return texts

    def _cache_dtype(self) -> torch.dtype:
        """The dtype keys and values have inside the forward (called inside its autocast region)."""
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return self.dtype


def _sampling(settings: dict) -> dict | None:
    """None for greedy decoding (do_sample false, or a temperature of 0), else the sampling settings."""
    temperature = float(settings.get("temperature", 0.0) or 0.0)
    if not settings.get("do_sample", False) or temperature == 0.0:
        return None
    return {"temperature": temperature, "top_k": settings.get("top_k"), "top_p": settings.get("top_p")}


def _next_token(logits: torch.Tensor, sampling: dict | None, gen: torch.Generator) -> torch.Tensor:
    if sampling is None:
        return logits.argmax(-1)
    probs = filter_logits(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"]).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


class _Row:
    """One input row of loglikelihood requests: a context, then the continuations that follow it, each placed after
    the context at the positions it would have alone; `segment` numbers the context 0 and each continuation of more
    than one token 1, 2, ... (a continuation of one token is read from the context's last position alone)."""

    def __init__(self, context: tuple[int, ...]):
        self.context, self.ids = context, list(context)
        self.positions, self.segment = list(range(len(context))), [0] * len(context)
        self.segments = 0
        self.scored: list[tuple[int, list[int], list[int]]] = []   # (request, positions that predict it, its ids)
        self._placed: dict[tuple[int, ...], list[int]] = {}

    def fits(self, continuation: list[int], max_length: int, shares: bool) -> bool:
        """Whether `continuation` can join: always when it adds no token or is placed already; else the model
        must see shared contexts (`shares`) or the row hold no continuation of more than one token yet, and the
        row stay within max_length."""
        adds = len(continuation) - 1
        if adds == 0 or tuple(continuation) in self._placed or self.segments == 0:
            return True
        return shares and len(self.ids) + adds <= max_length

    def add(self, request: int, continuation: list[int]) -> None:
        key = tuple(continuation)
        if key not in self._placed:
            n, start = len(self.context), len(self.ids)
            if len(continuation) > 1:
                self.segments += 1
                self.ids += continuation[:-1]
                self.positions += range(n, n + len(continuation) - 1)
                self.segment += [self.segments] * (len(continuation) - 1)
            self._placed[key] = [n - 1, *range(start, start + len(continuation) - 1)]
        self.scored.append((request, self._placed[key], continuation))
