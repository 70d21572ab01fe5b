"""Deployment files checked offline with the real validators (no Docker engine or cluster here):
hadolint on both Dockerfiles, shellcheck on shell scripts, check-jsonschema's Compose spec on compose.yaml
and rendered compose files, kubernetes-validate --strict on core objects and on each PyTorchJob replica's
pod template, and our own strict checks of the PyTorchJob and of the policies the images must follow."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, run_cli

from trainbox.launch import LaunchSpec, render, write_rendered
from trainbox.launch.image import build_commands, dockerfile_args
from trainbox.launch.k8s import pod_templates_of

DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.rocm"]


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (CI installs it: see the deploy notes)")
    return path


def validate(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def rendered(target: str, tmp_path, **kw) -> dict[str, str]:
    spec = LaunchSpec(target=target, recipe=kw.pop("recipe", "gpt2-125m"), image=kw.pop("image", "reg/trainbox:t"),
                      **kw)
    out = render(spec)
    write_rendered(out, tmp_path)   # as `trainbox launch` writes them: the validators read those files
    return {name: (tmp_path / name).read_text() for name in out.files}


# ----------------------------------------------------------------------------- Dockerfiles


def test_hadolint_both_dockerfiles_clean():
    validate([tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), *map(str, DOCKERFILES)])
    # every ignored rule carries a comment that justifies it
    text = (REPO / ".hadolint.yaml").read_text()
    for rule in yaml.safe_load(text).get("ignored", []):
        before = text[:text.index(f"- {rule}")].rstrip().splitlines()[-1]
        assert before.strip().startswith("#"), f"{rule} is ignored without a justification comment"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_policies(dockerfile):
    text = dockerfile.read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    # every version is an ARG with a default
    for name in ("TRAINBOX_VERSION", "TORCH_VERSION", "UID", "GID"):
        assert re.search(rf"^ARG {name}=\S+", text, re.M), name
    assert re.search(r"^ARG (CUDA|ROCM)_VERSION=\S+", text, re.M)
    # dependencies are installed before the code is copied (layer cache)
    deps = text.index("requirements.py /tmp/trainbox/pyproject.toml --extras")
    assert text.index("COPY pyproject.toml") < deps < text.index("COPY src ")
    # non-root uid 1000 owning caches and runs; exec-form healthcheck; tini as init
    assert re.search(r"^USER \$\{UID\}:\$\{GID\}", text, re.M) and "useradd --uid \"${UID}\"" in text
    assert "chown -R trainbox:trainbox /workspace /cache" in text
    health = next(ln for ln in lines if ln.strip().startswith("CMD [\"trainbox\", \"status\""))
    assert health.strip() == 'CMD ["trainbox", "status", "http://127.0.0.1:8080"]'
    assert '["/usr/bin/tini", "--", "/usr/local/bin/trainbox-entrypoint"]' in text
    for var in ("TORCHINDUCTOR_CACHE_DIR=/cache/compile/inductor", "TRITON_CACHE_DIR=/cache/compile/triton",
                "HF_HOME=/cache/huggingface"):
        assert var in text
    assert 'VOLUME ["/workspace/runs", "/cache/compile"]' in text


def test_dockerignore_keeps_context_small():
    lines = (REPO / ".dockerignore").read_text().split()
    assert lines[lines.index("*")] == "*" and {"!pyproject.toml", "!src/", "!docker/"} <= set(lines)


def test_requirements_script_matches_pyproject(tmp_path):
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = subprocess.run([sys.executable, str(REPO / "docker" / "requirements.py"), str(REPO / "pyproject.toml"),
                          "--extras", "hf,tracking", "--exclude", "torch"], capture_output=True, text=True, check=True)
    got = out.stdout.splitlines()
    want = [r for r in project["dependencies"] if not r.startswith("torch")]
    want += [r for e in ("hf", "tracking") for r in project["optional-dependencies"][e] if r not in want]
    assert got == want
    pin = subprocess.run([sys.executable, str(REPO / "docker" / "requirements.py"), "x", "--pin-installed", "torch"],
                         capture_output=True, text=True, check=True).stdout.strip()
    import torch
    assert pin == f"torch=={torch.__version__}"


def test_image_build_commands_spell_the_stack():
    args = dockerfile_args(DOCKERFILES[0])
    [cmd] = build_commands(REPO, ["ghcr.io/me"], "latest", push=True, build_args=["TORCH_VERSION=2.9.0"])
    tags = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--tag"]
    assert tags == [f"ghcr.io/me/trainbox:{args['TRAINBOX_VERSION']}-{args['TORCH_CUDA']}-torch2.9.0",
                    "ghcr.io/me/trainbox:latest"]
    assert cmd[:3] == ["docker", "buildx", "build"] and "--push" in cmd and cmd[-1] == "."
    assert "TORCH_VERSION=2.9.0" in cmd
    rocm = dockerfile_args(DOCKERFILES[1])
    [cmd] = build_commands(REPO, [], None, rocm=True)
    assert f"trainbox:{rocm['TRAINBOX_VERSION']}-rocm{rocm['ROCM_VERSION']}-torch{rocm['TORCH_VERSION']}" in cmd
    assert "docker/Dockerfile.rocm" in cmd and "--load" in cmd


def test_image_stack_is_the_measured_one_everywhere():
    """The Dockerfiles' build arguments are the one place the image stacks are pinned. The CUDA one is the stack of
    the H100 record the doctor cites (torch and its CUDA build, flash-attn-4, quack-kernels) and of pyproject's
    `flash` extra; every image tag written in the docs, compose.yaml and the CLI's messages spells one of the two
    stacks; docs/deploy.md's table states them."""
    import json

    import tomllib

    from trainbox.doctor import FLASH_SPEED
    from trainbox.launch.image import image_tag

    cuda, rocm = dockerfile_args(DOCKERFILES[0]), dockerfile_args(DOCKERFILES[1])
    record = json.loads((REPO / FLASH_SPEED[1]).read_text())
    assert record["torch"] == f"{cuda['TORCH_VERSION']}+{cuda['TORCH_CUDA']}"
    assert cuda["CUDA_VERSION"].startswith(f"{cuda['TORCH_CUDA'][2:4]}.{cuda['TORCH_CUDA'][4:]}.")
    assert record["software"] == {"flash-attn-4": cuda["FLASH_ATTN_4_VERSION"],
                                  "quack-kernels": cuda["QUACK_KERNELS_VERSION"]}
    assert "flash" in cuda["EXTRAS"].split(",")
    flash = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["flash"]
    assert flash == [f"flash-attn-4>={cuda['FLASH_ATTN_4_VERSION']}", f"quack-kernels>={cuda['QUACK_KERNELS_VERSION']}"]
    tags = {image_tag(cuda["TRAINBOX_VERSION"], cuda, rocm=False), image_tag(rocm["TRAINBOX_VERSION"], rocm, rocm=True)}
    files = [REPO / "README.md", REPO / "docs" / "deploy.md", REPO / "compose.yaml", *DOCKERFILES,
             REPO / "src" / "trainbox" / "cli" / "epilogs.py", REPO / "src" / "trainbox" / "launch" / "spec.py"]
    written = {f.name: set(re.findall(r"trainbox:\d[\w.]*-(?:cu\d+|rocm[\d.]+)-torch[\d.]+", f.read_text()))
               for f in files}
    assert all(found <= tags for found in written.values()), written
    assert written["compose.yaml"] == written["deploy.md"] == tags
    deploy = (REPO / "docs" / "deploy.md").read_text()
    for stated in (f"nvidia/cuda:{cuda['CUDA_VERSION']}-base-ubuntu{cuda['UBUNTU_VERSION']}",
                   f"{cuda['TORCH_VERSION']} (`{cuda['TORCH_CUDA']}` wheels)",
                   f"flash-attn-4 {cuda['FLASH_ATTN_4_VERSION']}", f"quack-kernels {cuda['QUACK_KERNELS_VERSION']}",
                   f"rocm/pytorch:rocm{rocm['ROCM_VERSION']}_ubuntu{rocm['UBUNTU_VERSION']}_py{rocm['PYTHON_VERSION']}"
                   f"_pytorch_release_{rocm['TORCH_VERSION']}", f"the base image's {rocm['TORCH_VERSION']}"):
        assert stated in deploy, stated


