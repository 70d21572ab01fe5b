"""`trainbox launch sky`: the SkyPilot task YAML, checked offline against SkyPilot's task schema and with our own
checks of what the task must hold (accelerators, nodes, the run directory on a bucket, setup, the launcher).

skypilot itself cannot join the test extra (skypilot 0.14.1 pins click<8.2; wandb, in the same extra, needs
>=8.2), so the schema is SkyPilot 0.14.1's own, vendored in tests/data/ (its source is stated in the file), and
check-jsonschema validates against it; where skypilot is importable, its own loader checks the task too; shellcheck
reads its scripts. The `run` script is run for two nodes on this host in tests/test_multinode.py."""
from __future__ import annotations

import pytest
import yaml
from conftest import REPO, run_cli
from test_deploy_files import rendered, tool, validate

SCHEMA = REPO / "tests" / "data" / "skypilot-0.14.1-task.schema.json"


def check_schema(path) -> None:
    validate([tool("check-jsonschema"), "--schemafile", str(SCHEMA), str(path)])


@pytest.mark.parametrize("nodes,gpus,image,store", [(2, "H100:8", None, None), (1, "A100-80GB", "reg/trainbox:t",
                                                                                "gcs"), (4, None, None, "s3")])
def test_task_passes_skypilot_schema_and_holds_the_run(tmp_path, nodes, gpus, image, store):
    files = rendered("sky", tmp_path, nodes=nodes, gpus=gpus, image=image, store=store, region="us-east-1",
                     overrides=["train.max_steps=100"])
    assert set(files) == {"task.yaml"}
    check_schema(tmp_path / "task.yaml")
    task = yaml.safe_load(files["task.yaml"])
    assert task["name"] == "gpt2-125m" and task["num_nodes"] == nodes
    res = task["resources"]
    assert res.get("accelerators") == gpus and res["region"] == "us-east-1"
    assert res["job_recovery"]["max_restarts_on_errors"] >= 1
    # the run directory: a bucket mounted where run.dir points, writable for checkpoints (MOUNT_CACHED)
    runs = task["envs"]["TRAINBOX_RUNS"]
    assert task["file_mounts"][runs] == {"name": "trainbox-gpt2-125m", **({"store": store} if store else {}),
                                         "mode": "MOUNT_CACHED"}
    if image:
        assert res["image_id"] == f"docker:{image}" and "setup" not in task   # trainbox is in the image
    else:
        assert "image_id" not in res and 'pip install "$TRAINBOX_INSTALL"' in task["setup"]
        assert task["envs"]["TRAINBOX_INSTALL"].startswith("trainbox==")
    run = task["run"]
    nproc = '--nproc "$SKYPILOT_NUM_GPUS_PER_NODE"' if gpus else "--nproc 1"
    assert f"exec trainbox train {nproc}" in run
    assert 'gpt2-125m run.dir="$TRAINBOX_RUNS" train.max_steps=100' in run
    nodes_flags = ('--nnodes "$SKYPILOT_NUM_NODES" --node-rank "$SKYPILOT_NODE_RANK" --rdzv-endpoint '
                   '"$HEAD_IP:$TRAINBOX_RDZV_PORT" --max-restarts 3')
    assert (nodes_flags in run) == (nodes > 1) == (task["envs"].get("TRAINBOX_RDZV_PORT") == "29500")
    assert ('HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n1)' in run) == (nodes > 1)


def test_setup_and_run_scripts_pass_shellcheck(tmp_path):
    """SkyPilot runs `setup` and `run` with bash on every node."""
    recipe = tmp_path / "my run.yaml"
    recipe.write_text("recipe: tiny\n")
    for i, kw in enumerate([{"nodes": 2, "gpus": "H100:8"}, {"nodes": 1, "recipe": str(recipe)}]):
        files = rendered("sky", tmp_path, image=None, overrides=["data.path=my data/x"], **kw)   # setup: no image
        task = yaml.safe_load(files["task.yaml"])
        for key in ("setup", "run"):
            path = tmp_path / f"{key}{i}.sh"
            path.write_text("#!/usr/bin/env bash\n" + task[key])
            validate([tool("shellcheck"), str(path)])


def test_the_schema_check_is_not_a_rubber_stamp(tmp_path):
    task = yaml.safe_load(rendered("sky", tmp_path, nodes=2, gpus="H100:8")["task.yaml"])
    for key, bad in [("resources", {"gpus": "H100:8"}), ("num_nodes", "two"),
                     ("file_mounts", {"/trainbox/runs": {"name": "b", "mode": "MOUNTED"}})]:
        path = tmp_path / f"bad-{key}.yaml"
        path.write_text(yaml.safe_dump({**task, key: bad}))
        with pytest.raises(AssertionError, match="failed"):
            check_schema(path)


def test_skypilots_own_loader_takes_the_task(tmp_path):
    """SkyPilot's Task.from_yaml_config (schema, resources, storage) where skypilot is installed (not in the test
    extra: see the module docstring); it needs no network for this."""
    sky = pytest.importorskip("sky", reason="skypilot is not in the test extra (click pin)")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("recipe: tiny\ntrain:\n  max_steps: 5\n")
    for kw in ({"nodes": 2, "gpus": "H100:8"}, {"nodes": 1, "image": "reg/trainbox:t", "recipe": str(recipe)}):
        doc = yaml.safe_load(rendered("sky", tmp_path, **kw)["task.yaml"])
        task = sky.Task.from_yaml_config(doc)
        assert task.num_nodes == kw["nodes"]


def test_a_config_file_recipe_travels_in_file_mounts(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("recipe: tiny\ntrain:\n  max_steps: 5\n")
    task = yaml.safe_load(rendered("sky", tmp_path, recipe=str(recipe))["task.yaml"])
    check_schema(tmp_path / "task.yaml")
    assert task["file_mounts"]["/etc/trainbox/mine.yaml"] == str(recipe)
    assert "/etc/trainbox/mine.yaml run.dir=" in task["run"]


def test_launch_sky_cli_writes_the_task_and_refuses_bad_input(tmp_path):
    out = tmp_path / "sky"
    proc = run_cli("launch", "sky", "tiny", "train.max_steps=5", "--nodes", "2", "--gpus", "L4:2", "--bucket",
                   "my-runs", "--out", str(out))
    # both ways to start it name the file written, so either line runs from where the command ran
    assert f"to apply: sky jobs launch --yes --name tiny {out / 'task.yaml'}\n" in proc.stdout
    assert f"or without managed recovery: sky launch -c tiny {out / 'task.yaml'}; dashboard:" in proc.stdout
    task = yaml.safe_load((out / "task.yaml").read_text())
    assert task["resources"]["accelerators"] == "L4:2" and task["file_mounts"]["/trainbox/runs"]["name"] == "my-runs"
    for args, message in [(["--gpus", "H100:0"], "--gpus H100:0: expected NAME or NAME:COUNT"),
                          (["--gpus", "8"], "--gpus 8: expected NAME"),
                          (["--store", "ftp"], "--store ftp: SkyPilot's stores are"),
                          (["--nodes", "0"], "--nodes must be >= 1")]:
        proc = run_cli("launch", "sky", "tiny", *args, "--out", str(tmp_path / "x"), check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli("launch", "k8s", "tiny", "--image", "i:1", "--gpus", "H100:8", "--out", str(tmp_path / "x"),
                   check=False)
    assert proc.returncode == 2 and "--gpus is for launch sky" in proc.stderr, proc.stderr
