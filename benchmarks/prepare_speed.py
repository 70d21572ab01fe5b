"""Tokens/s of `trainbox prepare` (1 and 2 workers) against a plain single-process tiktoken loop.

    PYTHONPATH=src python benchmarks/prepare_speed.py            # ~50 MB of text, prints JSON
    PYTHONPATH=src python benchmarks/prepare_speed.py --mb 10 --record
    PYTHONPATH=src python benchmarks/prepare_speed.py --tokenizer embedded:shakespeare-bpe --record

The text is assembled locally from the embedded Shakespeare corpus: paragraphs of every work, shuffled
with a different seed for each copy, grouped into ~8 KB documents of one JSONL file, until the file holds
--mb megabytes. `prepare` is timed end to end as a user runs it (`python -m trainbox prepare`: start-up,
reading and parsing the JSONL, tokenizing, writing the shards). The baseline is the loop a user would
write first: `enc.encode_ordinary(text)` for each document already in memory, one process (with --tokenizer
naming a tokenizer.json: `tokenizers`' `encode(text).ids`, special-token strings as text). The target (GPT-2): 2
workers >= 1.9x the plain loop. Wall-clock ratios need a quiet machine with 2 free cores; the CPU seconds of each
run are printed too, as they do not depend on other load. The result record (common.Result, the plain loop its
baseline) follows the JSON; --record also writes it to benchmarks/records/.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np


def assemble(path: Path, megabytes: float, doc_bytes: int = 8192) -> int:
    from trainbox.data import embedded

    paragraphs = [p for text in embedded.works().values() for p in text.split("\n\n") if p.strip()]
    target, written, docs, seed = int(megabytes * 1e6), 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            order = np.random.default_rng(seed).permutation(len(paragraphs))
            seed += 1
            doc: list[str] = []
            size = 0
            for i in order:
                doc.append(paragraphs[i])
                size += len(paragraphs[i])
                if size >= doc_bytes:
                    line = json.dumps({"text": "\n\n".join(doc)}, ensure_ascii=False) + "\n"
                    f.write(line)
                    written += len(line.encode("utf-8"))
                    docs += 1
                    doc, size = [], 0
                    if written >= target:
                        break
    return docs


def plain_loop(path: Path, spec: str = "gpt2") -> tuple[int, float, float]:
    from trainbox.data.tokenizer import get_tokenizer

    tok = get_tokenizer(spec)
    if spec == "gpt2":
        encode = tok.enc.encode_ordinary
    else:   # `tokenizers` through the attribute every version has: special-token strings are text, as in prepare
        tok.tok.encode_special_tokens = True
        encode = lambda text: tok.tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    texts = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(encode(t)) + 1 for t in texts)  # +1: the EOT prepare adds per document
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_prepare(path: Path, out: Path, workers: int, spec: str = "gpt2") -> tuple[float, float]:
    """-> (wall seconds, CPU seconds of the command and its worker processes)."""
    cmd = [sys.executable, "-m", "trainbox", "prepare", str(path), "--out", str(out), "--workers", str(workers),
           "--tokenizer", spec, "--quiet", "--overwrite"]
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start, _children_cpu() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0, help="megabytes of JSONL text")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest is reported")
    ap.add_argument("--tokenizer", default="gpt2", help="prepare's --tokenizer (gpt2, or a tokenizer.json)")
    ap.add_argument("--record", action="store_true", help="write the result record to benchmarks/records/")
    args = ap.parse_args()
    gpt2 = args.tokenizer == "gpt2"
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        data = tmp / "text.jsonl"
        docs = assemble(data, args.mb)
        one_doc = tmp / "one.jsonl"   # prepare's fixed cost: start-up, tokenizer, manifest
        one_doc.write_text(data.open(encoding="utf-8").readline(), encoding="utf-8")
        # best of --repeat runs each, interleaved, so a burst of other load hits all of them alike
        plain_runs, runs, fixed = [], {1: [], 2: []}, []
        for _ in range(args.repeat):
            plain_runs.append(plain_loop(data, args.tokenizer))
            for w in (1, 2):
                runs[w].append(run_prepare(data, tmp / f"w{w}" / "x", w, args.tokenizer))
            fixed.append(run_prepare(one_doc, tmp / "one" / "x", 2, args.tokenizer))
        tokens, plain_s, plain_cpu = min(plain_runs, key=lambda r: r[1])
        runs = {w: min(r) for w, r in runs.items()}
        times = {w: r[0] for w, r in runs.items()}
        written = sum(len(np.memmap(f, dtype=np.uint16, mode="r", offset=1024)) for f in (tmp / "w2").glob("*.bin"))
        same = all((tmp / "w1" / f.name).read_bytes() == f.read_bytes() for f in (tmp / "w2").glob("*.bin"))
        plain, one, two = tokens / plain_s, tokens / times[1], tokens / times[2]
        result = {
            "text_mb": round(data.stat().st_size / 1e6, 1), "documents": docs, "tokens": tokens, "repeat": args.repeat,
            "tokens_written": written, "outputs_identical_1_vs_2_workers": same,
            "tokenizer": args.tokenizer,
            ("plain_tiktoken_encode_ordinary_tokens_per_s" if gpt2 else "plain_tokenizers_encode_tokens_per_s"):
                round(plain),
            "prepare_1_worker_tokens_per_s": round(one), "prepare_2_workers_tokens_per_s": round(two),
            "ratio_1_worker_vs_plain": round(one / plain, 3), "ratio_2_workers_vs_plain": round(two / plain, 3),
            "ratio_2_vs_1_workers": round(two / one, 3), **({"target_2_workers_vs_plain": 1.9} if gpt2 else {}),
            # CPU seconds spent (all processes): the work done, independent of other load on the machine
            "cpu_s_plain": round(plain_cpu, 2), "cpu_s_prepare_1_worker": round(runs[1][1], 2),
            "cpu_s_prepare_2_workers": round(runs[2][1], 2),
            # CPU seconds / wall seconds: the cores a run actually got (2.0 at best on a quiet 2-core machine)
            "cores_used_plain": round(plain_cpu / plain_s, 2),
            "cores_used_prepare_1_worker": round(runs[1][1] / runs[1][0], 2),
            "cores_used_prepare_2_workers": round(runs[2][1] / runs[2][0], 2),
            # an upper bound for 2 free cores: all CPU work of the 2-worker run spread evenly (start-up is serial)
            "upper_bound_ratio_2_workers_vs_plain_on_2_free_cores": round(plain_cpu / (runs[2][1] / 2), 3),
            # prepare of one document: the fixed cost in every run (start-up, tokenizer, writing the manifest); with
            # the plain loop's tokenizing split over 2 cores after it, the best ratio is plain / (fixed + plain / 2)
            "prepare_one_document_s": round(min(fixed)[0], 3), "cpu_s_prepare_one_document": round(min(fixed)[1], 2),
            "ratio_2_workers_vs_plain_if_only_the_fixed_cost_were_serial": round(
                plain_s / (min(fixed)[0] + plain_s / 2), 3),
            "peak_rss_mib_any_process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
            "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(result, indent=1))
    name = ("plain tiktoken encode_ordinary loop, one process" if gpt2 else
            f"plain `tokenizers` encode loop ({args.tokenizer}), one process")
    what = "prepare-speed" if gpt2 else "prepare-speed-" + "".join(c if c.isalnum() else "-" for c in args.tokenizer)
    common.emit(common.Result(
        tool="prepare_speed", what=what, metrics=result,
        baseline={"name": name, "command": None,
                  "metrics": {"tokens_per_s": round(plain), "cpu_s": result["cpu_s_plain"]}}),
        args.record)


if __name__ == "__main__":
    main()
