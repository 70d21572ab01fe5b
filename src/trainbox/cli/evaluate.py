"""`trainbox eval`: lm-eval tasks on a run, a checkpoint or a Hugging Face folder (eval/harness.py); prints lm-eval's
table and where the record was written."""
from __future__ import annotations

import sys


def cmd_eval(args) -> int:
    from trainbox.eval.harness import evaluate  # heavy: torch

    report = evaluate(args.path, args.tasks.split(","), include=args.include_path or [], limit=args.limit,
                      batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                      num_fewshot=args.num_fewshot, out=args.out)
    print(report.table)
    info = report.results["trainbox"]
    step = f" at step {info['step']}" if info.get("step") is not None else ""
    print(f"wrote {report.path} ({info['model']}{step}, {info['device']} {info['dtype']}, {info['seconds']:.1f}s)",
          file=sys.stderr)
    return 0
