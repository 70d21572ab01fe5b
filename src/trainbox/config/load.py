"""Loading a RunConfig: recipe name or YAML/JSON file -> dict -> dotted key=value overrides -> validated RunConfig,
with one message per wrong key (the closest valid keys named) before any work starts."""
from __future__ import annotations

import difflib
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainbox.config.hfargs import map_training_arguments
from trainbox.config.schema import LENGTH_KEYS, RunConfig
from trainbox.errors import ConfigError

log = logging.getLogger("trainbox")  # the library logger


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("trainbox.recipes").iterdir() if p.name.endswith(".yaml"))


MAX_CONFIG_NODES = 100_000  # values, lists and mappings in one config file, counted through YAML aliases


def _check_size(data: Any, where: str) -> None:
    """Refuse documents whose aliases expand past MAX_CONFIG_NODES (a YAML "billion laughs" would exhaust
    memory in validation); the walk stops at the limit, so it costs at most that many visits."""
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_NODES:
            raise ConfigError(f"{where} expands to more than {MAX_CONFIG_NODES:,} values (YAML aliases?); "
                              "a run config is a few hundred", hint="write the config without nested aliases")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


class _UniqueKeys(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last one without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:   # before merge keys (<<) bring theirs in, which these may override
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, str) and first.setdefault(key, line) != line:
                    raise _Duplicate(f"line {line}: {key} is given twice in one mapping (first on line "
                                     f"{first[key]})")
        return super().construct_mapping(node, deep)


class _Duplicate(Exception):
    pass


def _load_yaml(text: str, path: Path) -> Any:
    """YAML through _UniqueKeys, its syntax errors naming `path` (PyYAML names a string "<unicode string>")."""
    loader = _UniqueKeys(text)
    loader.name = str(path)   # the name every mark, and so every error, gives
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _unique_pairs(pairs: list) -> dict:
    """json.loads' object_pairs_hook: a key given twice in one object is refused."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set = set()
        twice = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        raise _Duplicate(f"{', '.join(twice)} given twice in one object")
    return out


def _read_file(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs) if path.suffix == ".json" else _load_yaml(text, path)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    except _Duplicate as e:
        raise ConfigError(f"{path}: {e}", hint="keep one of them: only the last would count") from None
    if data is None:
        raise ConfigError(f"{path} is empty", hint="write config sections in it, e.g. `recipe: tiny` and the keys "
                          "to change, or use a recipe by name")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config sections, not {type(data).__name__}")
    _check_size(data, str(path))
    return data


def load_source(source: str | None) -> dict:
    """A recipe name (`tiny`), or a path to a YAML/JSON file. Returns the raw dict.

    A bare name that names a recipe is the recipe, even where a file or folder of that name is here (a file is
    then read when written as a path, `./tiny`). A file's `recipe: NAME` names the recipe its sections apply over,
    key by key as command-line overrides would; a file without one starts from the defaults and its name is the
    run's name unless it sets run.name."""
    source = source or "tiny"
    path = Path(source)
    if source in recipe_names():
        if path.is_file():
            log.warning(f"{source}: the recipe {source}, not the file {path} here (pass ./{source} for the file)")
        return _recipe(source)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            what = "is a folder, not a config file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {source} {what}", hint=f"recipes: {', '.join(recipe_names())}")
        data = _read_file(path)
        if path.suffix == ".json" and _looks_like_training_arguments(data):
            data = map_training_arguments(data)
        return _over_recipe(data, path)
    close = difflib.get_close_matches(source, recipe_names(), n=3)
    raise ConfigError(f"unknown recipe '{source}'" + (f"; did you mean {', '.join(close)}?" if close else ""),
                      hint=f"recipes: {', '.join(recipe_names())}; or pass a path to a .yaml/.json file")


def _recipe(name: str) -> dict:
    data = yaml.safe_load(resources.files("trainbox.recipes").joinpath(f"{name}.yaml").read_text()) or {}
    data["recipe"] = name
    return data


