"""`trainbox launch k8s --api trainer`: the Kubeflow Trainer v2 TrainJob and its ClusterTrainingRuntime, checked
offline against the Trainer's own API models (kubeflow-trainer-api: every field must survive a load and a dump,
so an unknown or misplaced one fails) and the runtime's pod template with kubernetes-validate --strict; the
container runs the launcher flags of the two-node test (tests/test_multinode.py runs this very command); the node-0
probe answers from /health. `--api pytorchjob` (the default) renders what it always did."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from conftest import run_cli
from test_deploy_files import rendered, tool, validate

models = pytest.importorskip("kubeflow_trainer_api.models", reason="kubeflow-trainer-api is in the test extra")


def check_model(doc: dict) -> None:
    cls = {"TrainJob": models.TrainerV1alpha1TrainJob,
           "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime}[doc["kind"]]
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert cls.from_dict(doc).to_dict() == doc, f"{doc['kind']}: a field the Trainer's API does not have"


def _pod(runtime: dict) -> dict:
    [job] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node" and job["replicas"] == 1
    assert job["template"]["spec"]["backoffLimit"] == 0   # a failed pod fails its Job: the JobSet restarts all
    return job["template"]["spec"]["template"]


@pytest.mark.parametrize("nodes,gpus,vendor", [(2, 8, "nvidia"), (1, 1, "amd"), (4, 0, "nvidia")])
def test_trainjob_and_runtime_pass_the_trainer_api_and_kubernetes(tmp_path, nodes, gpus, vendor):
    files = rendered("k8s", tmp_path, nodes=nodes, gpus_per_node=gpus, gpu_vendor=vendor, namespace="ml",
                     api="trainer")
    assert set(files) == {"storage.yaml", "runtime.yaml", "trainjob.yaml"}
    runtime, job = yaml.safe_load(files["runtime.yaml"]), yaml.safe_load(files["trainjob.yaml"])
    check_model(runtime)
    check_model(job)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    assert job["metadata"]["namespace"] == "ml" and "namespace" not in runtime["metadata"]   # cluster-scoped
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == nodes == runtime["spec"]["mlPolicy"]["numNodes"]
    assert trainer["numProcPerNode"] == max(gpus, 1) and runtime["spec"]["mlPolicy"]["torch"] == {}
    resource = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}[vendor]
    assert trainer["resourcesPerNode"]["limits"].get(resource) == (gpus or None)
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] >= 1

    pod = _pod(runtime)
    assert pod["spec"]["restartPolicy"] == "Never"
    [c] = pod["spec"]["containers"]
    assert c["name"] == "node" and c["image"] == "reg/trainbox:t"   # the container the Trainer injects PET_* into
    assert c["args"] == ["trainbox", "train", "--nproc", "$(PET_NPROC_PER_NODE)", "--nnodes", "$(PET_NNODES)",
                         "--node-rank", "$(PET_NODE_RANK)", "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
                         "gpt2-125m"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"runs": "trainbox-runs", "data": "trainbox-data"}
    assert {"name": "runs", "mountPath": "/workspace/runs", "subPath": "runs"} in c["volumeMounts"]
    assert {"startupProbe", "livenessProbe"} <= set(c)
    kv = tool("kubernetes-validate")
    path = tmp_path / "podtemplate.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "node"},
                                    "template": pod}))
    validate([kv, "--strict", str(path)])
    validate([kv, "--strict", str(tmp_path / "storage.yaml")])


def test_the_api_check_is_not_a_rubber_stamp(tmp_path):
    runtime = yaml.safe_load(rendered("k8s", tmp_path, nodes=2, api="trainer")["runtime.yaml"])
    _pod(runtime)["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(AssertionError, match="a field the Trainer's API does not have"):
        check_model(runtime)
    job = yaml.safe_load((tmp_path / "trainjob.yaml").read_text())
    job["spec"]["trainer"]["nodes"] = 2
    with pytest.raises(AssertionError, match="a field the Trainer's API does not have"):
        check_model(job)


def test_the_probe_asks_health_on_node_0_only(tmp_path):
    """The exec probe (sh -c) run as the kubelet would: on node 1 it passes without a monitor; on node 0 it is
    `trainbox status` against the loopback monitor: 0 while healthy, 1 once the run has failed."""
    from trainbox.config import load_config
    from trainbox.monitor.server import start_server
    from trainbox.monitor.state import RunState

    runtime = yaml.safe_load(rendered("k8s", tmp_path, nodes=2, api="trainer")["runtime.yaml"])
    [c] = _pod(runtime)["spec"]["containers"]
    cmd = c["livenessProbe"]["exec"]["command"]
    assert cmd == c["startupProbe"]["exec"]["command"] and cmd[:2] == ["sh", "-c"]
    state = RunState("probe", tmp_path)
    state.update(phase="training", step=1)
    server = start_server(state, load_config(None, ["monitor.port=0", "monitor.host=127.0.0.1"]).monitor)
    script = cmd[2].replace("exec trainbox", f"exec {sys.executable} -m trainbox").replace(
        ":8080", f":{server.httpd.server_address[1]}")

    def probe(node: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                              env={**os.environ, "PET_NODE_RANK": node})
    try:
        assert probe("1").returncode == 0 and probe("1").stdout == ""
        ok = probe("0")
        assert ok.returncode == 0 and ok.stdout.startswith("healthy"), ok.stdout + ok.stderr
        state.update(phase="failed", error="lost node 1 (host, ranks 2-3): silent for 10s")
        bad = probe("0")
        assert bad.returncode == 1 and "lost node 1" in bad.stdout, bad.stdout + bad.stderr
        assert probe("1").returncode == 0
    finally:
        server.stop()


def test_pytorchjob_stays_the_default_and_min_nodes_is_refused_for_trainer(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    default = rendered("k8s", tmp_path / "a", nodes=2)
    explicit = rendered("k8s", tmp_path / "b", nodes=2, api="pytorchjob")
    assert default == explicit and "pytorchjob.yaml" in default
    out = run_cli("launch", "k8s", "gpt2-125m", "--api", "trainer", "--min-nodes", "1", "--nodes", "2", "--image",
                  "reg/t:1", "--out", str(tmp_path / "c"), check=False)
    assert out.returncode == 2 and "--min-nodes (an elastic job) is for --api pytorchjob" in out.stderr, out.stderr

