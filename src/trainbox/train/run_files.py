"""The run directory's files at the start of a run (a part of train/loop.py's Trainer): the lock that makes
rank 0 the directory's only writer, config.yaml, env.json and status.json, the monitor server, the sinks, and
the start event and log lines that say what the run is."""
from __future__ import annotations

import os
from dataclasses import asdict

import torch

from trainbox.config import dump_yaml, public_dict
from trainbox.data.loader import unused_data
from trainbox.errors import RunBusy, TrainboxError
from trainbox.files import atomic_write_text
from trainbox.monitor.console import log
from trainbox.monitor.server import start_server
from trainbox.monitor.sinks import build_sinks
from trainbox.rundir import ranks, runs
from trainbox.rundir.lock import lock_run
from trainbox.train import resume
from trainbox.train.device import peak_flops


class RunFiles:
    """Mixed into Trainer: uses its cfg, dist, run_dir, ckpt_root, resume_from, layout, model, kernels, state
    and data."""

    def _lock_run_dir(self) -> None:
        """Rank 0 holds the run directory for the run's life (RunLock); every rank fails if it cannot."""
        busy = None
        if self.dist.is_main:
            try:
                self.lock = lock_run(self.run_dir)
                ranks.clear(self.run_dir)   # before any rank of this run beats (the vote below orders it)
            except TrainboxError as e:
                busy = e
        if self.dist.any(busy is not None):
            raise busy or RunBusy(f"run directory {self.run_dir} is in use", hint="see rank 0's message")
        prev = self.lock.previous if self.lock else None
        if prev and prev.get("pid") != os.getpid():
            log.info(f"took over the lock of {self.run_dir} left by process {prev.get('pid')} on "
                     f"{prev.get('host')}, which is gone")

    def _setup_run_files(self, trainer_state: dict) -> None:
        cfg, d = self.cfg, self.dist
        self.server = None
        if d.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            moved = resume.supersede(self.run_dir, self.ckpt_root, self.resume_from,
                                     end_again=self.end_again is not None)
            if moved is not None:
                log.info(f"the earlier history of {self.run_dir} after this start moved to {moved}")
            atomic_write_text(self.run_dir / "config.yaml", dump_yaml(cfg), fsync=False)
            runs.write_env(self.run_dir, self.argv, self.device, d.world, kernels=self.kernels.as_dict(),
                           layout=asdict(self.layout))
            gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
            self.state.update(step=self.start_step, tokens_seen=self.tokens_seen, gpu_name=gpu,
                              gpu_count=d.world if gpu else 0, cuda_available=torch.cuda.is_available(),
                              resumed_from=str(self.resume_from) if self.resume_from else None,
                              restarts=trainer_state.get("restarts", -1) + 1 if trainer_state else 0,
                              epoch=self.start_step // self.batches.steps_per_epoch)
            if cfg.monitor.enabled:
                self.server = start_server(self.state, cfg.monitor)
                self.state.update(url=self.server.url)
            self.state.write_status(self.run_dir / "status.json")
        self.sinks = build_sinks(cfg.monitor, self.run_dir, cfg.run_name, public_dict(cfg),
                                 trainer_state.get("wandb_id"), d.is_main)
        self.flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        self.peak = peak_flops(cfg, self.device)
        n = sum(p.numel() for p in self.model.parameters())
        log.info(f"run {cfg.run_name}: {cfg.model.family} model, {n / 1e6:.2f}M parameters, device {self.device} "
                 f"({str(self.dtype).replace('torch.', '')}), {d.world} process(es)")
        log.info(f"data: {self.train_data.num_tokens:,} train tokens, {self.train_data.num_samples:,} samples of "
                 f"{cfg.data.seq_len}; global batch {cfg.train.global_batch_size} = {cfg.train.micro_batch_size} "
                 f"x {self.batches.accum} accum x {d.world}; {self.batches.steps_per_epoch} steps/epoch, "
                 f"{self.total} steps")
        tails, skipped, unused = unused_data(self.train_data, cfg.train.global_batch_size)
        if unused:
            log.info(unused)
        log.info(f"kernels: {self.kernels.describe()}")
        if d.enabled:
            log.info(f"process group: {d.describe()}")
            log.info(f"{self.parallel.name} mesh: " + " x ".join(f"{k} {v}" for k, v in self.parallel.mesh_dims.items())
                     + f" ({d.world // d.local_world} node(s) of {d.local_world})")
        if self.resume_from is not None:
            log.info(f"resuming from {self.resume_from} at step {self.start_step}")
        elif self.init_source is not None:
            log.info(f"starting from the weights of {self.init_source} (run.init_from={cfg.run.init_from})")
        for key, (old, new) in self.changed.items():
            log.info(f"changed since the checkpoint, applied from step {self.start_step}: {key} {old!r} -> {new!r}")
        self.sinks.log("start", step=self.start_step, total_steps=self.total, resumed_from=str(self.resume_from or ""),
                       world=d.world, params=n, unused_tail_tokens=tails, unused_samples_per_epoch=skipped,
                       flops_per_token=self.flops_per_token, peak_flops=self.peak, parallel=self.parallel.name,
                       mesh=self.parallel.mesh_dims,
                       kernels=self.kernels.as_dict(), layout=asdict(self.layout),
                       **({"examples": self.train_data.report} if hasattr(self.train_data, "report") else {}),
                       **({"changed": {k: list(v) for k, v in self.changed.items()}} if self.changed else {}))
