"""What to launch (LaunchSpec), the exact command lines every target runs, and writing the files."""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from trainbox.config import RunConfig, load_config, recipe_names
from trainbox.errors import ConfigError

MONITOR_PORT = 8080          # inside containers; the images' HEALTHCHECK and the probes use it
RDZV_PORT = 29500
CONFIG_MOUNT = "/etc/trainbox"  # where compose and Kubernetes mount a config-file recipe
# torchrun starts a node's workers again this often after a failure (a lost node ends the others' ranks within
# train.collective_timeout; once every node is back they meet again and resume from the newest checkpoint)
TORCHRUN_RESTARTS = 3


@dataclass
class LaunchSpec:
    """One run on one target. `recipe` and `overrides` are exactly what `trainbox train` takes."""

    target: str                               # compose, k8s, slurm or sky
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    image: str | None = None
    nodes: int = 1
    min_nodes: int | None = None              # k8s: an elastic job that keeps training with min_nodes..nodes
    gpus_per_node: int = 1
    gpu_vendor: str = "nvidia"                # nvidia or amd
    workspace: bool = False                   # k8s: a dev-workspace Pod instead of a PyTorchJob
    api: str = "pytorchjob"                   # k8s: pytorchjob (Kubeflow training operator) or trainer (Trainer v2)
    namespace: str | None = None
    runs_pvc: str = "trainbox-runs"
    data_pvc: str = "trainbox-data"
    storage: str = "100Gi"
    storage_class: str | None = None
    cpus: int = 16
    memory: str = "64Gi"
    shm: str = "16Gi"
    time: str = "24:00:00"                    # slurm wall-clock limit
    partition: str | None = None
    account: str | None = None
    host_port: int = MONITOR_PORT             # compose: published on the host's 127.0.0.1
    project_dir: Path = field(default_factory=Path.cwd)  # holds data/ and runs/ (compose, slurm)
    gpus: str | None = None                   # sky: accelerators per node, NAME[:COUNT] (sets gpus_per_node)
    region: str | None = None                 # sky: the cluster's region
    bucket: str | None = None                 # sky: the bucket that holds the run directory
    store: str | None = None                  # sky: its store (s3, gcs, ...; default: the cluster's cloud)

    def config(self) -> RunConfig:
        """Validate recipe + overrides now, so a typo fails here and not on the cluster."""
        return load_config(self.recipe, self.overrides)

    def check(self) -> RunConfig:
        if self.target not in ("compose", "k8s", "slurm", "sky"):
            raise ConfigError(f"unknown launch target '{self.target}'", hint="use compose, k8s, slurm or sky")
        if self.gpus is not None:
            if self.target != "sky":
                raise ConfigError(f"--gpus is for launch sky (SkyPilot's NAME:COUNT); launch {self.target} takes "
                                  "--gpus-per-node N")
            self.gpus_per_node = gpus_count(self.gpus)
        if self.nodes < 1 or self.gpus_per_node < 0:
            raise ConfigError(f"--nodes must be >= 1 and --gpus-per-node >= 0 (got {self.nodes}, {self.gpus_per_node})")
        if self.target == "compose" and self.nodes != 1:
            raise ConfigError("docker compose runs on one host: --nodes must be 1",
                              hint="use trainbox launch k8s or trainbox launch slurm for several nodes")
        if self.target in ("compose", "k8s") and not self.image:
            raise ConfigError(f"launch {self.target} needs --image (e.g. ghcr.io/me/trainbox:0.1.0-cu130-torch2.11.0)",
                              hint="build one with: trainbox launch image --registry REGISTRY --tag TAG")
        if self.min_nodes is not None and (self.target != "k8s" or not 1 <= self.min_nodes <= self.nodes):
            raise ConfigError(f"--min-nodes {self.min_nodes}: elastic jobs are for k8s, with 1 <= min-nodes <= "
                              f"--nodes ({self.nodes})")
        if self.api not in ("pytorchjob", "trainer"):
            raise ConfigError(f"--api {self.api}: use pytorchjob (kubeflow.org/v1 PyTorchJob) or trainer (Kubeflow "
                              "Trainer v2 TrainJob)")
        if self.api == "trainer" and self.min_nodes is not None:
            raise ConfigError("--min-nodes (an elastic job) is for --api pytorchjob",
                              hint="a TrainJob runs a fixed number of nodes: drop --min-nodes")
        if self.gpu_vendor not in ("nvidia", "amd"):
            raise ConfigError(f"--gpu-vendor must be nvidia or amd (got {self.gpu_vendor})")
        return self.config()

    @property
    def procs(self) -> int:
        return max(self.gpus_per_node, 1)

    @property
    def config_file(self) -> Path | None:
        """The recipe when it is a config file (it travels with the files), None for a shipped recipe."""
        return Path(self.recipe).absolute() if self.recipe and self.recipe not in recipe_names() else None

    def recipe_in_container(self) -> str | None:
        """What the container passes to `trainbox train`: the recipe name, or the mounted config file."""
        return f"{CONFIG_MOUNT}/{self.config_file.name}" if self.config_file else self.recipe


