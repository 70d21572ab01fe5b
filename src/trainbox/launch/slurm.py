"""`trainbox launch slurm`: an sbatch script, one `trainbox train` launcher per node (torchrun under it) with c10d
rendezvous on the first node, `--signal=USR1@120` (save before the time limit) and `--requeue` (resume after it).

Each node runs the launcher the two-node test runs (tests/test_multinode.py), its node rank Slurm's
$SLURM_NODEID, read where the task runs:

    trainbox train --nproc G --nnodes N --rdzv-endpoint $HEAD_NODE:$RDZV_PORT --rdzv-id $SLURM_JOB_ID
                   --max-restarts 3 RECIPE OVERRIDES... --node-rank $SLURM_NODEID

With --image the step runs in that container through pyxis/enroot (`srun --container-image`);
without, on the nodes' own Python environment. Either way it runs in the folder `launch` was called
from (it holds data/ and runs/; a shared filesystem), whatever folder sbatch is called from.
"""
from __future__ import annotations

import shlex
from string import Template

from trainbox.config import RunConfig
from trainbox.launch.spec import (
    CONFIG_MOUNT,
    RDZV_PORT,
    TORCHRUN_RESTARTS,
    LaunchSpec,
    Rendered,
    job_name,
    literal_quotes_note,
    template,
    train_args,
)

RENDEZVOUS = ["--rdzv-endpoint=$HEAD_NODE:$RDZV_PORT", "--rdzv-id=$SLURM_JOB_ID"]
# each task adds its node rank, which only the task's own environment holds
NODE_RANK = """bash -c 'exec "$@" --node-rank="$SLURM_NODEID"' trainbox"""


def _shell_word(arg: str) -> str:
    """Quote for bash; the rendezvous arguments keep their $VARIABLES expandable."""
    return f'"{arg}"' if arg in RENDEZVOUS else shlex.quote(arg)


def train_command(spec: LaunchSpec) -> list[str]:
    """The launcher's command line on every node, but for the node rank (a config file is read at its absolute
    path: the cluster's shared filesystem; inside a pyxis container it is mounted like in the other targets)."""
    recipe = str(spec.config_file) if spec.config_file and not spec.image else None
    train = train_args(spec, recipe)
    nodes = [f"--nnodes={spec.nodes}", *RENDEZVOUS] if spec.nodes > 1 else []
    return ["trainbox", train[0], f"--nproc={spec.procs}", *nodes, f"--max-restarts={TORCHRUN_RESTARTS}", *train[1:]]


def render_slurm(spec: LaunchSpec, cfg: RunConfig) -> Rendered:
    name = job_name(cfg)
    script = f"{name}.sbatch"
    directives = [f"#SBATCH --{k}={v}" for k, v in (("partition", spec.partition), ("account", spec.account)) if v]
    if spec.gpus_per_node:
        directives.insert(0, f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    srun_flags = ""
    # compile caches on the shared filesystem: every node and every requeue reuses compiled kernels
    cache = spec.project_dir / ".trainbox-cache"
    exports = [f"mkdir -p {shlex.quote(str(cache / 'compile'))} {shlex.quote(str(cache / 'huggingface'))}"]
    if spec.image:
        mounts = (f"{spec.project_dir}/data:/workspace/data:ro,{spec.project_dir}/runs:/workspace/runs,"
                  f"{cache}/compile:/cache/compile,{cache}/huggingface:/cache/huggingface")
        if spec.config_file:
            mounts += f",{spec.config_file}:{CONFIG_MOUNT}/{spec.config_file.name}:ro"
        srun_flags = (f'--container-image={shlex.quote(spec.image)} --container-mounts="{mounts}" '
                      "--container-workdir=/workspace ")
    else:
        exports += [f"export TORCHINDUCTOR_CACHE_DIR={shlex.quote(str(cache / 'compile' / 'inductor'))}",
                    f"export TRITON_CACHE_DIR={shlex.quote(str(cache / 'compile' / 'triton'))}",
                    f"export HF_HOME=\"${{HF_HOME:-{cache / 'huggingface'}}}\""]
    status = spec.project_dir / cfg.run.dir / cfg.run_name / "status.json"
    command = train_command(spec)
    text = Template(template("sbatch.sh")).substitute(
        run_name=cfg.run_name, job_name=name, script=script, nodes=spec.nodes, gpus=spec.gpus_per_node,
        cpus=spec.cpus, time=spec.time, extra_directives="\n".join(directives),
        workdir=shlex.quote(str(spec.project_dir)), workdir_raw=spec.project_dir, exports="\n".join(exports),
        rdzv_port=RDZV_PORT, node_rank=f"{NODE_RANK} " if spec.nodes > 1 else "",
        train_command="\n".join(f"    {_shell_word(a)}" for a in command), train_note="".join(
            f"{line}\n" for line in literal_quotes_note([a for a in command if a not in RENDEZVOUS])),
        srun_flags=srun_flags, status_file=shlex.quote(str(status)))
    return Rendered(files={script: text}, apply=[["sbatch", script]],
                    notes=[f"logs: {spec.project_dir}/slurm-{name}-<jobid>.out; the run directory: {status.parent}"])
