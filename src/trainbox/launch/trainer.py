"""`trainbox launch k8s --api trainer`: a Kubeflow Trainer v2 `TrainJob` and the `ClusterTrainingRuntime` it uses.

The runtime (trainer.kubeflow.org/v1alpha1, named trainbox-RUN) holds the pod: the image, the run and data volumes,
/dev/shm, the probes, and the command; its `mlPolicy.torch` makes the Trainer inject PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT into the container named `node`. The
command is the two-node launcher the test suite runs (tests/test_multinode.py):

    trainbox train --nproc $(PET_NPROC_PER_NODE) --nnodes $(PET_NNODES) --node-rank $(PET_NODE_RANK)
                   --rdzv-endpoint $(PET_MASTER_ADDR):$(PET_MASTER_PORT) RECIPE OVERRIDES...

(Kubernetes expands the $(VAR) references from the container's environment), so node 0, the pod at index 0,
hosts the c10d rendezvous and the job's rank 0. The TrainJob says how many nodes, processes and GPUs per node.

Restarts: a failed pod fails its Job (restartPolicy Never, backoffLimit 0) and the JobSet's failure policy
recreates every node (up to RESTARTS times), so the whole job starts again and resumes from the newest verified
checkpoint on the shared run volume; a node lost or a rank stuck ends the other ranks within
train.collective_timeout, so a lost pod never leaves the rest hanging.

Probes: the monitor serves /health on rank 0's loopback. Every pod has the same template, so its exec probe asks
/health only on node 0 (`trainbox status http://127.0.0.1:8080`) and passes elsewhere: a silent rank on another
node turns rank 0's /health to 503 ("stalled: rank R silent for N s"), which restarts the job through node 0.
"""
from __future__ import annotations

import copy

from trainbox.config import RunConfig
from trainbox.launch.k8s import GPU_RESOURCE, _labels, _namespace, config_map, pod_template, pvc
from trainbox.launch.spec import MONITOR_PORT, LaunchSpec, Rendered, dump, job_name, train_args

API = "trainer.kubeflow.org/v1alpha1"
RESTARTS = 10   # the JobSet's failure policy: times the whole job is recreated after a failed node
NODE = "node"   # the replicated job and container the Trainer's torch plugin configures

LAUNCHER = ["--nproc", "$(PET_NPROC_PER_NODE)", "--nnodes", "$(PET_NNODES)", "--node-rank", "$(PET_NODE_RANK)",
            "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]


def node_args(spec: LaunchSpec) -> list[str]:
    """`trainbox train` with the launcher flags from the Trainer's PET_* variables, then the recipe and overrides."""
    train = train_args(spec, expanded=True)   # Kubernetes expands $(VAR) in args: the user's $ stay literal
    return ["trainbox", train[0], *LAUNCHER, *train[1:]]


def _probe(container: dict) -> None:
    """/health of rank 0 from node 0's pod; the other nodes' probes pass (module docstring)."""
    health = {"command": ["sh", "-c", f'[ "$PET_NODE_RANK" != 0 ] || exec trainbox status '
                                      f'http://127.0.0.1:{MONITOR_PORT}']}
    container["startupProbe"] = {"exec": health, "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 60}
    container["livenessProbe"] = {"exec": copy.deepcopy(health), "periodSeconds": 30, "timeoutSeconds": 10,
                                  "failureThreshold": 4}


def runtime_name(name: str) -> str:
    return f"trainbox-{name}"[:63].rstrip("-")


def cluster_training_runtime(spec: LaunchSpec, name: str) -> dict:
    pod = pod_template(spec, name, "node", node_args(spec), probes=False)
    container = pod["spec"]["containers"][0]
    container["name"] = NODE
    _probe(container)
    pod["spec"]["restartPolicy"] = "Never"
    pod["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] = "trainer"
    job = {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
           "spec": {"backoffLimit": 0, "template": pod}}
    return {"apiVersion": API, "kind": "ClusterTrainingRuntime",
            "metadata": {"name": runtime_name(name), "labels": {**_labels(name, "runtime"),
                                                                 "trainer.kubeflow.org/framework": "torch"}},
            "spec": {"mlPolicy": {"numNodes": spec.nodes, "torch": {}},
                     "template": {"spec": {"failurePolicy": {"maxRestarts": RESTARTS},
                                           "replicatedJobs": [{"name": NODE, "replicas": 1, "template": job}]}}}}


def train_job(spec: LaunchSpec, name: str) -> dict:
    gpu = {GPU_RESOURCE[spec.gpu_vendor]: spec.gpus_per_node} if spec.gpus_per_node else {}
    resources = {"cpu": str(spec.cpus), "memory": spec.memory, **gpu}
    return {"apiVersion": API, "kind": "TrainJob",
            "metadata": {"name": name, "labels": _labels(name, "training"), **_namespace(spec)},
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": runtime_name(name)},
                     "trainer": {"numNodes": spec.nodes, "numProcPerNode": spec.procs,
                                 "resourcesPerNode": {"limits": resources, "requests": copy.deepcopy(resources)}}}}


def render_trainer(spec: LaunchSpec, cfg: RunConfig) -> Rendered:
    name = job_name(cfg)
    ns = ["--namespace", spec.namespace] if spec.namespace else []
    files = {"storage.yaml": dump(pvc(spec, spec.runs_pvc), pvc(spec, spec.data_pvc))}
    if spec.config_file:
        files["configmap.yaml"] = dump(config_map(spec, name))
    files["runtime.yaml"] = dump(cluster_training_runtime(spec, name))
    files["trainjob.yaml"] = dump(train_job(spec, name))
    kubectl = " ".join(["kubectl", *ns])
    notes = [f"needs Kubeflow Trainer v2 (trainer.kubeflow.org); watch: {kubectl} logs -f "
             f"-l jobset.sigs.k8s.io/jobset-name={name} -c {NODE}",
             f"dashboard: {kubectl} port-forward pod/<node 0's pod> {MONITOR_PORT}:{MONITOR_PORT}, then "
             f"http://127.0.0.1:{MONITOR_PORT}/ (the monitor listens on the pod's loopback only)"]
    return Rendered(files=files, apply=[["kubectl", *ns, "apply", "-f", f] for f in files], notes=notes)
