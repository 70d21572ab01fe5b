"""benchmarks/eval_speed.py makes the loglikelihood requests of its local task itself, so that it runs without the
packages lm-eval's tasks load (datasets): they must be the requests lm-eval's own task makes from the same YAML."""
from __future__ import annotations

from conftest import load_benchmark
from lm_eval.tasks import TaskManager, get_task_dict


def test_the_requests_are_those_lm_evals_task_makes_from_its_yaml(tmp_path):
    eval_speed = load_benchmark("eval_speed")
    docs = eval_speed.write_task(tmp_path, 12, context=30, ending=8)
    ours = eval_speed.requests(docs[:5]) + eval_speed.requests(docs[5:], first_id=5)
    task = get_task_dict(["synthetic_mc"], TaskManager(include_path=str(tmp_path), include_defaults=False))
    task = task["synthetic_mc"]
    task.build_all_requests(rank=0, world_size=1)
    theirs = sorted(task.instances, key=lambda r: (r.doc_id, r.idx))
    assert len(theirs) == len(ours) == 4 * len(docs)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.request_type, a.arguments, a.doc_id, a.idx) == (b.request_type, b.arguments, b.doc_id, b.idx)
        assert a.doc == b.doc and a.task_name == b.task_name
    assert [d["label"] for d in docs] == [task.doc_to_target(d) for d in task.test_docs()]
