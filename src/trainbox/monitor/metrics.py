"""What /metrics serves (monitor/server.py): the JSON body by default, and the Prometheus exposition (`trainbox_`
prefix, base units, counters ending in `_total`, a `run` label) when the Accept header asks for Prometheus text or
OpenMetrics."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainbox.monitor.state import PREFERENCE, RunState
from trainbox.rundir import ranks
from trainbox.rundir.runs import latest_eval
from trainbox.rundir.status import ACTIVE_PHASES, health


def metrics_json(s: dict) -> dict:
    """The JSON body of /metrics (what scripts and `trainbox status URL` read)."""
    return {"current_step": s["step"], "total_steps": s["total_steps"], "last_loss": s["loss"],
            "is_training": s["phase"] in ACTIVE_PHASES,
            "gpu_memory_allocated": s["gpu_memory_allocated"], "val_loss": s["val_loss"], "lr": s["lr"],
            "grad_norm": s["grad_norm"], "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
            "tokens_seen": s["tokens_seen"], "checkpoints_saved": s["checkpoints_saved"],
            "restarts": s["restarts"], "eta_s": s["eta_s"], "phase": s["phase"],
            **{k: s[k] for k in PREFERENCE}}


# name -> (help, snapshot key); counters get `_total` appended by prometheus_client
COUNTERS = {"steps": ("optimizer steps taken by the run (resumed runs count from their checkpoint)", "step"),
            "tokens": ("training tokens consumed by the run", "tokens_seen"),
            "checkpoints": ("checkpoints saved by this process", "checkpoints_saved"),
            "restarts": ("times this run was resumed from a checkpoint", "restarts")}
GAUGES = {"loss": ("last training loss in nats per token", "loss"),
          "val_loss": ("last validation loss in nats per token", "val_loss"),
          "val_bits_per_byte": ("last validation loss in bits per byte", "val_bpb"),
          "learning_rate": ("current learning rate", "lr"),
          "grad_norm": ("gradient norm before clipping at the last logged step", "grad_norm"),
          "tokens_per_second": ("training throughput in tokens per second", "tokens_per_s"),
          "mfu_ratio": ("model FLOPs utilisation, 0 to 1", "mfu"),
          "gpu_memory_allocated_bytes": ("GPU memory allocated by tensors on rank 0", "gpu_memory_allocated"),
          "total_steps": ("optimizer steps planned", "total_steps"),
          "epoch": ("current epoch (0-based)", "epoch"),
          "eta_seconds": ("estimated seconds until the last step", "eta_s"),
          "step_duration_seconds": ("mean seconds per optimizer step in this process", "step_time_s"),
          "heartbeat_timestamp_seconds": ("unix time of the last progress", "heartbeat"),
          "start_timestamp_seconds": ("unix time this process started the run", "started_at"),
          # train.objective=dpo (absent otherwise): means over the last logged step's pairs
          "reward_chosen": ("preference: mean reward of the chosen responses", "reward_chosen"),
          "reward_rejected": ("preference: mean reward of the rejected responses", "reward_rejected"),
          "reward_margin": ("preference: mean reward margin, chosen minus rejected", "reward_margin"),
          "reward_accuracy_ratio": ("preference: share of pairs whose chosen reward is higher, 0 to 1",
                                    "reward_accuracy"),
          "val_reward_accuracy_ratio": ("preference: reward accuracy on the validation pairs", "val_reward_accuracy"),
          "kl": ("preference (dpo.loss=kto): the step's estimate of the policy's KL divergence from the reference",
                 "kl")}


class Collector:
    """Prometheus view of one snapshot: `trainbox_` prefix, base units, a `run` label."""

    def __init__(self, state: RunState, cfg):
        self.state, self.cfg = state, cfg

    def collect(self):
        s = self.state.snapshot()
        run = [s["run_name"]]
        for name, (doc, key) in COUNTERS.items():
            c = CounterMetricFamily(f"trainbox_{name}", doc, labels=["run"])
            c.add_metric(run, float(s[key] or 0))
            yield c
        for name, (doc, key) in GAUGES.items():
            if s[key] is None:  # not measured yet: absent rather than a made-up 0
                continue
            g = GaugeMetricFamily(f"trainbox_{name}", doc, labels=["run"])
            g.add_metric(run, float(s[key]))
            yield g
        ok, _ = health(s, self.cfg.stall_after, self.cfg.log_every, ranks=rank_beats(s))
        for name, doc, value in (("healthy", "1 when /health answers 200", ok),
                                 ("is_training", "1 while the run is loading, compiling, training, evaluating "
                                  "or checkpointing", s["phase"] in ACTIVE_PHASES)):
            g = GaugeMetricFamily(f"trainbox_{name}", doc, labels=["run"])
            g.add_metric(run, 1.0 if value else 0.0)
            yield g
        info = GaugeMetricFamily("trainbox_phase", "current phase (1 for the phase the run is in)",
                                 labels=["run", "phase"])
        info.add_metric([s["run_name"], s["phase"]], 1.0)
        yield info
        scores = latest_eval(s["run_dir"])
        if scores is not None:   # the newest record in RUN/eval/ (train.eval_tasks or `trainbox eval`)
            g = GaugeMetricFamily("trainbox_eval_task_score", "lm-eval score of the newest evaluation, by task "
                                  "and metric", labels=["run", "task", "metric"])
            for task, metrics in scores["scores"].items():
                for metric, value in metrics.items():
                    g.add_metric([s["run_name"], task, metric], float(value))
            yield g
            if scores.get("step") is not None:
                g = GaugeMetricFamily("trainbox_eval_task_step", "step of the checkpoint the newest lm-eval "
                                      "scores are of", labels=["run"])
                g.add_metric(run, float(scores["step"]))
                yield g


def rank_beats(snap: dict) -> list:
    """The heartbeats of the run's ranks (rundir/ranks.py) while it is active: a silent rank makes it unhealthy."""
    return ranks.read(snap["run_dir"]) if snap.get("phase") in ACTIVE_PHASES and snap.get("run_dir") else []


def wants_prometheus(accept: str) -> bool:
    """Prometheus text unless the client prefers JSON (browsers and curl send */*: JSON)."""
    accept = accept.lower()
    if "openmetrics" in accept:
        return True
    if "text/plain" not in accept:
        return False
    return "application/json" not in accept or accept.index("text/plain") < accept.index("application/json")
