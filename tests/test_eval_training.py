"""train.eval_tasks: lm-eval tasks run while training, on rank 0. Their scores go to metrics.jsonl, RUN/eval/,
/status, /history, Prometheus and the dashboard's chart, equal to `trainbox eval` of the same checkpoint; a task that
cannot run is reported once and the run goes on; what cannot work is refused before any work."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from types import SimpleNamespace

import pytest
from conftest import REPO, TINY, run_cli
from eval_tasks import YAML, write_tasks
from test_monitor import _chromium


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A tiny run of 4 steps with dropout and tasks every 2 steps: two that run, a YAML that does not parse, a task
    whose data file is missing, and one whose fourth document lacks its choices (it loads, then fails inside
    lm-eval's evaluation)."""
    root = tmp_path_factory.mktemp("tasks")
    tasks = write_tasks(root / "tasks")
    bad = root / "tasks" / "bad.yaml"
    bad.write_text("task: [tiny_bad\n")
    nodata = root / "tasks" / "nodata.yaml"
    nodata.write_text(YAML["tiny_mc"].format(data=root / "missing.jsonl").replace("task: tiny_mc", "task: tiny_nodata"))
    rows = [json.loads(line) for line in (root / "tasks" / "tiny_mc.jsonl").read_text().splitlines()]
    del rows[3]["choices"]
    (root / "broken.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    broken = root / "tasks" / "broken.yaml"
    broken.write_text(YAML["tiny_mc"].format(data=root / "broken.jsonl").replace("task: tiny_mc", "task: tiny_broken"))
    good = [str(tasks["tiny_mc"]), str(tasks["tiny_gen"])]
    specs = ",".join([*good, str(bad), str(nodata), str(broken)])
    run_cli("train", "tiny", *TINY, f"run.dir={root / 'runs'}", f"data.cache_dir={data_cache}", "run.name=t",
            "train.max_steps=4", "train.sample_tokens=0", "model.dropout=0.1", f"train.eval_tasks=[{specs}]",
            "train.eval_tasks_every=2", "train.eval_tasks_limit=6")
    return SimpleNamespace(run=root / "runs" / "t", good=good, root=root)


def _losses(run) -> list[float]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["loss"] for e in events if e["event"] == "train"]


def test_the_tasks_leave_training_unchanged(trained, tmp_path, data_cache):
    """lm-eval seeds python's, numpy's and torch's generators: with dropout, a run whose evaluations left them
    seeded would draw other masks after step 2. The same run without tasks has the same losses, bit for bit."""
    run_cli("train", "tiny", *TINY, f"run.dir={tmp_path}", f"data.cache_dir={data_cache}", "run.name=t",
            "train.max_steps=4", "train.sample_tokens=0", "model.dropout=0.1")
    assert len(_losses(trained.run)) == 4 and _losses(trained.run) == _losses(tmp_path / "t")


def test_scores_are_logged_recorded_and_equal_to_trainbox_eval(trained, tmp_path):
    run = trained.run
    log = (run / "train.log").read_text()
    assert log.count("bad.yaml is left out") == 1 and "is not readable YAML" in log, log
    assert log.count("tiny_nodata is left out") == 1 and "tiny_nodata cannot be loaded" in log, log
    assert log.count("tiny_broken is left out") == 1, log   # failed inside the evaluation at step 2, then left out
    assert "step 4/4" in log and "eval tasks step 4: tiny_mc/acc" in log
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval_tasks"]
    assert [e["step"] for e in evals] == [2, 4]
    assert set(evals[0]["scores"]) == {"tiny_mc/acc", "tiny_mc/acc_norm", "tiny_gen/exact_match"}
    records = [json.loads(p.read_text()) for p in sorted((run / "eval").glob("*.json"))]
    assert [r["trainbox"]["step"] for r in records] == [2, 4]
    assert all(r["results"]["tiny_mc"]["sample_len"] == 6 for r in records)   # train.eval_tasks_limit
    # the same checkpoint, scored afterwards by the command
    run_cli("eval", str(run / "checkpoints" / "step_00000004"), "--tasks", ",".join(trained.good), "--limit", "6",
            "--out", str(tmp_path))
    offline = json.loads(next(tmp_path.glob("*.json")).read_text())["trainbox"]["scores"]
    assert offline == records[-1]["trainbox"]["scores"]
    assert {f"{t}/{m}": v for t, ms in offline.items() for m, v in ms.items()} == evals[-1]["scores"]


def _get(url: str, accept: str = "*/*") -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as r:
        return r.read()


def test_dashboard_status_and_prometheus_show_the_scores(trained, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "trainbox", "dashboard", str(trained.run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line[line.index("http://"):].split()[0].rstrip("/")
        status = json.loads(_get(url + "/status"))
        latest = json.loads(sorted((trained.run / "eval").glob("*.json"))[-1].read_text())["trainbox"]
        assert status["eval_tasks"]["step"] == 4 and status["eval_tasks"]["scores"] == latest["scores"]
        history = json.loads(_get(url + "/history"))
        assert [p["step"] for p in history if "eval_tasks" in p] == [2, 4]
        prom = _get(url + "/metrics", "text/plain;version=0.0.4").decode()
        acc = latest["scores"]["tiny_mc"]["acc"]
        assert re.search(r'trainbox_eval_task_score\{metric="acc",run="t",task="tiny_mc"\} ' + re.escape(str(acc)),
                         prom), prom
        assert 'trainbox_eval_task_step{run="t"} 4.0' in prom
        dom = _chromium(url + "/", tmp_path / "profile", "--dump-dom").stdout
        points = dict(re.findall(r'<canvas id="chart-(\w+)" data-points="(\d+)"', dom))
        assert points["tasks"] == "6", dom[:3000]   # three scores at two steps
        assert '<figure id="fig-tasks">' in dom and "tiny_mc acc @4" in dom
        shot = REPO / "test-artifacts" / "dashboard-eval-tasks.png"
        shot.parent.mkdir(exist_ok=True)
        _chromium(url + "/", tmp_path / "profile-shot", f"--screenshot={shot}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_what_cannot_work_is_refused_before_any_work(tmp_path):
    base = ["config", "validate", "tiny", "train.eval_tasks=[hellaswag]", "optim.name=adamw"]  # Muon: no fsdp, no EP
    proc = run_cli(*base, "train.parallel=fsdp", "--nproc", "2", check=False)
    assert proc.returncode == 2 and "train.eval_tasks runs lm-eval on rank 0 alone" in proc.stderr, proc.stderr
    assert "under train.parallel=fsdp on 2 processes" in proc.stderr
    proc = run_cli(*base, "model.family=moe", "model.moe.expert_parallel=2", "--nproc", "2", check=False)
    assert proc.returncode == 2 and "under model.moe.expert_parallel=2" in proc.stderr, proc.stderr
    proc = run_cli(*base, "model.family=t5", check=False)
    assert proc.returncode == 2 and "model.family=t5 has none" in proc.stderr, proc.stderr
    code = ("import sys; sys.modules['lm_eval'] = None; from trainbox.cli import main; "
            "sys.exit(main(['config', 'validate', 'tiny', 'train.eval_tasks=[hellaswag]']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train.eval_tasks needs lm-eval" in proc.stderr, proc.stderr
    assert "pip install 'trainbox[eval]'" in proc.stderr
    assert run_cli(*base, "train.parallel=fsdp").returncode == 0   # one process: the whole model on rank 0