def test_launch_image_dry_run_prints_only():
    proc = run_cli("launch", "image", "--registry", "r.io/x", "--tag", "t", "--push", "--dry-run",
                   "--context", str(REPO))
    assert (proc.stdout.startswith("docker buildx build --file docker/Dockerfile ")
            and "r.io/x/trainbox:t" in proc.stdout)


# ----------------------------------------------------------------------------- shell


def test_shellcheck_entrypoint_and_rendered_sbatch(tmp_path):
    files = rendered("slurm", tmp_path, nodes=2, gpus_per_node=4, partition="gpu", image="reg/img:1")
    validate([tool("shellcheck"), str(REPO / "docker" / "entrypoint.sh"), *(str(tmp_path / f) for f in files)])


def test_rendering_again_replaces_its_own_files_and_never_one_it_did_not_write(tmp_path):
    """`trainbox launch` marks what it writes (after a #! line); rendering again replaces those files. A file of the
    same name it did not write (the user's own compose.yaml in --out) is refused in one message and left as it
    was, before any file is written."""
    from trainbox.launch.spec import MARK

    out = tmp_path / "deploy"
    first = rendered("slurm", out, image=None)
    [script] = first
    assert first[script].split("\n")[:2] == ["#!/bin/bash", MARK]
    again = rendered("slurm", out, image=None, nodes=2)   # replaced: its own file
    assert "#SBATCH --nodes=2\n" in again[script]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "compose.yaml").write_text("services: {mine: {image: x}}\n")
    proc = run_cli("launch", "compose", "tiny", "--image", "x/y:1", "--out", str(mine), check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"trainbox launch: --out {mine}: {mine / 'compose.yaml'} exists and was not written by `trainbox launch`")
    assert (mine / "compose.yaml").read_text() == "services: {mine: {image: x}}\n" and proc.stdout == ""
    assert sorted(p.name for p in mine.iterdir()) == ["compose.yaml"]


