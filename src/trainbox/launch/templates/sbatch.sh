#!/bin/bash
# trainbox run "${run_name}" on Slurm: ${nodes} node(s) x ${gpus} GPU(s), one `trainbox train` launcher per node.
# Submit with: sbatch ${script}   (or: trainbox launch slurm ... --apply)
#
# Slurm sends SIGUSR1 120 s before the time limit; the launcher forwards it, every rank saves a checkpoint
# at the next step boundary and exits 0; this script then requeues the job, which resumes (run.resume=auto).
#SBATCH --job-name=${job_name}
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=${cpus}
#SBATCH --time=${time}
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=${workdir_raw}/slurm-%x-%j.out
${extra_directives}
set -euo pipefail
cd ${workdir}

export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110
${exports}
# c10d rendezvous on the first node of the allocation
HEAD_NODE="$$(scontrol show hostnames "$$SLURM_JOB_NODELIST" | head -n 1)"
RDZV_PORT=${rdzv_port}
echo "trainbox: job $$SLURM_JOB_ID (restart $${SLURM_RESTART_COUNT:-0}) on $$SLURM_JOB_NODELIST; rendezvous $$HEAD_NODE:$$RDZV_PORT"

${train_note}TRAIN=(
${train_command}
)

rc=0
# each node's task expands its own $$SLURM_NODEID (single quotes on purpose)
# shellcheck disable=SC2016
srun --kill-on-bad-exit=1 --cpu-bind=none ${srun_flags}${node_rank}"$${TRAIN[@]}" || rc=$$?

# Stopped by the time-limit signal (phase "preempted"): requeue; the next start resumes the run.
phase="$$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("phase", ""))' ${status_file} 2>/dev/null || true)"
if [ "$$phase" = preempted ]; then
    echo "trainbox: run stopped at a checkpoint; requeueing job $$SLURM_JOB_ID"
    scontrol requeue "$$SLURM_JOB_ID"
fi
exit "$$rc"
