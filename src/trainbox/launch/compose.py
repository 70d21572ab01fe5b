"""`trainbox launch compose`: one run as a Docker Compose service on one host (1 or more GPUs)."""
from __future__ import annotations

from trainbox.config import RunConfig
from trainbox.launch.spec import (
    CONFIG_MOUNT,
    MONITOR_PORT,
    LaunchSpec,
    Rendered,
    dump,
    job_name,
    literal_dollars,
    torchrun_args,
    yaml_template,
)


def _gib_to_docker(size: str) -> str:
    """Kubernetes-style sizes (16Gi) to Docker's (16g)."""
    return size.lower().replace("i", "") if size.endswith(("Gi", "Mi")) else size


def render_compose(spec: LaunchSpec, cfg: RunConfig) -> Rendered:
    doc = yaml_template("compose.yaml")
    svc = doc["services"]["trainbox"]
    svc["image"] = spec.image
    # one process: trainbox train; several GPUs: torchrun on this host (standalone rendezvous)
    # Compose expands $VAR and ${VAR} in every value: the command and the host paths write each $ as $$
    svc["command"] = torchrun_args(spec, ["--standalone"], expanded=True)
    svc["volumes"] = [
        literal_dollars(f"{spec.project_dir / 'data'}:/workspace/data:ro"),
        literal_dollars(f"{spec.project_dir / 'runs'}:/workspace/runs"),
        "hf-cache:/cache/huggingface",
        "compile-cache:/cache/compile",
    ]
    if spec.config_file:
        svc["volumes"].append(literal_dollars(f"{spec.config_file}:{CONFIG_MOUNT}/{spec.config_file.name}:ro"))
    svc["shm_size"] = _gib_to_docker(spec.shm)
    svc["ports"] = [f"127.0.0.1:{spec.host_port}:{MONITOR_PORT}"]
    resources = svc["deploy"]["resources"]
    resources["limits"] = {"cpus": str(spec.cpus), "memory": _gib_to_docker(spec.memory)}
    if spec.gpus_per_node and spec.gpu_vendor == "nvidia":
        resources["reservations"] = {"devices": [
            {"driver": "nvidia", "count": spec.gpus_per_node, "capabilities": ["gpu"]}]}
    elif spec.gpus_per_node:  # ROCm: the device files, and the groups that own them
        svc["devices"] = ["/dev/kfd", "/dev/dri"]
        svc["group_add"] = ["video", "render"]
        svc["security_opt"] = ["seccomp=unconfined"]
    name = job_name(cfg)
    doc = {"name": name, **doc}
    return Rendered(
        files={"compose.yaml": dump(doc)},
        apply=[["docker", "compose", "-f", "compose.yaml", "up", "--detach"]],
        notes=[f"follow it: docker compose -p {name} logs -f; dashboard: http://127.0.0.1:{spec.host_port}/",
               f"mounts {spec.project_dir}/data (read-only) and {spec.project_dir}/runs: create them first "
               f"(mkdir -p data runs), owned by uid 1000"])
