"""The exact commands the images and manifests run, executed for real outside a container: the
entrypoint with a rendered compose command (SIGTERM -> checkpoint -> exit 0 -> resume), the PyTorchJob
container arguments under torchrun (2 processes, gloo) with the variables the training operator sets, and
the sbatch script's launcher line on one node (two nodes: tests/test_multinode.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY

from trainbox.launch import LaunchSpec, render

# the stop tests log at the tiny recipe's own interval (20 steps): a stop falls between two log lines
OWN = [o for o in TINY if not o.startswith("monitor.log_every")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def bin_dir(tmp_path):
    """`trainbox` on PATH as the package's console script provides it (this interpreter, this source)."""
    d = tmp_path / "bin"
    d.mkdir()
    script = d / "trainbox"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -m trainbox "$@"\n')
    script.chmod(0o755)
    return d


def container_env(tmp_path, bin_dir, extra: dict | None = None) -> dict:
    """The image's ENV (caches on 'volumes', TRAINBOX_OVERRIDES, torchrun signal settings), here in tmp_path."""
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
            "HF_HOME": str(tmp_path / "cache/huggingface"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache/compile/inductor"),
            "TRITON_CACHE_DIR": str(tmp_path / "cache/compile/triton"),
            "TRAINBOX_OVERRIDES": "monitor.host=0.0.0.0",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "OMP_NUM_THREADS": "1",
            **(extra or {})}


