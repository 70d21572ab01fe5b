"""Which lm-eval tasks a command names: registry names (and lm-eval's wildcards), task YAML files, and task folders
(`--include-path`), resolved by lm-eval's own TaskManager.

    manager, names = resolve(["hellaswag", "path/to/my_task.yaml"], include=["more_tasks/"])
    kinds = output_types(manager, names)          # {task: "multiple_choice" | "generate_until" | ...}

A task YAML is indexed by adding its folder to the TaskManager's include path (lm-eval's own mechanism, so its
`include:` and `!function` lines work as they do for lm-eval); lm-eval's built-in registry is indexed only when a
name needs it (a command that names only files starts in a second instead of ten). Registry tasks download their
data through `datasets` on first use; a local task reads the files its YAML names.
"""
from __future__ import annotations

import contextlib
import difflib
import io
import logging
from pathlib import Path

import yaml
from lm_eval.api.task import Task
from lm_eval.tasks import TaskManager, get_task_dict

from trainbox.errors import BadInput

SUFFIXES = (".yaml", ".yml")


class _TaskYaml(yaml.SafeLoader):
    """lm-eval's task YAML as plain data: its `!function` tags read as None (only `task` is read here)."""


_TaskYaml.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_file_name(path: Path) -> str:
    """The task (or group) a task YAML defines, or BadInput saying why it defines none."""
    if not path.is_file():
        raise BadInput(f"task file {path} does not exist", hint="name a task YAML that exists, or a task of lm-eval's "
                                                                "registry (lm-eval ls tasks lists them)")
    try:
        config = yaml.load(path.read_text(), Loader=_TaskYaml)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise BadInput(f"task file {path} is not readable YAML: {str(e).splitlines()[0][:300]}") from None
    name = (config or {}).get("task", (config or {}).get("group")) if isinstance(config, dict) else None
    if not isinstance(name, str):
        raise BadInput(f"task file {path} has no `task:` name",
                       hint="a task YAML names its task (`task: my_task`); see lm-eval's docs/new_task_guide.md")
    return name


def resolve(specs: list[str], include: list[str] | tuple = ()) -> tuple[TaskManager, list[str]]:
    """Task names, wildcards and YAML files -> (lm-eval's TaskManager, the task names), or BadInput naming the
    first spec that fails: a task file that is missing or names no task, or tasks neither lm-eval's registry nor
    the given files and folders hold."""
    specs = [s.strip() for s in specs if s.strip()]
    if not specs:
        raise BadInput("no task given", hint="--tasks hellaswag,arc_easy (lm-eval's names) or --tasks my_task.yaml")
    wanted = [task_file_name(Path(s)) if s.endswith(SUFFIXES) else s for s in specs]
    manager = make_manager(specs, include)
    names, unknown = match(manager, wanted)
    if unknown:
        raise unknown_tasks(manager, unknown, bool(include) or any(s.endswith(SUFFIXES) for s in specs))
    return manager, names


def make_manager(specs: list[str], include: list[str] | tuple = ()) -> TaskManager:
    """One TaskManager for `specs`: the folders of their task files and of `include`, and lm-eval's registry when
    a spec is not a file (a readable task file is not required here: `task_file_name` says what is wrong)."""
    folders = []
    for folder in include:
        if not Path(folder).is_dir():
            raise BadInput(f"--include-path {folder} is not a folder", hint="a folder of task YAML files")
        folders.append(str(Path(folder).resolve()))
    folders += [str(Path(s).resolve().parent) for s in specs if s.endswith(SUFFIXES) and Path(s).is_file()]
    registry = any(not s.endswith(SUFFIXES) for s in specs)
    return TaskManager(include_path=sorted(set(folders)) or None, include_defaults=registry)


def match(manager: TaskManager, wanted: list[str]) -> tuple[list[str], list[str]]:
    """-> (the task names `wanted` match, each once; the wanted names that match none)."""
    names, unknown = [], []
    for name in wanted:
        found = manager.match_tasks([name])
        if not found:
            unknown.append(name)
        names += [n for n in found if n not in names]
    return names, unknown


def unknown_tasks(manager: TaskManager, unknown: list[str], files: bool) -> BadInput:
    close = sorted({c for n in unknown for c in difflib.get_close_matches(n, manager.all_tasks, n=3)})
    where = "lm-eval's registry" + (" or the task files given" if files else "")
    return BadInput(f"no task {', '.join(map(repr, unknown))} in {where}",
                    hint=(f"did you mean {', '.join(close)}? " if close else "") +
                    "`lm-eval ls tasks` lists lm-eval's tasks; a task of your own: --tasks path/to/task.yaml "
                    "or --include-path DIR")


def load(manager: TaskManager, name: str) -> dict:
    """lm-eval's task dictionary of one task or group (its data loaded), or BadInput with the reason it fails."""
    try:
        return get_task_dict([name], manager)
    except Exception as e:  # noqa: BLE001 - lm-eval and datasets raise anything: missing files, bad config, offline
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise BadInput(f"task {name} cannot be loaded: {type(e).__name__}: {reason}",
                       hint="a local task needs the data files its YAML names; a registry task downloads its data "
                            "with `datasets` (online, or HF_DATASETS_OFFLINE=1 with the data in its cache)") from None


def output_types(manager: TaskManager, names: list[str]) -> dict[str, str]:
    """{leaf task: its output type} for every named task and group, each loaded once (BadInput where one fails)."""
    kinds: dict[str, str] = {}

    def walk(tree) -> None:
        for key, value in tree.items():
            if isinstance(value, Task):
                kinds[getattr(value.config, "task", None) or str(key)] = value.OUTPUT_TYPE
            elif isinstance(value, dict):
                walk(value)

    for name in names:
        walk(load(manager, name))
    return kinds


@contextlib.contextmanager
def quiet():
    """lm-eval's and datasets' log lines below errors and their progress bars (tqdm, on sys.stderr) kept off the
    console: around the checks before an evaluation, and around a whole evaluation while training."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
