"""`trainbox config`: every key (schema), a recipe's values (show), and every check `train` makes (validate)."""
from __future__ import annotations

import json
import sys

from trainbox.config import RunConfig, dump_yaml, load_config
from trainbox.config.describe import describe_keys
from trainbox.config.layout import micro_batch_given


def cmd_config(args) -> int:
    if args.action == "schema":
        if args.json:
            print(json.dumps(RunConfig.model_json_schema(), indent=1))
        else:
            _print_keys()
        return 0
    cfg = load_config(args.source, args.overrides)
    if args.action == "show":
        print(dump_yaml(cfg), end="")
        return 0
    # every check `trainbox train` makes before any work, on this machine, for a run on --nproc processes
    from trainbox.train.preflight import preflight  # heavy: torch
    checked = preflight(cfg, args.nproc, adapt_micro_batch=not micro_batch_given(args.overrides))
    note = checked.layout.note(cfg)
    if note:
        print(note, file=sys.stderr)
    print(f"{args.source or 'tiny'}: valid ({checked.layout.describe()})")
    return 0


def _print_keys() -> None:
    """`config schema`: one line per key (dotted name, type, default, description), grouped by section."""

    rows = describe_keys()
    kw = max(len(r[0]) for r in rows)
    tw = min(32, max(len(r[1]) for r in rows))
    dw = min(24, max(len(r[2]) for r in rows))
    print("every config key: set one with a dotted override (trainbox train tiny train.max_steps=50) or in a "
          "recipe file;\n`trainbox config show RECIPE` prints a recipe's values, --json the JSON Schema")
    section = None
    for key, type_s, default, desc in rows:
        top = key.split(".")[0] if "." in key else ""
        if top != section:
            section = top
            print(f"\n{top or 'top level'}:")
        print(f"  {key:<{kw}}  {type_s:<{tw}}  = {default:<{dw}}  {desc}".rstrip())