def test_sbatch_directives(tmp_path):
    [text] = rendered("slurm", tmp_path, nodes=4, gpus_per_node=8, time="48:00:00", image=None).values()
    for d in ("--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=1", "--signal=USR1@120", "--requeue",
              "--time=48:00:00"):
        assert f"#SBATCH {d}\n" in text
    assert ('srun --kill-on-bad-exit=1 --cpu-bind=none bash -c \'exec "$@" --node-rank="$SLURM_NODEID"\' trainbox '
            '"${TRAIN[@]}"') in text   # the launcher of tests/test_multinode.py, its node rank the task's own
    assert '"--rdzv-endpoint=$HEAD_NODE:$RDZV_PORT"' in text and '"--rdzv-id=$SLURM_JOB_ID"' in text
    assert "    trainbox\n    train\n    --nproc=8\n    --nnodes=4\n" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "    --max-restarts=3\n" in text   # torchrun restarts a node's workers; --requeue restarts the job



# ----------------------------------------------------------------------------- compose


def compose_check(path) -> None:
    validate([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])


def test_compose_yaml_schema_and_policies():
    compose_check(REPO / "compose.yaml")
    doc = yaml.safe_load((REPO / "compose.yaml").read_text())
    cuda, rocm = doc["services"]["trainbox"], doc["services"]["trainbox-rocm"]
    assert cuda["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert rocm["devices"] == ["/dev/kfd", "/dev/dri"] and rocm["group_add"] == ["video", "render"]
    assert rocm["profiles"] == ["rocm"]
    for svc in (cuda, rocm):
        assert_service_policies(svc)


def assert_service_policies(svc: dict) -> None:
    data = [v for v in svc["volumes"] if ":/workspace/data" in v]
    assert data and all(v.endswith(":ro") for v in data)
    targets = {re.search(r":(/[^:]+)(:ro)?$", v).group(1) for v in svc["volumes"]}
    assert {"/workspace/runs", "/cache/huggingface", "/cache/compile"} <= targets
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"]), "the health port must stay on the host's loopback"
    assert svc["healthcheck"]["test"][:3] == ["CMD", "trainbox", "status"]
    assert svc["restart"].startswith("on-failure") and svc["shm_size"]
    assert svc["ulimits"]["memlock"] == -1 and svc["ulimits"]["stack"] > 0
    assert svc["logging"]["driver"] == "json-file" and svc["logging"]["options"]["max-size"]
    assert {"cpus", "memory"} <= set(svc["deploy"]["resources"]["limits"])


@pytest.mark.parametrize("vendor,gpus", [("nvidia", 8), ("amd", 2), ("nvidia", 0)])
def test_rendered_compose_schema(tmp_path, vendor, gpus):
    files = rendered("compose", tmp_path, gpu_vendor=vendor, gpus_per_node=gpus)
    compose_check(tmp_path / "compose.yaml")
    svc = yaml.safe_load(files["compose.yaml"])["services"]["trainbox"]
    assert_service_policies(svc)
    if gpus > 1:
        assert svc["command"][:4] == ["torchrun", "--nnodes=1", f"--nproc-per-node={gpus}", "--standalone"]
    else:
        assert svc["command"] == ["train", "gpt2-125m"]
    if vendor == "nvidia" and gpus:
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == gpus
    if vendor == "amd":
        assert svc["devices"] == ["/dev/kfd", "/dev/dri"] and "reservations" not in svc["deploy"]["resources"]


# ----------------------------------------------------------------------------- kubernetes


def check_pytorchjob(job: dict, nodes: int, gpus: int, resource: str, min_nodes: int | None = None) -> None:
    """Our strict checks of the kubeflow.org/v1 fields the training operator reads."""
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert set(job) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    spec = job["spec"]
    assert set(spec) <= {"runPolicy", "nprocPerNode", "pytorchReplicaSpecs", "elasticPolicy"}
    elastic = min_nodes is not None
    if elastic:
        assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": min_nodes, "maxReplicas": nodes,
                                         "maxRestarts": 10}
    else:
        assert "elasticPolicy" not in spec, "a fixed-size job: no elasticPolicy"
    assert isinstance(spec["nprocPerNode"], str) and spec["nprocPerNode"] == str(max(gpus, 1))
    assert set(spec["runPolicy"]) <= {"cleanPodPolicy", "backoffLimit", "ttlSecondsAfterFinished",
                                      "activeDeadlineSeconds", "schedulingPolicy", "suspend"}
    assert spec["runPolicy"]["cleanPodPolicy"] in ("None", "All", "Running")
    replicas = spec["pytorchReplicaSpecs"]
    if elastic:  # workers only; rendezvous, nnodes and nproc come from the operator's PET_* variables
        assert set(replicas) == {"Worker"} and replicas["Worker"]["replicas"] == nodes
    else:
        assert set(replicas) == ({"Master", "Worker"} if nodes > 1 else {"Master"})
        assert replicas["Master"]["replicas"] == 1
    if nodes > 1 and not elastic:
        assert replicas["Worker"]["replicas"] == nodes - 1
    for role, r in replicas.items():
        assert set(r) == {"replicas", "restartPolicy", "template"}
        assert r["restartPolicy"] in ("OnFailure", "Always", "ExitCode", "Never")
        pod = r["template"]["spec"]
        [c] = pod["containers"]
        assert c["name"] == "pytorch"
        if elastic:
            assert c["args"][:5] == ["torchrun", "-m", "trainbox", "train", "gpt2-125m"]
        else:
            assert c["args"][:3] == ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={max(gpus, 1)}"]
            assert "--node-rank=$(RANK)" in c["args"] and "--master-addr=$(MASTER_ADDR)" in c["args"]
            assert ("--max-restarts=3" in c["args"]) == (nodes > 1)   # with the pods' restartPolicy OnFailure
        if gpus:
            assert c["resources"]["limits"][resource] == gpus
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert any("persistentVolumeClaim" in v for v in pod["volumes"])
        assert pod["terminationGracePeriodSeconds"] >= 120
        # the monitor stays on the pod's loopback: no port, exec probes (an httpGet probe comes from the node)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert "monitor.host=127.0.0.1" in env["TRAINBOX_OVERRIDES"].split() and "ports" not in c
        probes = {"startupProbe", "livenessProbe"} & set(c)
        if role == "Master":  # rank 0 serves /health
            assert probes == {"startupProbe", "livenessProbe"}
            assert all(set(c[p]) & {"exec", "httpGet", "tcpSocket", "grpc"} == {"exec"} for p in probes)
            assert all(c[p]["exec"]["command"] == ["trainbox", "status", "http://127.0.0.1:8080"] for p in probes)
        else:
            assert not probes


