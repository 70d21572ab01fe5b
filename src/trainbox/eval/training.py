"""train.eval_tasks: lm-eval tasks run while training, every train.eval_tasks_every steps and at the end.

    trainbox train tiny train.eval_tasks=[tasks/quiz.yaml] train.eval_tasks_every=100 train.eval_tasks_limit=200

Rank 0 runs the tasks on its own model through the adapter (eval/adapter.py), under the loop's autocast, with
train.micro_batch_size sequences per forward; the other ranks go on to the next collective (the stop vote before
the next step) and wait there, within train.pg_timeout_s. A model spread over the ranks (fsdp on several processes,
expert parallelism) would need every rank in each forward: config/layout.py refuses train.eval_tasks there before
any work. Tasks are resolved once, at the first evaluation; one that cannot run (unknown, a bad YAML, missing data,
an error inside lm-eval) is reported once with its reason and left out, and the run goes on. lm-eval's own log lines
and progress bars are kept off the training console. The scores are returned to the loop, which logs them
(metrics.jsonl event `eval_tasks`, the run state behind /metrics and the dashboard), and written to
RUN/eval/<time>.json as `trainbox eval` writes them (with the step and the git commit).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from trainbox import checkpoint
from trainbox.config import RunConfig
from trainbox.errors import TrainboxError
from trainbox.eval import results as records
from trainbox.eval.harness import refuse_non_causal, require_lm_eval
from trainbox.rundir.runs import git_commit

log = logging.getLogger("trainbox")
PER_TASK = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "group_subtasks")


def check(cfg: RunConfig) -> None:
    """What train.eval_tasks needs before any work (train/preflight.py): lm-eval installed and a causal model."""
    if cfg.train.eval_tasks:
        require_lm_eval("train.eval_tasks")
        refuse_non_causal(cfg.model.family, {})


class TaskEvaluation:
    """The run's lm-eval tasks on rank 0's model (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer, autocast: Callable,
                 heartbeat: Callable[[], None] | None = None):
        t = cfg.train
        self.specs, self.every, self.limit = list(t.eval_tasks), t.eval_tasks_every, t.eval_tasks_limit
        self.batch_size, self.seed = t.micro_batch_size, cfg.run.seed
        self.run_dir, self.tokenizer, self.autocast = run_dir, tokenizer, autocast
        self.heartbeat = heartbeat or (lambda: None)
        self.manager = None
        self.names: list[str] | None = None   # the tasks that run (resolved at the first evaluation)

    def due(self, step: int, total: int) -> bool:
        return bool(self.specs) and (step == total or (self.every > 0 and step % self.every == 0))

    def run(self, model: torch.nn.Module, step: int) -> dict | None:
        """The tasks on `model` at `step` -> {"scores": {task: {metric: value}}, "seconds", "path"}, or None when
        no task runs. The model is left in eval mode; the caller puts it back in training mode. The random number
        generators are as they were before (lm-eval seeds them), so the tasks leave training's draws unchanged."""
        t0 = time.time()
        rng = checkpoint.rng_state()   # lm-eval seeds python's, numpy's and torch's generators: training's come back
        try:
            results = self._run_tasks(model)
        finally:
            checkpoint.set_rng_state(rng)
        if not results or not results.get("results"):
            return None
        seconds = round(time.time() - t0, 3)
        summary = records.scores(results)
        results["trainbox"] = {"source": str(self.run_dir), "model": "trainbox", "step": step, "during_training": True,
                               "git_commit": git_commit(), "device": str(next(model.parameters()).device),
                               "batch_size": self.batch_size, "limit": self.limit, "seconds": seconds,
                               "scores": summary}
        return {"scores": summary, "seconds": seconds, "path": str(records.write(self.run_dir / "eval", results))}

    def _run_tasks(self, model: torch.nn.Module) -> dict | None:
        from trainbox.eval.adapter import TrainboxLM  # optional: lm_eval
        from trainbox.eval.tasks import quiet  # optional: lm_eval

        with quiet():
            if self.names is None:
                self._resolve()
            if not self.names:
                return None
            lm = TrainboxLM(model, self.tokenizer, batch_size=self.batch_size, autocast=self.autocast,
                            seed=self.seed, on_batch=self.heartbeat)
            try:
                results = self._evaluate(lm, self.names)
            except Exception:  # noqa: BLE001 - find the task that fails: each alone
                results = {}
                for name in list(self.names):
                    try:
                        _merge(results, self._evaluate(lm, [name]))
                    except Exception as e:  # noqa: BLE001 - lm-eval, datasets and task code raise anything
                        self._leave_out(name, f"{type(e).__name__}: {_first_line(e)}")
        return results

    def _resolve(self) -> None:
        """One TaskManager for every spec; each spec that fails is reported and left out."""
        from trainbox.eval import tasks as task_specs  # optional: lm_eval

        wanted = []
        for spec in self.specs:
            try:
                wanted.append(task_specs.task_file_name(Path(spec)) if spec.endswith(task_specs.SUFFIXES) else spec)
            except TrainboxError as e:
                self._leave_out(spec, e.message)
        self.manager = task_specs.make_manager([s for s in self.specs if s.endswith(task_specs.SUFFIXES)] +
                                               [w for w in wanted if w in self.specs])
        names, unknown = task_specs.match(self.manager, wanted)
        for name in unknown:
            self._leave_out(name, "neither lm-eval's registry nor a task file given holds it")
        self.names = []
        for name in names:
            try:
                task_specs.load(self.manager, name)
                self.names.append(name)
            except TrainboxError as e:
                self._leave_out(name, e.message)

    def _evaluate(self, lm, names: list[str]) -> dict:
        import lm_eval  # optional: lm_eval

        return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=self.manager, limit=self.limit,
                                       log_samples=False, bootstrap_iters=0)

    def _leave_out(self, task: str, why: str) -> None:
        log.warning(f"train.eval_tasks: {task} is left out of this run's evaluations: {why}")
        if self.names and task in self.names:
            self.names.remove(task)


def _merge(into: dict, results: dict) -> None:
    for key, value in results.items():
        if key in PER_TASK and isinstance(value, dict):
            into.setdefault(key, {}).update(value)
        else:
            into.setdefault(key, value)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""