@dataclass
class Rendered:
    """Files to write (name -> text) and the commands that apply them; an argument that names one of
    the files is replaced by its path once written (see `apply_commands`)."""

    files: dict[str, str]
    apply: list[list[str]]
    notes: list[str] = field(default_factory=list)

    def apply_commands(self, out: Path) -> list[list[str]]:
        return [[str(out / a) if a in self.files else a for a in cmd] for cmd in self.apply]

    def notes_at(self, out: Path) -> list[str]:
        """The notes, with each file name in them replaced by its path once written (as in apply_commands)."""
        if not self.files:
            return list(self.notes)
        names = "|".join(re.escape(n) for n in sorted(self.files, key=len, reverse=True))
        word = re.compile(rf"(?<![\w/.-])({names})(?![\w/-]|\.\w)")
        return [word.sub(lambda m: str(out / m.group(1)), note) for note in self.notes]


def gpus_count(gpus: str) -> int:
    """The count of `--gpus NAME[:COUNT]` (SkyPilot's accelerator syntax), or a ConfigError."""
    m = re.fullmatch(r"([A-Za-z][\w.-]*)(?::([0-9]+))?", gpus)
    if not m or int(m.group(2) or 1) < 1:
        raise ConfigError(f"--gpus {gpus}: expected NAME or NAME:COUNT per node, e.g. H100:8 or A100-80GB:4",
                          hint="`sky show-gpus` lists the names")
    return int(m.group(2) or 1)


def job_name(cfg: RunConfig) -> str:
    """A DNS-1123 name (Kubernetes, compose project) from the run name."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.run_name.lower()).strip("-")[:50].strip("-")
    return name or "trainbox"


def literal_dollars(text: str) -> str:
    """`text` for a field that expands `$` references (Compose's $VAR and ${VAR} anywhere in the file, Kubernetes'
    $(VAR) in a container's command and args): each `$` written `$$`, which both read as one literal `$`."""
    return text.replace("$", "$$")


def train_args(spec: LaunchSpec, recipe: str | None = None, expanded: bool = False) -> list[str]:
    """`train RECIPE overrides`; `recipe` replaces the spec's (a path inside the container or on the cluster).
    `expanded`: the target expands `$` references in these arguments, so the recipe's and the overrides' `$` are
    escaped (literal_dollars) and reach trainbox as given."""
    recipe = recipe or spec.recipe_in_container()
    words = [*([recipe] if recipe else []), *spec.overrides]
    return ["train", *(map(literal_dollars, words) if expanded else words)]


def torchrun_args(spec: LaunchSpec, rendezvous: list[str], always: bool = False, recipe: str | None = None,
                  expanded: bool = False) -> list[str]:
    """torchrun for one node; `rendezvous` says how nodes find each other (kept as written: its references are
    meant to expand). One process on one node runs `trainbox train` directly unless `always` (clusters keep
    torchrun: it forwards the stop signals). `expanded`: as for train_args."""
    if spec.nodes == 1 and spec.procs == 1 and not always:
        return train_args(spec, recipe, expanded)
    restarts = [f"--max-restarts={TORCHRUN_RESTARTS}"] if spec.nodes > 1 else []
    return ["torchrun", f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.procs}", *rendezvous, *restarts,
            "-m", "trainbox", *train_args(spec, recipe, expanded)]


def literal_quotes_note(words: list[str]) -> list[str]:
    """Comment lines for a shell command whose `words` are single-quoted (shlex.quote): where one holds a `$` or a
    backquote, shellcheck's SC2016 ("expressions don't expand in single quotes") is off for that command, since
    the quotes are there to keep it literal."""
    if not any("$" in w or "`" in w for w in words):
        return []
    return ["# single quotes keep the $ of a setting literal, as given", "# shellcheck disable=SC2016"]


def template(name: str) -> str:
    return resources.files("trainbox.launch").joinpath("templates", name).read_text()


def yaml_template(name: str) -> dict:
    return yaml.safe_load(template(name))


def dump(*docs: dict) -> str:
    return "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)


def quote(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


MARK = "# written by `trainbox launch`: rendering again replaces this file"


def _marked(text: str) -> str:
    """`text` with MARK as its first comment line (after a #! line)."""
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return f"{first}\n{MARK}\n{rest}"
    return f"{MARK}\n{text}"


def write_rendered(rendered: Rendered, out: Path) -> list[Path]:
    """Write each file atomically (temp name + rename) into `out`, marked as ours (MARK); returns the paths. A file
    of the same name there that `trainbox launch` did not write (no MARK in its first lines) is never replaced:
    ConfigError before anything is written."""
    for name in rendered.files:
        path = out / name
        if path.is_dir() or (path.exists() and MARK not in path.read_text(errors="replace").split("\n", 2)[:2]):
            raise ConfigError(f"--out {out}: {path} exists and was not written by `trainbox launch`, so it is not "
                              "replaced", hint="move it away, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered.files.items():
        path = out / name
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(_marked(text))
        if name.endswith(".sh"):
            os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        paths.append(path)
    return paths
