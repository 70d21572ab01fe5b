"""`trainbox launch sky`: a SkyPilot task YAML (task.yaml) for `sky jobs launch` (a managed job: SkyPilot brings a
preempted cluster back) or `sky launch`.

- `resources`: the accelerators (`--gpus H100:8`), `--region`, the image (`image_id: docker:IMAGE`; with
  `--registries FILE` the region's registry) and `job_recovery` (a managed job also restarts after a failure that
  is not a preemption, up to RESTARTS times).
- `num_nodes`; `file_mounts`: the run directory on a bucket (`--bucket`, `--store`), mounted at RUNS_MOUNT in
  MOUNT_CACHED mode (written locally, uploaded in the background: SkyPilot's mode for checkpoints, which takes
  the appends and random writes that MOUNT does not), so a cluster that replaces a preempted one finds the run's
  checkpoints and resumes from the newest (run.resume=auto); a config-file recipe is copied to /etc/trainbox/ as
  in the other targets.
- `setup`: without an image, `pip install "$TRAINBOX_INSTALL"` (envs: this version of trainbox by default; `sky
  jobs launch --env TRAINBOX_INSTALL=...` installs another, e.g. a git URL); the image already holds trainbox.
- `run`: on every node the launcher the two-node test runs (tests/test_multinode.py runs this very script), with
  SkyPilot's node variables; node 0 (the first of $SKYPILOT_NODE_IPS) hosts the c10d rendezvous and rank 0:

      trainbox train --nproc $SKYPILOT_NUM_GPUS_PER_NODE --nnodes $SKYPILOT_NUM_NODES --node-rank $SKYPILOT_NODE_RANK
                     --rdzv-endpoint $HEAD_IP:$TRAINBOX_RDZV_PORT --max-restarts 3 RECIPE run.dir=$TRAINBOX_RUNS
                     OVERRIDES...

($TRAINBOX_RUNS and $TRAINBOX_RDZV_PORT are the task's envs: the bucket's mount point and 29500; `--env` changes
them.)

The YAML is checked offline against SkyPilot's task schema (tests/test_deploy_sky.py).
"""
from __future__ import annotations

import shlex

import yaml

from trainbox import __version__
from trainbox.config import RunConfig
from trainbox.errors import ConfigError
from trainbox.launch.spec import (
    CONFIG_MOUNT,
    MONITOR_PORT,
    RDZV_PORT,
    TORCHRUN_RESTARTS,
    LaunchSpec,
    Rendered,
    job_name,
    literal_quotes_note,
)

RUNS_MOUNT = "/trainbox/runs"
RESTARTS = 3             # job_recovery.max_restarts_on_errors: failures that are not preemptions
STORES = ("s3", "gcs", "azure", "r2", "ibm", "oci", "nebius", "coreweave")
HEAD = 'HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n1)   # node 0 hosts the rendezvous and rank 0'


def run_lines(spec: LaunchSpec) -> list[str]:
    """The launcher on every node, as shell lines: SkyPilot's variables stay expandable, the rest is quoted."""
    nproc = '"$SKYPILOT_NUM_GPUS_PER_NODE"' if spec.gpus else str(spec.procs)
    recipe = spec.recipe_in_container()
    lines = [f"exec trainbox train --nproc {nproc}"]
    if spec.nodes > 1:
        lines.append(f'--nnodes "$SKYPILOT_NUM_NODES" --node-rank "$SKYPILOT_NODE_RANK" --rdzv-endpoint '
                     f'"$HEAD_IP:$TRAINBOX_RDZV_PORT" --max-restarts {TORCHRUN_RESTARTS}')
    words = [*([recipe] if recipe else []), *spec.overrides]   # the user's, quoted to reach trainbox as given
    lines.append(" ".join([*([shlex.quote(recipe)] if recipe else []), 'run.dir="$TRAINBOX_RUNS"',
                           *map(shlex.quote, spec.overrides)]))
    return ([HEAD] if spec.nodes > 1 else []) + literal_quotes_note(words) + [" \\\n  ".join(lines)]


def task(spec: LaunchSpec, name: str) -> dict:
    resources: dict = {}
    if spec.gpus:
        resources["accelerators"] = spec.gpus
    if spec.region:
        resources["region"] = spec.region
    if spec.image:
        resources["image_id"] = f"docker:{spec.image}"
    resources["job_recovery"] = {"max_restarts_on_errors": RESTARTS}
    envs = {"TRAINBOX_RUNS": RUNS_MOUNT, **({"TRAINBOX_RDZV_PORT": str(RDZV_PORT)} if spec.nodes > 1 else {})}
    if not spec.image:
        envs["TRAINBOX_INSTALL"] = f"trainbox=={__version__}"
    bucket = {"name": spec.bucket or f"trainbox-{name}", **({"store": spec.store} if spec.store else {}),
              "mode": "MOUNT_CACHED"}
    mounts: dict = {RUNS_MOUNT: bucket}
    if spec.config_file:
        mounts[f"{CONFIG_MOUNT}/{spec.config_file.name}"] = str(spec.config_file)
    doc = {"name": name, "num_nodes": spec.nodes, "resources": resources, "envs": envs, "file_mounts": mounts}
    if not spec.image:
        doc["setup"] = 'set -e\npip install "$TRAINBOX_INSTALL"\n'
    doc["run"] = "\n".join(["set -e", *run_lines(spec)]) + "\n"
    return doc


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, so task.yaml reads like the scripts it holds."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def render_sky(spec: LaunchSpec, cfg: RunConfig) -> Rendered:
    name = job_name(cfg)
    if spec.store is not None and spec.store not in STORES:
        raise ConfigError(f"--store {spec.store}: SkyPilot's stores are {', '.join(STORES)}",
                          hint="or leave --store out: SkyPilot picks the cluster's cloud")
    notes = [f"the run directory lives in bucket {spec.bucket or f'trainbox-{name}'} (bucket names are global: "
             "--bucket sets yours); a replacement cluster resumes from its newest checkpoint",
             f"or without managed recovery: sky launch -c {name} task.yaml; dashboard: ssh -L "
             f"{MONITOR_PORT}:127.0.0.1:{MONITOR_PORT} {name}, then http://127.0.0.1:{MONITOR_PORT}/"]
    return Rendered(files={"task.yaml": yaml.dump(task(spec, name), Dumper=_Dumper, sort_keys=False, width=120)},
                    apply=[["sky", "jobs", "launch", "--yes", "--name", name, "task.yaml"]], notes=notes)
