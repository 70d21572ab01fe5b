"""The rules docs/architecture.md states about the code's structure, checked:

- the layers hold: `lint-imports` (import-linter, contracts in pyproject.toml) finds no upward import and no import
  cycle between the modules of a package;
- nothing outside model/ compares a family's name: it asks the family object;
- an import inside a function is for an optional dependency or a heavy one (it says which in a comment, and the
  check verifies the claim: an optional package is not a core dependency or is probed under `except ImportError`;
  a heavy import loads torch, numpy, matplotlib, transformers or jinja2, or one of torch's heavy packages, that the
  importing module does not);
- a family defined outside src/ (tests/toy_family.py) trains, plans and exports with no change under src/.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from conftest import REPO, run_check_script

from trainbox.model.spec import families

SRC = REPO / "src"
HEAVY = {"torch", "numpy", "matplotlib", "transformers", "jinja2",
         "pydantic",  # with the config schema's models built on it, 0.15 s: verbs that read no config skip it
         # torch's packages that a process building no optimizer (generate, export, config validate, a --nproc
         # launcher) need not load: Dynamo, FSDP, DTensor, distributed checkpoints, each most of a second with what it
         # imports (sympy). Any torch.optim optimizer imports Dynamo, and Dynamo the others, so a training process
         # loads them all.
         "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"}
LIGHT_NEXT_TO_TORCH = {"numpy", "jinja2"}   # next to torch's 1.7 s, these do not justify a lazy import


def _heavy_names(name: str) -> set[str]:
    """The heavy packages importing `name` loads: each of HEAVY that is `name` or a package above it."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & HEAVY


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "trainbox").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def _top_level_imports(module: str) -> set[str]:
    """What `module` imports when it is imported (module level, not under TYPE_CHECKING), with the packages above
    each name and above the module itself."""
    names = set()
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.Import):
                names |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names |= {n.module, *(f"{n.module}.{a.name}" for a in n.names)}
    parts = module.split(".")
    return names | {".".join(parts[:i]) for i in range(1, len(parts))}


def _heavy(module: str, seen: set[str] | None = None) -> set[str]:
    """The heavy packages importing `module` loads."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    out = set()
    for name in _top_level_imports(module):
        top = name.split(".")[0]
        if top in HEAVY:
            out |= _heavy_names(name)
        elif top == "trainbox" and (target := _resolve(name)) and target != module:
            out |= _heavy(target, seen)
    return out


def _core_packages() -> set[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ;]", d)[0].lower().replace("-", "_") for d in deps}
    return names | {"yaml" if n == "pyyaml" else n for n in names}


def test_the_layers_hold():
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                           "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Contracts: 2 kept, 0 broken" in proc.stdout, proc.stdout + proc.stderr


def test_nothing_outside_model_compares_family_names():
    """A comparison of an expression about a family (`cfg.model.family`, `spec.name`) with a family's name, or a
    tuple of them, anywhere in src/trainbox but model/."""
    names = set(families())
    found = []
    for module, path in MODULES.items():
        if module.startswith("trainbox.model"):
            continue
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = [s for s in sides if isinstance(s, ast.Constant) and s.value in names]
            consts += [s for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) and s.elts
                       and all(isinstance(e, ast.Constant) and e.value in names for e in s.elts)]
            if not consts:   # get_source_segment splits the file each call: only for the candidates
                continue
            others = " ".join(ast.get_source_segment(src, s) or "" for s in sides if s not in consts)
            if "family" in others or others.endswith(".name"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.get_source_segment(src, node)}")
    assert not found, "family names compared outside model/ (ask the family object):\n" + "\n".join(found)


def test_imports_inside_functions_are_for_optional_or_heavy_dependencies():
    core = _core_packages()
    wrong = []
    for module, path in sorted(MODULES.items()):
        src = path.read_text()
        lines = src.splitlines()
        tree = ast.parse(src)
        probes = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in t.body}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                comment = lines[node.end_lineno - 1].partition("#")[2]
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                top = names[0].split(".")[0]
                if "optional:" in comment:
                    if top.lower() in core and id(node) not in probes:
                        wrong.append(f"{where}: {top} is a core dependency, not optional")
                elif "heavy:" in comment:
                    if top == "trainbox":
                        target = max((_resolve(n) for n in names), key=lambda m: m.count("."))
                        gain = _heavy(target) - _heavy(module)
                    else:
                        gain = set().union(*map(_heavy_names, names)) - _heavy(module)
                    if "torch" in _heavy(module):
                        gain -= LIGHT_NEXT_TO_TORCH
                    if not gain:
                        wrong.append(f"{where}: says heavy, but {module} already loads what {names[0]} does")
                else:
                    wrong.append(f"{where}: {lines[node.lineno - 1].strip()} (no `# optional:` or `# heavy:`)")
    assert not wrong, "imports inside functions that should be at the top of their module:\n" + "\n".join(wrong)


TOY = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
import toy_family
from trainbox.config import load_config
from trainbox.export import export
from trainbox.model.load import load_for_inference
from trainbox.model.spec import register
from trainbox.plan import local_cpu, make_plan, run_vocab
from trainbox.train.loop import train

register(toy_family.FAMILY)
root = Path(sys.argv[1])
cfg = load_config("tiny", ["model.family=toy", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                           "data.tokenizer=embedded:shakespeare-bpe", "data.seq_len=32", "train.global_batch_size=8",
                           "train.micro_batch_size=4", "train.max_steps=30", "train.eval_every=0",
                           "train.eval_tokens=1024", "train.sample_tokens=0", "monitor.enabled=false",
                           f"run.dir={root}", "run.name=toy",
                           f"data.cache_dir={root / 'cache'}", "optim.lr=3e-3", "optim.warmup_steps=0"])
result = train(cfg)
losses = [json.loads(x)["loss"] for x in (root / "toy" / "metrics.jsonl").read_text().splitlines()
          if json.loads(x)["event"] == "train"]
assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]) - 1.0, losses   # it learns
plan = make_plan(cfg, run_vocab(cfg), local_cpu(), 1)
assert plan.activations.blocks > 0 and plan.counts.n_blocks == 2, plan
lines = export(root / "toy", root / "toy-out")
model, _, _ = load_for_inference(root / "toy")
exported = load_file(str(root / "toy-out" / "model.safetensors"))
assert lines and set(exported) == set(model.state_dict())
assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
print("ok")
"""


def test_a_family_defined_in_tests_trains_plans_and_exports(tmp_path):
    path = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))   # this tree's src
    run_check_script(TOY.replace("sys.argv[1]", repr(str(tmp_path))), env={"PYTHONPATH": path})



def test_every_family_is_known_whichever_family_module_a_program_imports_first():
    """A program whose first trainbox import is a family's package or its config (`import trainbox.model.llama`) still
    sees every family: the config's model section, assembled from them as trainbox.config loads, has each one's
    section and validates model.family=<it> with its options."""
    names = sorted(families())
    script = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
              "from trainbox.model.spec import families; from trainbox.config import build_config; "
              "print(sorted(families())); [build_config({'model': {'family': n}}) for n in families()]; "
              "build_config({'model': {'family': 'llama', 'llama': {'rope_theta': 10000.0}}})")
    first = [f"trainbox.model.{n}" for n in names] + [f"trainbox.model.{n}.config" for n in names
                                                     if (SRC / "trainbox/model" / n / "config.py").exists()]
    for module in first:
        out = subprocess.run([sys.executable, "-c", script, module], capture_output=True, text=True, check=False)
        assert out.returncode == 0 and out.stdout.split("\n")[0] == str(names), (module, out.stderr[-800:])