@pytest.mark.parametrize("nodes,gpus,vendor,min_nodes", [(2, 8, "nvidia", None), (1, 1, "amd", None),
                                                        (3, 4, "amd", None), (4, 8, "nvidia", 2)])
def test_pytorchjob_strict(tmp_path, nodes, gpus, vendor, min_nodes):
    files = rendered("k8s", tmp_path, nodes=nodes, gpus_per_node=gpus, gpu_vendor=vendor, namespace="ml",
                     min_nodes=min_nodes)
    job = yaml.safe_load(files["pytorchjob.yaml"])
    check_pytorchjob(job, nodes, gpus, {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}[vendor], min_nodes)
    kv = tool("kubernetes-validate")
    validate([kv, "--strict", str(tmp_path / "storage.yaml")])
    for role, tpl in pod_templates_of(job).items():
        path = tmp_path / f"podtemplate-{role}.yaml"
        path.write_text(yaml.safe_dump(tpl))
        validate([kv, "--strict", str(path)])


def test_k8s_probe_command_reaches_the_loopback_monitor(tmp_path):
    """The Master's exec probe, run against a monitor configured by the pod's TRAINBOX_OVERRIDES (on a free
    port here): exit 0 while healthy, 1 once the run failed; it passes the server's Host check."""
    from trainbox.config import load_config
    from trainbox.monitor.server import start_server
    from trainbox.monitor.state import RunState

    files = rendered("k8s", tmp_path, nodes=2, gpus_per_node=1)
    [c] = yaml.safe_load(files["pytorchjob.yaml"])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"]
    overrides = next(e["value"] for e in c["env"] if e["name"] == "TRAINBOX_OVERRIDES")
    cfg = load_config(None, [*shlex.split(overrides), "monitor.port=0"]).monitor
    assert cfg.host == "127.0.0.1" and not cfg.token
    state = RunState("probe", tmp_path)
    state.update(phase="training", step=1)
    server = start_server(state, cfg)
    try:
        cmd = c["livenessProbe"]["exec"]["command"]
        assert cmd[0] == "trainbox"
        cmd = [sys.executable, "-m", "trainbox", *cmd[1:-1],
               cmd[-1].replace(":8080", f":{server.httpd.server_address[1]}")]
        ok = subprocess.run(cmd, capture_output=True, text=True)
        assert ok.returncode == 0 and ok.stdout.startswith("healthy"), ok.stdout + ok.stderr
        state.update(phase="failed", error="loss is nan at step 1")
        bad = subprocess.run(cmd, capture_output=True, text=True)
        assert bad.returncode == 1 and "nan" in bad.stdout, bad.stdout + bad.stderr
    finally:
        server.stop()


