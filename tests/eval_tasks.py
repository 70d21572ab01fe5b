"""Local lm-eval tasks for the evaluation tests: task YAMLs and their JSONL data, written into a folder. Nothing is
downloaded: lm-eval reads them through `datasets`' json builder.

    tiny_mc     multiple_choice: a context and four one- or two-word continuations (acc, acc_norm)
    tiny_gen    generate_until: greedy, stopped at "e" or a blank line, at most 10 tokens (exact_match)
    tiny_ppl    loglikelihood_rolling: documents longer than a tiny model's 32 positions (word_perplexity)
    tiny_ll     loglikelihood: contexts and continuations (acc: whether the continuation is the greedy one)
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("king queen lord lady sword crown night day love death heart blood house court war peace thou art "
         "good my sweet fair noble gentle").split()
PROMPTS = ["ROMEO:\nO", "KING HENRY:\nThe crown of", "JULIET:\n", "First Citizen:\nWe are accounted poor",
           "HAMLET:\nTo be, or not", "MENENIUS:\nWhat is the", "LEAR:\nNothing will come of", "GLOUCESTER:\nNow is"]

YAML = {
    "tiny_mc": """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_gen": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["e", "\\n\\n"]
  do_sample: false
  max_gen_toks: 10
metric_list:
  - metric: exact_match
""",
    "tiny_ppl": """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""",
    "tiny_ll": """task: tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
target_delimiter: ""
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
""",
}


def write_tasks(folder: Path, continuations: dict[str, str] | None = None) -> dict[str, Path]:
    """The four tasks' YAMLs and data in `folder` -> {task: its YAML}. `continuations`: context -> continuation for
    tiny_ll (default: two words each)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    rows = {
        "tiny_mc": [{"question": f"{rng.choice(PROMPTS)} the {rng.choice(WORDS)} and the",
                     "choices": [" " + " ".join(rng.sample(WORDS, 1 + (i + k) % 2)) for k in range(4)],
                     "answer": i % 4} for i in range(16)],
        "tiny_gen": [{"prompt": p, "answer": " the"} for p in PROMPTS],
        "tiny_ppl": [{"text": " ".join(rng.choice(WORDS) for _ in range(10 + 25 * i))} for i in range(4)],
        "tiny_ll": [{"context": c, "continuation": t} for c, t in
                    (continuations or {p: " " + " ".join(rng.sample(WORDS, 2)) for p in PROMPTS}).items()],
    }
    out = {}
    for name, docs in rows.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        out[name] = folder / f"{name}.yaml"
        out[name].write_text(YAML[name].format(data=data))
    return out
