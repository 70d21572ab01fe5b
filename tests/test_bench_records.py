"""benchmarks/records/ in the one result schema (benchmarks/common.py), the parity tools reading their records back,
the benchmarks' imports, and docs/performance.md as benchmarks/report.py writes it from the records."""
from __future__ import annotations

import ast
import json
import re
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


# How a GPU was obtained is no fact about a result: which machine type was asked for, a machine held or lent, the
# tool's calls and sessions. A record says which hardware ran (the GPU torch reports) and which software.
HOW_OBTAINED = re.compile("|".join([
    r"\basked for\b", r"\bnvidia-h[0-9]{3}\b", r"\bkind nvidia",
    r"\b(held|warm|lent|leased) (machine|host|node|gpus?)\b", r"\blease\b", r"\blent\b",
    r"\bdevice (tool|copy|budget|time)\b", r"\bsessions?\b", r"\bheld_s\b", r"\bbudget_left", r"\bgiven? back\b",
    r"\b(same|next|previous|earlier|another) call\b", r"\bcall's\b", r"\bcalls? [0-9A-Z]\b",
]), re.IGNORECASE)


def _texts(value, where=""):
    """(where, text) of every key and string value in a record."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{where}.{k} (key)", k
            yield from _texts(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _texts(v, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


@pytest.mark.parametrize("path", sorted(RECORDS.iterdir()), ids=lambda p: p.name)
def test_record_says_what_ran_not_how_the_machine_was_had(path):
    found = [f"{where}: {m.group(0)!r}" for where, text in _texts(json.loads(path.read_text()))
             for m in HOW_OBTAINED.finditer(text)]
    assert found == [], f"{path.name}: {found}"


def test_how_obtained_words_are_caught_and_hardware_facts_are_not():
    caught = ["2x H200 of one held machine (asked for nvidia-h100-x2).", "4x NVIDIA H200 (nvidia-h100-x4 asked for)",
              "the device copy reported the session's starting HEAD as dirty", "both runs in the same call",
              "torchtitan ran in the next call", "call A: 200 steps", "kind nvidia-h200-x4", "on a warm machine",
              "the lease ran out", "GPUs lent for an hour", "held_s 812"]
    kept = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "nvidia-cutlass-dsl 4.8.1, cu13", "nvidia-nccl-cu12",
            "learning-rate warm-up 20 steps", "--warmup 8", "model.window_warmup_steps=0", "held-out validation plays",
            "one call of f per repetition", "4x H200 of one host, back to back", "excellent", "calls the kernel",
            "2x H200 host, run next on the same host"]
    assert [t for t in caught if not HOW_OBTAINED.search(t)] == []
    assert [t for t in kept if HOW_OBTAINED.search(t)] == []


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


def test_each_row_comes_from_the_newest_record_that_has_it():
    """dpo_speed measures its modes and the longest sequence in one call or apart: a newer record of the speeds
    replaces the older record's speed rows and leaves its longest-sequence row; NAME-2.json is newer than NAME.json
    of the same day; a superseded record shows nothing."""
    report = load_benchmark("report")
    both = json.loads((RECORDS / "2026-11-28-h200-dpo-0.5b-speed.json").read_text())
    speeds = {**json.loads((RECORDS / "2026-11-28-h200-dpo-0.5b-speed-3.json").read_text()),
              "superseded_by": None}   # (superseded since: here it stands for a newer record of the same day)
    assert both["metrics"]["longest_ours"] and "longest_ours" not in speeds["metrics"]
    records = [(Path("x-speed.json"), both), (Path("x-speed-2.json"), speeds)]
    rows = {row[0]: path.name for path, _, row in report.newest_rows(report.current(records))}
    assert rows == {" (full)": "x-speed-2.json", " (lora)": "x-speed-2.json",
                    " (longest sequence, full DPO of 1B, one GPU)": "x-speed.json"}
    gone = [(Path("x-speed.json"), {**both, "superseded_by": "x-speed-2.json"}), (Path("x-speed-2.json"), speeds)]
    assert {row[0] for _, _, row in report.newest_rows(report.current(gone))} == {" (full)", " (lora)"}
