"""The loop's reports (a part of train/loop.py's Trainer): each logged window of steps read once on the host (the
losses, the grad norm, the NaN check, peak memory over the ranks), written by rank 0 to the sinks (metrics.jsonl and
the rest), status.json and the console; and the phase status.json shows."""
from __future__ import annotations

import math

import torch

from trainbox import checkpoint
from trainbox.errors import TrainingFailed
from trainbox.monitor.console import fmt_duration, log
from trainbox.monitor.meter import Meter


class Reporting:
    """Mixed into Trainer: uses its cfg, dist, device, objective, state, sinks, progress, total, tokens_seen,
    flops_per_token, peak, batches, last_stats and objective_stats."""

    def _phase(self, phase: str) -> None:
        if self.dist.is_main:
            self.state.update(phase=phase)
            self.state.write_status(self.run_dir / "status.json")

    def _log_window(self, window, first_step, step, grad_norm, lr, meter: Meter) -> None:
        self._saves_published()
        if not window:
            return
        losses = torch.stack(window).float()
        self.dist.all_reduce_sum(losses)   # each rank holds its share of the global mean: the sum is the mean
        losses = losses.tolist()  # one host sync per logged window
        objective = {}
        if self.objective_stats is not None:   # the last step's, over the global batch
            objective = self.objective.step_stats(dict(zip(self.objective.stat_names,
                                                           self.dist.all_reduce_sum(self.objective_stats).tolist())))
        bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        if bad is not None:
            raise TrainingFailed(f"loss is {losses[bad]} at step {first_step + bad + 1}; stopping. The last good "
                                 f"checkpoint is {checkpoint.latest(self.ckpt_root) or 'none'}",
                                 hint="lower optim.lr, raise optim.warmup_steps or check the data; then resume")
        tok_s, per_step = meter.window(step)
        eta = per_step * (self.total - step) if per_step else None
        mfu = tok_s * self.flops_per_token / (self.peak * self.dist.world) if tok_s and self.peak else None
        gn = float(grad_norm) if grad_norm is not None else None
        peaks = {}
        if self.device.type == "cuda":   # what tensors held and what the allocator reserved, on the fullest rank
            # (under expert parallelism each rank's experts get their own share of the tokens)
            held, reserved = self.dist.max_over_ranks([torch.cuda.max_memory_allocated(self.device),
                                                       torch.cuda.max_memory_reserved(self.device)])
            peaks = {"peak_mem_gib": round(held / 2**30, 3), "peak_reserved_gib": round(reserved / 2**30, 3)}
        if not self.dist.is_main:
            return
        last = {"lr": lr, "grad_norm": gn, "tokens_per_s": tok_s, "mfu": mfu, "tokens": self.tokens_seen,
                **peaks, **objective, **self._stats()}
        for i, v in enumerate(losses):
            self.sinks.log("train", step=first_step + i + 1, loss=v, **(last if i == len(losses) - 1 else {}))
        mem = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.state.update(step=step, loss=losses[-1], lr=lr, grad_norm=gn, tokens_per_s=tok_s, mfu=mfu, eta_s=eta,
                          epoch=(step - 1) // self.batches.steps_per_epoch, tokens_seen=self.tokens_seen,
                          step_time_s=per_step, gpu_memory_allocated=mem,
                          steps_this_process=step - meter.first_step,
                          tokens_this_process=(step - meter.first_step) * meter.tokens_per_step, **objective)
        self.state.add_point({"step": step, "loss": losses[-1], "lr": lr, "tokens_per_s": tok_s,
                              "tokens": self.tokens_seen, **objective})
        self.state.write_status(self.run_dir / "status.json")
        extra = f" mfu {100 * mfu:.1f}%" if mfu else ""
        if "reward_accuracy" in objective:
            extra += f" acc {objective['reward_accuracy']:.2f} margin {objective['reward_margin']:.3f}"
        elif "desirable" in objective:   # unpaired examples (objective/kto.py)
            margin = objective.get("reward_margin")
            extra += (f" margin {margin:.3f}" if margin is not None else "") + \
                (f" kl {objective['kl']:.3f}" if "kl" in objective else "")
        if peaks:
            extra += f" mem {peaks['peak_mem_gib']:.1f}GiB peak"
        rate = f"{tok_s:,.0f}" if tok_s is not None else "?"
        log.info(f"step {step}/{self.total} loss {losses[-1]:.4f}{f' lr {lr:.3g}' if lr is not None else ''}"
                 f"{f' gnorm {gn:.3f}' if gn is not None else ''} tok/s {rate}{extra} "
                 f"eta {fmt_duration(eta)}",
                 extra={"progress": True})
        self.progress.update(step, self.total, losses[-1], tok_s, eta, force=step == self.total)

    def _stats(self) -> dict:
        stats = self.last_stats or {}
        return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in stats.items()}
