"""Does the monitor slow training? Step time with the monitor off, on, and on with a client polling it.

    PYTHONPATH=src python benchmarks/monitor_overhead.py                       # CPU, small GPT
    PYTHONPATH=src python benchmarks/monitor_overhead.py --device cuda --preset gpu --steps 300
    PYTHONPATH=src python benchmarks/monitor_overhead.py --recipe speedrun-124m --data PREFIX \
        --modes off,polled --steps 40 --warmup 10 --set train.global_batch_size=6

Each trial trains the same model in this process. Modes: "off" (monitor.enabled=false: no HTTP server;
metrics.jsonl is still written, it is how step time is measured), "idle" (the server runs, nobody asks)
and "polled" (a separate process plays a dashboard plus a Prometheus scraper: every --poll-ms it GETs
/health, /status, /history?since=N and /metrics). Trials cycle through the modes (off, polled, off,
polled, ...) so drift in machine load hits all alike. Step time is the median over logged windows after
--warmup steps (from metrics.jsonl timestamps), so an epoch-end checkpoint does not count. The overhead
of each mode is against the first one. Prints one JSON object, then the result record (common.Result: the last
mode measured, the first its baseline); --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

import common

PRESETS = {
    "cpu": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "data.seq_len=128",
            "train.global_batch_size=8", "train.micro_batch_size=8"],
    "gpu": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "data.seq_len=1024",
            "train.global_batch_size=16", "train.micro_batch_size=16"],
}

POLLER = r"""
import json, sys, time, urllib.request
status_path, interval = sys.argv[1], float(sys.argv[2])
while True:  # wait for the run's URL
    try:
        url = json.load(open(status_path)).get("url")
        if url: break
    except (OSError, ValueError): pass
    time.sleep(0.01)
served, since, nxt, lat = 0, 0, time.time(), []
while True:
    try:
        for path, accept in (("/health", "*/*"), ("/status", "*/*"), (f"/history?since={since}", "*/*"),
                             ("/metrics", "text/plain;version=0.0.4")):
            t = time.perf_counter()
            req = urllib.request.Request(url + path, headers={"Accept": accept})
            body = urllib.request.urlopen(req, timeout=5).read()
            lat.append(time.perf_counter() - t)
            if path.startswith("/history"):
                pts = json.loads(body); since = max([since] + [p["step"] for p in pts])
            served += 1
    except Exception:  # the run ended and its server stopped
        break
    nxt += interval
    time.sleep(max(0.0, nxt - time.time()))
lat.sort()
print(json.dumps({"served": served, "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                  "p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else None}))
"""


def trial(recipe: str | None, overrides: list[str], mode: str, poll_s: float, warmup: int) -> dict:
    from trainbox.config import load_config
    from trainbox.train.loop import train

    polled = mode == "polled"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(recipe, [*overrides, f"monitor.enabled={mode != 'off'}", f"run.dir={tmp}", "run.name=bench"])
        poller = None
        if polled:
            poller = subprocess.Popen([sys.executable, "-c", POLLER, str(cfg.run_dir / "status.json"), str(poll_s)],
                                      stdout=subprocess.PIPE, text=True)
        train(cfg)
        served = json.loads(poller.communicate(timeout=60)[0]) if poller else {}
        events = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = [(e["step"], e["time"]) for e in events if e["event"] == "train" and "tokens" in e and e["step"] >= warmup]
    # median over logged windows: a window holding an epoch-end checkpoint does not skew the figure
    per_step = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(ends, ends[1:])]
    return {"step_ms": 1000 * statistics.median(per_step), "client": served}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--recipe", default=None, help="train this recipe instead of a preset (needs --data)")
    ap.add_argument("--data", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides")
    ap.add_argument("--modes", default="off,idle,polled")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--poll-ms", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=3, help="trials per mode")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for training (train.threads)")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    ap.add_argument("--what", help="the record's slug (default: RECIPE-monitor-overhead)")
    args = ap.parse_args()
    import torch

    model = [f"data.path={args.data}"] if args.recipe else [
        *PRESETS[args.preset], "data.tokenizer=embedded:shakespeare-bpe", "optim.warmup_steps=10"]
    overrides = [*model, f"train.device={args.device}", f"train.max_steps={args.steps}", "train.eval_every=0",
                 "train.checkpoint_every=0", "train.sample_tokens=0", "train.eval_tokens=4096",
                 f"monitor.log_every={args.log_every}", "monitor.port=0", "monitor.progress=lines",
                 *([f"train.threads={args.threads}"] if args.threads else []), *args.set]
    modes = args.modes.split(",")
    steps: dict[str, list[float]] = {m: [] for m in modes}
    clients = []
    for _ in range(args.rounds):
        for mode in modes:
            r = trial(args.recipe, overrides, mode, args.poll_ms / 1000, args.warmup)
            steps[mode].append(r["step_ms"])
            if r["client"]:
                clients.append(r["client"])
    med = {m: statistics.median(v) for m, v in steps.items()}
    base = med[modes[0]]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    result = {
        "benchmark": "monitor_overhead", "device": device, "torch": torch.__version__,
        "recipe": args.recipe or f"preset {args.preset}", "overrides": overrides, "threads": torch.get_num_threads(),
        "steps": args.steps, "warmup": args.warmup, "poll_ms": args.poll_ms,
        "step_ms": {m: [round(x, 3) for x in v] for m, v in steps.items()},
        "median_step_ms": {m: round(x, 3) for m, x in med.items()}, "client": clients,
        "overhead_pct_vs_" + modes[0]: {m: round(100 * (x - base) / base, 2) for m, x in med.items() if m != modes[0]}}
    print(json.dumps(result, indent=1))
    common.emit(common.Result(
        tool="monitor_overhead", what=args.what or f"{args.recipe or 'preset-' + args.preset}-monitor-overhead",
        gpu=common.gpu_info() if device != "cpu" else None, software=common.software(), recipe=args.recipe,
        overrides=overrides, metrics={k: v for k, v in result.items() if k not in ("benchmark", "device", "torch")},
        baseline={"name": f"monitor mode {modes[0]}", "command": None,
                  "metrics": {"median_step_ms": round(base, 3), "step_ms": [round(x, 3) for x in steps[modes[0]]]}}),
        args.record)


if __name__ == "__main__":
    main()