def run_launcher(cmd: list[str], cwd, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a launcher line (torchrun inside) to its end. On a timeout, fail with its output so far and the
    trainbox/torchrun processes still alive (which of agent and workers hung), after killing its group."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ps = subprocess.run(["ps", "-e", "--forest", "-o", "pid,ppid,sid,etime,stat,args"], capture_output=True,
                            text=True).stdout
        alive = "\n".join(line for line in ps.splitlines() if "trainbox" in line or "torchrun" in line)
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a worker outside the group still holds the pipes
            out, err = "", ""
        pytest.fail(f"{cmd[:3]} still running after {timeout} s; live processes:\n{alive}\n"
                    f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def status(run_dir) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_entrypoint_runs_compose_command_stops_on_sigterm_and_resumes(tmp_path, bin_dir, data_cache):
    overrides = [*OWN, f"data.cache_dir={data_cache}", "train.max_steps=100", "train.checkpoint_every=0",
                 "train.eval_every=0", "run.name=c"]
    compose = yaml.safe_load(render(LaunchSpec("compose", "tiny", overrides, image="i", gpus_per_node=1))
                             .files["compose.yaml"])
    command = compose["services"]["trainbox"]["command"]
    assert command == ["train", "tiny", *overrides]
    work = tmp_path / "workspace"
    work.mkdir()
    env = container_env(tmp_path, bin_dir)
    entry = [str(REPO / "docker" / "entrypoint.sh"), *command]
    proc = subprocess.Popen(entry, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = work / "runs" / "c"
    deadline = time.time() + 120
    while status(run_dir).get("step", 0) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what tini forwards on docker stop
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    st = status(run_dir)
    stopped_at = st["step"]
    assert st["phase"] == "preempted" and 3 <= stopped_at < 100, out
    assert (run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "COMPLETE").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["monitor"]["host"] == "0.0.0.0"
    # a restart (restart: on-failure, or docker compose up again) resumes and finishes
    done = subprocess.run(entry, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming from" in (run_dir / "train.log").read_text()
    assert status(run_dir)["phase"] == "finished" and status(run_dir)["step"] == 100


def test_entrypoint_passes_programs_through_and_reports_unwritable_runs(tmp_path, bin_dir):
    env = container_env(tmp_path, bin_dir)
    out = subprocess.run([str(REPO / "docker" / "entrypoint.sh"), "python", "-c", "print('hi')"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "hi\n"
    # the image's user (uid 1000) facing a root-owned runs folder bind-mounted from the host
    as_user: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot act as uid 1000")
        as_user = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    work = Path(tempfile.mkdtemp(prefix="tb-entry-", dir="/tmp"))
    try:
        os.chmod(work, 0o755)
        (work / "runs").mkdir(mode=0o555)
        os.chmod(work / "runs", 0o555)
        caches = {k: str(work / "caches" / k) for k in ("HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        os.makedirs(work / "caches", mode=0o555)
        os.chmod(work / "caches", 0o555)
        shutil.copy(REPO / "docker" / "entrypoint.sh", work / "entrypoint.sh")
        bad = subprocess.run([*as_user, "bash", str(work / "entrypoint.sh"), "train", "tiny"], cwd=work,
                             env={"PATH": "/usr/bin:/bin", **caches}, capture_output=True, text=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert bad.returncode == 1, bad.stderr
    assert f"run directory {work}/runs is not writable by uid" in bad.stderr and "chown" in bad.stderr
    # unwritable caches fall back to temporary ones, with a warning saying how to keep them
    assert "TORCHINDUCTOR_CACHE_DIR=" in bad.stderr and "using /tmp/trainbox-torchinductor_cache_dir." in bad.stderr


def _k8s_expand(arg: str, env: dict) -> str:
    """Kubernetes' expansion of a container's command and args (its third_party/forked/golang/expansion): `$(VAR)` of
    a set variable is its value, `$$` is one `$`, any other `$` and what follows it stay."""
    out, i = [], 0
    while i < len(arg):
        end = arg.find(")", i + 2) if arg.startswith("$(", i) else -1
        if end != -1:
            out.append(env.get(arg[i + 2:end], arg[i:end + 1]))
            i = end + 1
        elif arg.startswith("$$", i):
            out.append("$")
            i += 2
        else:
            step = 2 if arg[i] == "$" else 1
            out.append(arg[i:i + step])
            i += step
    return "".join(out)


@pytest.mark.parametrize("elastic", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["static", "elastic"])
def test_pytorchjob_args_train_under_torchrun(tmp_path, bin_dir, data_cache, elastic):
    """The first pod's container args, with the variables the training operator sets for it."""
    overrides = [*TINY, f"data.cache_dir={data_cache}", "train.max_steps=4", "run.dir=runs", "run.name=k"]
    spec = LaunchSpec("k8s", "tiny", overrides, image="i", nodes=1, gpus_per_node=2, min_nodes=1 if elastic else None)
    job = yaml.safe_load(render(spec).files["pytorchjob.yaml"])
    role = "Worker" if elastic else "Master"
    [c] = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"]
    port = str(free_port())
    operator_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1",
                    "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "PET_NNODES": "1", "PET_NODE_RANK": "0"}
    if elastic:
        policy = job["spec"]["elasticPolicy"]
        operator_env.update({"PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                             "PET_RDZV_BACKEND": policy["rdzvBackend"], "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
                             "PET_MAX_RESTARTS": str(policy["maxRestarts"])})
    args = [_k8s_expand(a, operator_env) for a in c["args"]]
    env = container_env(tmp_path, bin_dir, {e["name"]: e["value"] for e in c["env"] if e["name"] != "HF_HOME"
                                            and not e["value"].startswith("/cache")})
    env.update(operator_env)
    out = run_launcher([str(REPO / "docker" / "entrypoint.sh"), *args], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "k"
    assert json.loads((run_dir / "env.json").read_text())["world_size"] == 2
    assert status(run_dir)["phase"] == "finished" and status(run_dir)["step"] == 4


def test_sbatch_launcher_line_trains_on_one_node(tmp_path, data_cache):
    overrides = [*TINY, f"data.cache_dir={data_cache}", "train.max_steps=4", "run.dir=runs", "run.name=s"]
    [script] = render(LaunchSpec("slurm", "tiny", overrides, nodes=1, gpus_per_node=1)).files.values()
    block = re.search(r"^TRAIN=\(\n.*?^\)\n", script, re.M | re.S).group(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HEAD_NODE": "127.0.0.1", "RDZV_PORT": str(free_port()),
           "SLURM_JOB_ID": "4242", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    # trainbox comes from this interpreter's environment, as on a node with trainbox installed
    out = run_launcher(["bash", "-c", f'set -euo pipefail\n{block}"${{TRAIN[@]}}"'], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "s"
    assert json.loads((run_dir / "env.json").read_text())["world_size"] == 1
    assert status(run_dir)["step"] == 4


@pytest.mark.slow
def test_nproc_parent_forwards_sigterm_to_torchrun(tmp_path, bin_dir, data_cache):
    """`trainbox train --nproc 2` in a container: tini signals only its child (the trainbox CLI), which must
    forward SIGTERM to torchrun so that every rank saves before the container stops."""
    overrides = [*OWN, f"data.cache_dir={data_cache}", "train.max_steps=400", "train.checkpoint_every=0",
                 "train.eval_every=0", "run.dir=runs", "run.name=n"]
    env = container_env(tmp_path, bin_dir)
    proc = subprocess.Popen([str(REPO / "docker" / "entrypoint.sh"), "train", "--nproc", "2", "tiny", *overrides],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "n"
    deadline = time.time() + 180
    while status(run_dir).get("step", 0) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    st = status(run_dir)
    assert st.get("phase") == "preempted" and st["step"] < 400, out[-3000:]
    assert (run_dir / "checkpoints" / f"step_{st['step']:08d}" / "COMPLETE").exists(), out[-3000:]


# ----------------------------------------------------------------------------- a $ in a setting

# an override as a user gives it, with what each target could take for a reference: trainbox must get it unchanged
DOLLAR = "train.sample_prompt=It costs $HOME, ${USER:-me}, $(RANK) and $$"
TARGET_ENV = {"HOME": "/home/u", "USER": "u", "RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29500",
              "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "head",
              "PET_MASTER_PORT": "29500"}


def _compose_interpolate(value: str, env: dict) -> str:
    """Compose's interpolation of a value (the Compose Specification's "Interpolation"; the engine is not installed
    here): `$$` is one `$`; `$VAR`, `${VAR}`, `${VAR:-default}` and `${VAR-default}` are replaced."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        value = env.get(name)
        if m.group(2) == ":-" and not value or m.group(2) == "-" and value is None:
            return m.group(3)
        return value or ""
    return re.sub(r"\$\$|\$\{(\w+)(:?-)?([^}]*)\}|\$([A-Za-z_]\w*)", one, value)


def test_a_dollar_in_an_override_reaches_trainbox_from_compose_and_kubernetes(tmp_path):
    """Compose interpolates $VAR in every value and Kubernetes expands $(VAR) in container args: the rendered files
    pass the validators and, read as those two read them, hand trainbox the override as given (and the host paths
    of the compose volumes as they are), while the operator's $(RANK) and $(PET_*) still expand."""
    from test_deploy_files import compose_check, tool, validate

    from trainbox.launch import write_rendered
    from trainbox.launch.k8s import pod_templates_of
    project = tmp_path / "p$HOME"
    for gpus in (1, 2):
        out = tmp_path / f"compose{gpus}"
        write_rendered(render(LaunchSpec("compose", "tiny", [DOLLAR], image="i:1", gpus_per_node=gpus,
                                         project_dir=project)), out)
        compose_check(out / "compose.yaml")
        svc = yaml.safe_load((out / "compose.yaml").read_text())["services"]["trainbox"]
        assert [_compose_interpolate(a, TARGET_ENV) for a in svc["command"]][-3:] == ["train", "tiny", DOLLAR]
        assert _compose_interpolate(svc["volumes"][1], TARGET_ENV) == f"{project / 'runs'}:/workspace/runs"
    kv = tool("kubernetes-validate")
    for kw in ({}, {"min_nodes": 1}, {"api": "trainer"}):
        files = render(LaunchSpec("k8s", "tiny", [DOLLAR], image="i:1", nodes=2, gpus_per_node=2, **kw)).files
        if "pytorchjob.yaml" in files:
            pods = pod_templates_of(yaml.safe_load(files["pytorchjob.yaml"])).values()
        else:
            [job] = yaml.safe_load(files["runtime.yaml"])["spec"]["template"]["spec"]["replicatedJobs"]
            pods = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "node"},
                     "template": job["template"]["spec"]["template"]}]
        for i, pod in enumerate(pods):
            path = tmp_path / f"pod-{kw}-{i}.yaml"
            path.write_text(yaml.safe_dump(pod))
            validate([kv, "--strict", str(path)])
            [c] = pod["template"]["spec"]["containers"]
            args = [_k8s_expand(a, TARGET_ENV) for a in c["args"]]
            assert "train" in args and args[-2:] == ["tiny", DOLLAR], args
            ranks = " ".join(args).replace("--node-rank 1", "--node-rank=1")   # the trainer's flags take a space
            assert ("--node-rank=1" in ranks) == ("min_nodes" not in kw)   # elastic: torchrun reads PET_* itself


def test_a_dollar_in_an_override_reaches_trainbox_from_slurm_and_skypilot(tmp_path):
    """The sbatch script and SkyPilot's run script single-quote the override: shellcheck passes both (its SC2016
    is off for that one command, with the reason), and bash hands it to trainbox as given."""
    from test_deploy_files import tool, validate

    from trainbox.launch.sky import task
    shellcheck = tool("shellcheck")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "trainbox").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')   # prints the arguments it gets
    (fake / "trainbox").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "HEAD_NODE": "head", "RDZV_PORT": "29500",
           "SLURM_JOB_ID": "7", "TRAINBOX_RUNS": "/runs", "SKYPILOT_NODE_IPS": "10.0.0.1", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NODE_RANK": "1", "TRAINBOX_RDZV_PORT": "29500"}
    [script] = render(LaunchSpec("slurm", "tiny", [DOLLAR], nodes=2, gpus_per_node=2)).files.values()
    (tmp_path / "job.sbatch").write_text(script)
    validate([shellcheck, str(tmp_path / "job.sbatch")])
    block = re.search(r"^TRAIN=\(\n.*?^\)\n", script, re.M | re.S).group(0)
    got = subprocess.run(["bash", "-c", f'set -euo pipefail\n{block}"${{TRAIN[@]}}"'], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert got[-2:] == ["tiny", DOLLAR] and "--rdzv-endpoint=head:29500" in got
    for nodes in (1, 2):
        run = tmp_path / f"run{nodes}.sh"
        run.write_text("#!/usr/bin/env bash\n" + task(LaunchSpec("sky", "tiny", [DOLLAR], nodes=nodes), "t")["run"])
        validate([shellcheck, str(run)])
        got = subprocess.run(["bash", str(run)], env=env, capture_output=True, text=True, check=True).stdout
        assert got.splitlines()[-3:] == ["tiny", "run.dir=/runs", DOLLAR]