def _over_recipe(data: dict, path: Path) -> dict:
    """A config file's sections over the recipe its `recipe:` names; a file without one gets its name as run.name
    (made one safe path component) where it sets none."""
    name = data.pop("recipe", None)
    if name is None:
        run = data.setdefault("run", {})
        if isinstance(run, dict) and run.get("name") is None:
            run["name"] = RunConfig.model_construct(recipe=path.stem).run_name
        return data
    if name not in recipe_names():
        close = difflib.get_close_matches(str(name), recipe_names(), n=3)
        raise ConfigError(f"{path}: recipe: {name} names no recipe" + (
            f"; did you mean {', '.join(close)}?" if close else ""),
            hint=f"recipes: {', '.join(recipe_names())}; or remove the recipe: line to start from the defaults")
    return _apply(_recipe(name), list(_leaves(data)), f"{path}: ")


def _leaves(data: dict, prefix: str = ""):
    """(dotted key, value) of every value in `data` that is not a mapping (lists and nulls are values)."""
    for key, value in data.items():
        if isinstance(value, dict):   # an empty section changes nothing
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _looks_like_training_arguments(data: dict) -> bool:
    return bool(data) and not (set(data) & set(RunConfig.model_fields)) and (
        "model_name" in data or "per_device_train_batch_size" in data)


def parse_value(text: str) -> Any:
    """`key=value` values are YAML scalars/lists: 3 -> int, 1e-3 -> float, true -> bool, [a,b] -> list."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    _check_size(value, f"the override value {text[:40]!r}")
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted `key=value` overrides to the source's dict. A run's length is one setting: an override of
    train.max_steps, max_tokens or epochs replaces whichever of them the source set."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value",
                              hint="e.g. trainbox train tiny train.max_steps=50 model.n_layer=2")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), parse_value(value)))
    return _apply(data, pairs, "override ")


def _apply(data: dict, pairs: list[tuple[str, Any]], what: str) -> dict:
    """Set each dotted key of `pairs` in `data` (overrides, or a config file's values over its recipe); `what`
    starts the message of a key that runs into a value."""
    keys = {key for key, _ in pairs}
    if any(f"train.{k}" in keys for k in LENGTH_KEYS) and isinstance(data.get("train"), dict):
        for k in LENGTH_KEYS:
            if f"train.{k}" not in keys:
                data["train"].pop(k, None)
    for key, value in pairs:
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{what}'{key}': '{'.'.join(parts[:i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _fields_at(loc: tuple) -> list[str]:
    model: Any = RunConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _format_error(err: ValidationError) -> str:
    messages = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        key = ".".join(loc) or "config"
        if e["type"] == "extra_forbidden":
            valid = _fields_at(loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=3, cutoff=0.5)
            where = ".".join(loc[:-1])
            msg = f"unknown config key '{key}'"
            if close:
                msg += f"; did you mean {', '.join((where + '.' if where else '') + c for c in close)}?"
            else:
                msg += f"; valid keys{' in ' + where if where else ''}: {', '.join(valid)}"
        elif e["type"] == "value_error":  # our validators' messages name their keys and values
            msg = str(e.get("ctx", {}).get("error") or e["msg"])
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = f"{key}: {e['msg']}{got_s}"
        messages.append(msg)
    return "; ".join(messages)


def build_config(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e), hint="trainbox config schema lists every key") from None


def load_config(source: str | None = None, overrides: list[str] | tuple = ()) -> RunConfig:
    """Recipe name or file, plus dotted overrides -> validated RunConfig."""
    return build_config(apply_overrides(load_source(source), list(overrides)))


SECRET_KEYS = ("monitor.token",)   # config keys whose values no run file records
MASK = "***"


def public_dict(cfg: RunConfig) -> dict:
    """The config as JSON-able data with secrets masked (what config.yaml and checkpoints record)."""
    data = cfg.model_dump(mode="json")
    for key in SECRET_KEYS:
        section, name = key.split(".")
        if data[section].get(name):
            data[section][name] = MASK
    return data


def public_args(args: list[str]) -> list[str]:
    """A command line with the value of each SECRET_KEYS override masked as public_dict masks it (what env.json
    records)."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        out.append(f"{key}={MASK}" if eq and value and key.strip() in SECRET_KEYS else arg)
    return out


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(public_dict(cfg), sort_keys=False)
