"""`trainbox launch slurm`: an sbatch script, one `srun torchrun` per node with c10d rendezvous on the
first node, `--signal=USR1@120` (save before the time limit) and `--requeue` (resume after it).

With --image the step runs in that container through pyxis/enroot (`srun --container-image`);
without, on the nodes' own Python environment, from the directory the job was submitted from.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from string import Template

from trainbox.config import RunConfig, recipe_names
from trainbox.launch.spec import RDZV_PORT, LaunchSpec, Rendered, job_name, template, torchrun_args

RENDEZVOUS = ["--rdzv-backend=c10d", "--rdzv-endpoint=$HEAD_NODE:$RDZV_PORT", "--rdzv-id=$SLURM_JOB_ID"]


def _shell_word(arg: str) -> str:
    """Quote for bash; the rendezvous arguments keep their $VARIABLES expandable."""
    return f'"{arg}"' if arg in RENDEZVOUS else shlex.quote(arg)


def train_command(spec: LaunchSpec) -> list[str]:
    """The torchrun command line each node runs (file recipes become absolute: a shared filesystem)."""
    if spec.recipe and spec.recipe not in recipe_names():
        spec = LaunchSpec(**{**spec.__dict__, "recipe": str(Path(spec.recipe).resolve())})
    return torchrun_args(spec, RENDEZVOUS, always=True)


def render_slurm(spec: LaunchSpec, cfg: RunConfig) -> Rendered:
    name = job_name(cfg)
    script = f"{name}.sbatch"
    directives = [f"#SBATCH --{k}={v}" for k, v in (("partition", spec.partition), ("account", spec.account)) if v]
    if spec.gpus_per_node:
        directives.insert(0, f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    srun_flags = ""
    if spec.image:
        mounts = "$PWD/data:/workspace/data:ro,$PWD/runs:/workspace/runs"
        srun_flags = (f'--container-image={shlex.quote(spec.image)} --container-mounts="{mounts}" '
                      "--container-workdir=/workspace ")
    status = Path(cfg.run.dir) / cfg.run_name / "status.json"
    text = Template(template("sbatch.sh")).substitute(
        run_name=cfg.run_name, job_name=name, script=script, nodes=spec.nodes, gpus=spec.gpus_per_node,
        cpus=spec.cpus, time=spec.time, extra_directives="\n".join(directives),
        workdir='"${SLURM_SUBMIT_DIR:-$PWD}"', exports="", rdzv_port=RDZV_PORT,
        train_command="\n".join(f"    {_shell_word(a)}" for a in train_command(spec)),
        srun_flags=srun_flags, status_file=shlex.quote(str(status)))
    return Rendered(files={script: text}, apply=[["sbatch", script]],
                    notes=[f"logs: slurm-{name}-<jobid>.out; the run directory: {status.parent}"])
