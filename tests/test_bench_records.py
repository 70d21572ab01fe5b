"""benchmarks/records/ in the one result schema (benchmarks/common.py), the parity tools reading their records back,
the benchmarks' imports, and docs/performance.md as benchmarks/report.py writes it from the records."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
RECORDS = BENCH / "records"
DOC = REPO / "docs" / "performance.md"


@pytest.mark.parametrize("path", sorted(RECORDS.iterdir()), ids=lambda p: p.name)
def test_record_fits_the_schema(path):
    """Every file is a JSON record with exactly the schema's fields and types, named DATE-HARDWARE-WHAT.json after
    its own date, GPU and slug; a superseded record names a record that exists."""
    common = load_benchmark("common")
    assert path.suffix == ".json", f"{path.name}: records are single JSON files"
    record = json.loads(path.read_text())
    assert common.validate(record, path.name) == []
    if record["superseded_by"]:
        assert (RECORDS / record["superseded_by"]).is_file()


def test_schema_refuses_old_shapes_and_names(tmp_path):
    common = load_benchmark("common")
    old = {"date": "2026-11-26", "gpu": "NVIDIA H100 80GB HBM3", "command": "python benchmarks/x.py",
           "result": {"step_ms": 1.0}}
    problems = common.validate(old)
    assert "missing field 'tool'" in problems and "unknown field 'result'" in problems
    result = common.Result(date="2026-11-27", tool="train_speed", what="gpt2-125m-train-speed",
                           gpu={"name": "NVIDIA H200", "count": 2}, torch="2.11.0", commit="0" * 40, dirty=False,
                           recipe="gpt2-125m", metrics={"median_step_ms": 800.0},
                           baseline={"name": "nanoGPT train.py", "command": None, "metrics": {}})
    first, second = common.write(result, tmp_path), common.write(result, tmp_path)
    assert (first.name, second.name) == ("2026-11-27-2xh200-gpt2-125m-train-speed.json",
                                        "2026-11-27-2xh200-gpt2-125m-train-speed-2.json")
    for path in (first, second):
        assert common.validate(json.loads(path.read_text()), path.name) == []
    record = result.to_dict()
    assert common.validate(record, "2026-11-27-session15.json")
    assert common.validate(record, "2026-11-27-h100-gpt2-125m-train-speed.json")   # the hardware is 2x H200
    assert common.validate({**record, "what": "session-15"})
    assert common.validate({**record, "commit": "aca80fc"})
    assert common.validate({**record, "baseline": {"name": "nanoGPT"}})
    assert common.hardware(None) == "cpu" and common.hardware({"name": "NVIDIA H100 80GB HBM3", "count": 1}) == "h100"


def test_parity_tools_read_their_records():
    """The per-seed runs kept in records are what loss_parity.py and step_parity.py --results read."""
    loss_parity, step_parity, common = (load_benchmark(n) for n in ("loss_parity", "step_parity", "common"))
    runs = loss_parity.read_results([str(RECORDS / "2026-11-27-h100-gpt2-125m-loss-parity.json"),
                                     str(RECORDS / "2026-11-27-2xh200-gpt2-125m-loss-parity.json")])
    assert [r["who"] for r in runs].count("trainbox") == 7 and [r["who"] for r in runs].count("nanogpt") == 6
    assert loss_parity.summary(runs)["verdict"] == "inconclusive"
    record = RECORDS / "2026-11-27-4xh200-gpt2-125m-step-parity.json"
    paired = step_parity.summary([r for _, r in common.read_runs([str(record)])])["val_minus_nanogpt"]["trainer"]
    assert paired["n"] == 8 and paired["verdict"] == "no worse"
    assert paired == json.loads(record.read_text())["metrics"]["summary"]["val_minus_nanogpt"]["trainer"]


def test_resume_check_reads_the_steps_after_the_cut_from_its_record():
    """resume_check.py's comparison, recomputed from the curves its GPU record keeps, equals the record's."""
    resume_check = load_benchmark("resume_check")
    m = json.loads((RECORDS / "2026-11-27-2xh200-llama-1b-fsdp-resume-2-to-1.json").read_text())["metrics"]
    after = range(m["cut"] + 1, m["steps"] + 1)
    got = resume_check.compare(dict(zip(after, m["straight"])), dict(zip(after, m["resumed"])), m["cut"], m["steps"])
    for key, value in got.items():   # (approx takes no lists inside a mapping on newer pytest)
        assert value == pytest.approx(m[key]), key
    assert 0 < got["max_abs_diff"] < 0.01 * got["step_to_step_change"]
    with pytest.raises(SystemExit, match="no step after the cut"):
        resume_check.compare({1: 1.0, 2: 1.0}, {1: 1.0, 2: 1.0}, 2, 4)


def test_benchmarks_import_public_names_and_only_common():
    """A benchmark imports trainbox's public names only, and of its neighbours only common.py."""
    tools = {p.stem for p in BENCH.glob("*.py")}
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:
                top = module.split(".")[0]
                assert top not in tools - {"common"}, f"{path.name} imports the benchmark {module}"
                if top == "trainbox":
                    assert not any(p.startswith("_") for p in module.split(".")), f"{path.name}: {module}"
                    assert not (name or "").startswith("_"), f"{path.name}: {module}.{name}"


def test_performance_doc_is_what_the_records_give(tmp_path):
    out = tmp_path / "performance.md"
    subprocess.run([sys.executable, str(BENCH / "report.py"), "--out", str(out)], check=True, timeout=120)
    assert DOC.read_text() == out.read_text(), "docs/performance.md is stale: run python benchmarks/report.py"
