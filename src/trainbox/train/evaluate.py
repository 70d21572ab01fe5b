"""The loop's evaluations (a part of train/loop.py's Trainer): the validation at train.eval_every (the objective's own:
objective/next_token.py, loss and bits per byte; objective/preference.py, pairs), lm-eval tasks at
train.eval_tasks_every on rank 0, the end-of-run sample; and the autocast context the loop runs forwards in."""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from trainbox import checkpoint
from trainbox.eval.results import flat
from trainbox.files import open_append
from trainbox.generate import sample
from trainbox.monitor.console import log
from trainbox.objective.next_token import evaluate  # noqa: F401 - the token validation, where callers look for it
from trainbox.train.device import is_out_of_memory, out_of_memory


def autocast_context(device: torch.device, dtype: torch.dtype):
    """A fresh autocast context (bf16/fp16 on GPU); a no-op in fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class Evaluations:
    """Mixed into Trainer: uses its cfg, dist, model, objective, tasks, sinks, state, tokenizer and run_dir."""

    def _evaluate(self, step: int) -> dict:
        self._phase("evaluating")
        if self.family.steps:  # evaluate with the window of `step` (the final one at the end), as the record
            self.model.set_step(step, self.total)  # scripts do; the next training step sets its own
        try:
            res = self.objective.evaluate(self.runtime())
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            raise out_of_memory(e, step, self.cfg.train.micro_batch_size, self.device,
                                checkpoint.latest(self.ckpt_root), during="the evaluation after step") from None
        res["step"] = step
        if self.dist.is_main:
            self.sinks.log("eval", **res, tokens=self.tokens_seen)
            self.state.update(**{k: res.get(k) for k in self.objective.eval_keys})
            self.state.add_point({"step": step, "tokens": self.tokens_seen,
                                  **{k: res[k] for k in self.objective.eval_keys if k in res}})
            log.info(f"eval step {step}: {self.objective.eval_line(res)}")
        self._phase("training")
        return res

    def _evaluate_tasks(self, step: int) -> float:
        """train.eval_tasks on rank 0 (the other ranks wait at the next collective); -> the seconds it took."""
        t0 = time.time()
        self._phase("evaluating")
        try:   # a task that fails (out of memory included) is reported and left out by TaskEvaluation
            res = self.tasks.run(self.model, step)
        finally:
            self.model.train()
        if res is not None:
            scores = flat(res["scores"])
            self.sinks.log("eval_tasks", step=step, scores=scores, seconds=res["seconds"], file=res["path"])
            self.state.add_point({"step": step, "eval_tasks": scores})
            log.info(f"eval tasks step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()) +
                     f" ({res['seconds']:.1f}s)")
        self._phase("training")
        return time.time() - t0

    def _heartbeat(self) -> None:
        """Progress inside a long evaluation: the state's heartbeat, status.json at most every 10 s."""
        self.state.update()
        now = time.time()
        if now - self._status_written >= 10:
            self._status_written = now
            self.state.write_status(self.run_dir / "status.json")

    def _final_sample(self) -> str | None:
        """The end-of-run sample, by rank 0; a model spread over the ranks (fsdp, expert parallelism) needs every
        rank in its forward (each samples the same tokens: the same seed)."""
        n = self.cfg.train.sample_tokens
        if not n or self.family.generate != "causal" or not (self.dist.is_main or self.parallel.collective):
            return None
        text = sample(self.model, self.tokenizer, self.cfg.train.sample_prompt, max_tokens=n, temperature=0.8,
                      top_k=50, seed=self.cfg.run.seed, device=self.device)
        if not self.dist.is_main:
            self.model.train()
            return None
        with open_append(self.run_dir / "samples.txt") as f:
            f.write(f"--- step {self.total}\n{self.cfg.train.sample_prompt}{text}\n")
        self.model.train()
        return text
