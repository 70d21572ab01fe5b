"""`trainbox launch k8s`: a Kubeflow PyTorchJob (or a dev-workspace Pod) and the PVCs it mounts.

The PyTorchJob (kubeflow.org/v1) has a Master (node rank 0; it serves /health, so only it has probes)
and nodes-1 Workers. Each pod runs one torchrun with `nprocPerNode` processes; the training operator sets
MASTER_ADDR, MASTER_PORT and RANK (the node rank), which the container's arguments reference as
$(VAR) and Kubernetes expands. Pods are restarted on failure and resume from the last checkpoint.

The monitor listens on the pod's loopback only (monitor.host=127.0.0.1 in TRAINBOX_OVERRIDES; no token to
manage, nothing else in the cluster reaches it): the probes are exec probes running `trainbox status`
inside the container (an httpGet probe comes from the node and would not reach it), and the dashboard
is reached with `kubectl port-forward`, which connects to the pod's loopback.

With --min-nodes the job is elastic (elasticPolicy, Worker replicas only): torchrun takes its c10d
rendezvous from the PET_* variables the operator sets and keeps training on min..max nodes; the data
loader's global batches do not depend on the world size, so a resize continues the same run. Rank 0 can
then be on any pod, so elastic pods have no /health probes.
"""
from __future__ import annotations

import copy

from trainbox.config import RunConfig
from trainbox.launch.spec import (
    CONFIG_MOUNT,
    MONITOR_PORT,
    LaunchSpec,
    Rendered,
    dump,
    job_name,
    torchrun_args,
    train_args,
    yaml_template,
)

GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
RENDEZVOUS = ["--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]


def _labels(name: str, component: str) -> dict:
    return {"app.kubernetes.io/name": "trainbox", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def _probes(container: dict) -> None:
    """startup: up to 30 min for data preparation and compilation; liveness: a stalled step restarts.
    Both run the images' HEALTHCHECK command against the loopback-bound monitor."""
    health = {"command": ["trainbox", "status", f"http://127.0.0.1:{MONITOR_PORT}"]}
    container["startupProbe"] = {"exec": health, "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 60}
    container["livenessProbe"] = {"exec": copy.deepcopy(health), "periodSeconds": 30, "timeoutSeconds": 10,
                                  "failureThreshold": 4}


def pod_template(spec: LaunchSpec, name: str, component: str, args: list[str], probes: bool) -> dict:
    tpl = yaml_template("pod.yaml")
    tpl["metadata"]["labels"] = _labels(name, component)
    pod = tpl["spec"]
    c = pod["containers"][0]
    c["image"] = spec.image
    c["args"] = args
    gpu = {GPU_RESOURCE[spec.gpu_vendor]: spec.gpus_per_node} if spec.gpus_per_node else {}
    c["resources"] = {"limits": {"cpu": str(spec.cpus), "memory": spec.memory, **gpu},
                      "requests": {"cpu": str(spec.cpus), "memory": spec.memory, **gpu}}
    if probes:
        _probes(c)
    if spec.config_file:  # a config-file recipe travels as a ConfigMap
        c["volumeMounts"].append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
        pod["volumes"].append({"name": "config", "configMap": {"name": f"{name}-config"}})
    for vol in pod["volumes"]:
        if vol["name"] == "dshm":
            vol["emptyDir"]["sizeLimit"] = spec.shm
        elif vol["name"] == "runs":
            vol["persistentVolumeClaim"]["claimName"] = spec.runs_pvc
        elif vol["name"] == "data":
            vol["persistentVolumeClaim"]["claimName"] = spec.data_pvc
    return tpl


def pytorchjob(spec: LaunchSpec, name: str) -> dict:
    job = yaml_template("pytorchjob.yaml")
    job["metadata"] = {"name": name, "labels": _labels(name, "training"), **_namespace(spec)}
    job["spec"]["nprocPerNode"] = str(spec.procs)
    if spec.min_nodes is not None:
        return _elastic(job, spec, name)
    # Kubernetes expands $(VAR) in args: RENDEZVOUS's are meant to, the recipe's and overrides' $ are escaped
    args = torchrun_args(spec, RENDEZVOUS, always=True, expanded=True)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    replicas["Master"]["template"] = pod_template(spec, name, "master", args, probes=True)
    if spec.nodes > 1:
        replicas["Worker"]["replicas"] = spec.nodes - 1
        replicas["Worker"]["template"] = pod_template(spec, name, "worker", args, probes=False)
    else:
        del replicas["Worker"]
    return job


def _elastic(job: dict, spec: LaunchSpec, name: str) -> dict:
    replicas = job["spec"]["pytorchReplicaSpecs"]
    del replicas["Master"]
    replicas["Worker"]["replicas"] = spec.nodes
    # nnodes, nproc, rendezvous: PET_* from the operator
    args = ["torchrun", "-m", "trainbox", *train_args(spec, expanded=True)]
    replicas["Worker"]["template"] = pod_template(spec, name, "worker", args, probes=False)
    job["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": spec.min_nodes,
                                    "maxReplicas": spec.nodes, "maxRestarts": 10}
    return job


def workspace_pod(spec: LaunchSpec, name: str) -> dict:
    """A long-lived Pod with the same image, GPUs and volumes (data writable) for interactive work."""
    tpl = pod_template(spec, name, "workspace", ["sleep", "infinity"], probes=False)
    for m in tpl["spec"]["containers"][0]["volumeMounts"]:
        m.pop("readOnly", None)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-workspace", **_namespace(spec), "labels": tpl["metadata"]["labels"]},
            "spec": {**tpl["spec"], "restartPolicy": "Always"}}


def config_map(spec: LaunchSpec, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", **_namespace(spec), "labels": _labels(name, "config")},
            "data": {spec.config_file.name: spec.config_file.read_text()}}


def pvc(spec: LaunchSpec, claim: str) -> dict:
    doc = yaml_template("pvc.yaml")
    doc["metadata"] = {"name": claim, **_namespace(spec), "labels": {"app.kubernetes.io/name": "trainbox"}}
    doc["spec"]["resources"]["requests"]["storage"] = spec.storage
    if spec.storage_class:
        doc["spec"]["storageClassName"] = spec.storage_class
    return doc


def _namespace(spec: LaunchSpec) -> dict:
    return {"namespace": spec.namespace} if spec.namespace else {}


def pod_templates_of(job: dict) -> dict[str, dict]:
    """Each replica's pod template as a v1 PodTemplate object (what kubernetes-validate checks)."""
    out = {}
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        out[role] = {"apiVersion": "v1", "kind": "PodTemplate",
                     "metadata": {"name": f"{job['metadata']['name']}-{role.lower()}"},
                     "template": copy.deepcopy(replica["template"])}
    return out


def render_k8s(spec: LaunchSpec, cfg: RunConfig) -> Rendered:
    name = job_name(cfg)
    ns = ["--namespace", spec.namespace] if spec.namespace else []
    files = {"storage.yaml": dump(pvc(spec, spec.runs_pvc), pvc(spec, spec.data_pvc))}
    if spec.config_file:
        files["configmap.yaml"] = dump(config_map(spec, name))
    if spec.workspace:
        files["workspace.yaml"] = dump(workspace_pod(spec, name))
        notes = [f"then: kubectl {' '.join(ns)} exec -it {name}-workspace -- bash".replace("  ", " ")]
    else:
        files["pytorchjob.yaml"] = dump(pytorchjob(spec, name))
        notes = [f"needs the Kubeflow training operator; watch: kubectl {' '.join(ns)} logs -f "
                 f"{name}-master-0".replace("  ", " "),
                 f"dashboard: kubectl port-forward pod/{name}-master-0 {MONITOR_PORT}:{MONITOR_PORT}, then "
                 f"http://127.0.0.1:{MONITOR_PORT}/ (the monitor listens on the pod's loopback only)"]
    apply = [["kubectl", *ns, "apply", "-f", f] for f in files]
    return Rendered(files=files, apply=apply, notes=notes)