def test_kubernetes_validate_rejects_a_bad_field(tmp_path):
    """The validator is not a rubber stamp: an unknown pod field fails --strict."""
    files = rendered("k8s", tmp_path, nodes=1, gpus_per_node=1)
    tpl = pod_templates_of(yaml.safe_load(files["pytorchjob.yaml"]))["Master"]
    tpl["template"]["spec"]["containers"][0]["gpus"] = 1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(tpl))
    proc = subprocess.run([tool("kubernetes-validate"), "--strict", str(tmp_path / "bad.yaml")], capture_output=True)
    assert proc.returncode != 0


def test_workspace_pod(tmp_path):
    files = rendered("k8s", tmp_path, workspace=True, gpus_per_node=2)
    assert set(files) == {"storage.yaml", "workspace.yaml"}
    validate([tool("kubernetes-validate"), "--strict", str(tmp_path / "workspace.yaml")])
    pod = yaml.safe_load(files["workspace.yaml"])
    [c] = pod["spec"]["containers"]
    assert c["args"] == ["sleep", "infinity"] and c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert not any(m.get("readOnly") for m in c["volumeMounts"]), "the workspace prepares data: writable"


def test_config_file_recipe_travels_with_the_files(tmp_path):
    """A recipe that is a file: a ConfigMap (k8s), a read-only bind mount (compose), its absolute path (slurm)."""
    recipe = tmp_path / "my-run.yaml"
    recipe.write_text("model:\n  n_layer: 2\ntrain:\n  max_steps: 7\n")
    files = rendered("k8s", tmp_path, recipe=str(recipe), nodes=2, gpus_per_node=2)
    cm = yaml.safe_load(files["configmap.yaml"])
    assert cm["kind"] == "ConfigMap" and cm["data"] == {"my-run.yaml": recipe.read_text()}
    validate([tool("kubernetes-validate"), "--strict", str(tmp_path / "configmap.yaml")])
    job = yaml.safe_load(files["pytorchjob.yaml"])
    for role, tpl in pod_templates_of(job).items():
        pod = tpl["template"]["spec"]
        [c] = pod["containers"]
        assert c["args"][c["args"].index("train") + 1] == "/etc/trainbox/my-run.yaml"
        assert {"name": "config", "mountPath": "/etc/trainbox", "readOnly": True} in c["volumeMounts"]
        assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in pod["volumes"]
        (tmp_path / f"pt-{role}.yaml").write_text(yaml.safe_dump(tpl))
        validate([tool("kubernetes-validate"), "--strict", str(tmp_path / f"pt-{role}.yaml")])
    svc = yaml.safe_load(rendered("compose", tmp_path, recipe=str(recipe))["compose.yaml"])["services"]["trainbox"]
    assert f"{recipe}:/etc/trainbox/my-run.yaml:ro" in svc["volumes"]
    assert svc["command"] == ["train", "/etc/trainbox/my-run.yaml"]
    [script] = rendered("slurm", tmp_path, recipe=str(recipe), image=None, project_dir=tmp_path / "proj").values()
    assert f"    {recipe}\n" in script and f"cd {tmp_path / 'proj'}\n" in script


def test_launch_cli_writes_files_and_apply_names_missing_tool(tmp_path):
    out = tmp_path / "k"
    proc = run_cli("launch", "k8s", "tiny", "train.max_steps=5", "--image", "img:1", "--nodes", "2",
                   "--gpus-per-node", "2", "--out", str(out), "--apply",
                   env={"PATH": str(tmp_path / "empty-bin")}, check=False)
    assert (out / "pytorchjob.yaml").is_file() and (out / "storage.yaml").is_file()
    assert proc.returncode == 1 and "'kubectl' is not installed here" in proc.stderr
    proc = run_cli("launch", "compose", "tiny", "--out", str(tmp_path / "c"), check=False)
    assert proc.returncode == 2 and "needs --image" in proc.stderr
    proc = run_cli("launch", "k8s", "tiny", "train.max_step=5", "--image", "i", "--out", str(tmp_path / "x"),
                   check=False)
    assert proc.returncode == 2 and "train.max_steps" in proc.stderr and not (tmp_path / "x").exists()
