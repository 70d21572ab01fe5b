"""The README's tour, executed: every `trainbox ...` line of its code block that can run offline on a CPU
runs here (with tiny sizes appended), in order, in one temp directory, and must exit 0. A line that cannot
run here is in SKIP with the reason; a new tour line fails this test until it runs or is listed."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request

import pytest
from conftest import REPO, TINY, run_cli

# command prefix -> why the line does not run here
SKIP = {
    "pip install": "network: installs packages",
    "trainbox data fineweb": "network: downloads FineWeb shards from the Hugging Face hub",
    "trainbox data download": "network: downloads FineWeb shards from the Hugging Face hub",
    "trainbox train gpt2-125m": "downloads FineWeb (tests/test_data_hub.py runs that against a local server); "
                                "a GPU recipe; fp8_head needs an H100",
    "trainbox train --nproc 8": "eight processes (GPUs) and a data.path left as `...`",
    "trainbox train lora": "network: downloads Qwen/Qwen2.5-0.5B from the hub, and chat.jsonl is the user's",
    "trainbox export runs/lora": "needs the lora run above",
    "trainbox export runs/gpt2-125m": "needs the gpt2-125m run above",
    "trainbox train sft": "needs a local Qwen2.5-0.5B folder and the user's chat.jsonl",
    "trainbox export runs/sft": "needs the sft run above",
    "trainbox chat runs/sft": "needs the sft run above (tests/test_chat_export.py chats with a tiny one in a pipe)",
    "trainbox train dpo": "needs the sft run's export above and the user's prefs.jsonl (tests/test_dpo_train.py runs "
                          "`trainbox train dpo` on a tiny folder)",
    "trainbox train reward": "needs the sft run's export above and the user's prefs.jsonl (tests/test_reward.py runs "
                             "`trainbox train reward` on a tiny folder)",
    "trainbox export runs/reward": "needs the reward run above",
    "trainbox train grpo": "needs the sft run's export above and the user's prompts and reward functions "
                           "(tests/test_grpo.py runs `trainbox train grpo` on a tiny folder)",
    "trainbox train llama-1b": "a GPU recipe on eight GPUs, on the FineWeb download",
    "trainbox train moe-gpt2-125m": "a GPU recipe on two GPUs, on the FineWeb download (tests/test_expert_parallel.py "
                                    "runs expert parallelism under gloo)",
    "docker compose": "needs docker and the image",
    "trainbox launch image": "reads the repository's docker/Dockerfile (tests/test_deploy_registries.py runs this "
                             "command with --dry-run, and its pushes against local registries)",
    "trainbox eval": "network: lm-eval's registry tasks download their data (tests/test_eval.py runs local tasks)",
    "trainbox doctor speedrun-124m": "exits 1 by design where there is no CUDA GPU (speedrun needs one)",
}
# command prefix -> arguments appended so the line runs here, and why
ADAPT = {
    "trainbox launch": (["--dry-run"], "--apply would call kubectl / sbatch: --dry-run renders the files and "
                                       "prints the commands"),
}
# command prefix -> commands that serve until Ctrl-C: started, asked for /status on the URL they print, stopped
SERVE = {"trainbox dashboard": ["--port", "0"]}  # 8080 may be taken on a test machine


def tour_commands() -> list[str]:
    """The commands of the code block under the README's tour heading, `a; b` split, comments dropped."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"^## A five-minute tour\s*\n+```bash\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md: no ```bash block under '## A five-minute tour'"
    commands = []
    for line in m.group(1).splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";")
        lex.whitespace_split = True
        words: list[str] = []
        for tok in lex:
            if tok == ";":
                commands.append(shlex.join(words))
                words = []
            else:
                words.append(tok)
        if words:
            commands.append(shlex.join(words))
    return commands


def _small(words: list[str], cache) -> list[str]:
    """Tiny sizes for a `trainbox train` line: the line's own keys stay, but never its step count. loss.png is
    written, as for the user (TINY leaves it out)."""
    own = {w.split("=", 1)[0] for w in words if "=" in w and not w.startswith("train.max_steps=")}
    extra = [*(o for o in TINY if not o.startswith("monitor.plot=")), f"data.cache_dir={cache}",
             "train.max_steps=4", "train.eval_every=0", "train.checkpoint_every=0"]
    return [o for o in extra if o.split("=", 1)[0] not in own]


@pytest.mark.slow
def test_readme_tour_runs(tmp_path, data_cache):
    from trainbox.data import embedded

    corpus = tmp_path / "my_corpus"  # `prepare my_corpus/`: the user's own text files, enough tokens (~600k)
    corpus.mkdir()  # for one global batch of 480 x 1024 tokens, as the tour's `inspect` line asks
    text = "\n".join(embedded.split("train"))
    text = text * (2_000_000 // len(text) + 1)
    for i in range(40):
        (corpus / f"doc{i:02d}.txt").write_text(text[i * 50_000:(i + 1) * 50_000])

    commands = tour_commands()
    assert any(c.startswith("trainbox train") for c in commands), commands
    ran, skipped = [], []
    for cmd in commands:
        skip = next((p for p in SKIP if cmd == p or cmd.startswith(p + " ")), None)
        if skip:
            skipped.append(cmd)
            continue
        words = shlex.split(cmd)
        assert words[0] == "trainbox", f"tour line {cmd!r} is neither a trainbox command nor in SKIP"
        args = words[1:]
        if args[0] == "train":
            args += _small(args, data_cache)
        for prefix, (extra, _why) in ADAPT.items():
            if cmd.startswith(prefix + " "):
                args += extra
        if any(cmd.startswith(p + " ") for p in SERVE):
            args += next(v for p, v in SERVE.items() if cmd.startswith(p + " "))
            _serve(args, tmp_path)
            ran.append(cmd)
            continue
        proc = run_cli(*args, cwd=tmp_path, check=False, timeout=240)
        assert proc.returncode == 0, (f"tour line `{cmd}` exited {proc.returncode}\n"
                                      f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
        ran.append(cmd)
        if args[0] == "train" and cmd == "trainbox train" and ran.count(cmd) == 2:
            assert "already finished" in proc.stdout + proc.stderr
    assert (tmp_path / "runs" / "tiny" / "loss.png").exists() and (tmp_path / "loss.png").exists()
    assert len(ran) >= 10, ran
    assert set(SKIP) <= {p for p in SKIP for c in skipped if c == p or c.startswith(p + " ")}, \
        "a SKIP entry matches no tour line: remove it"


def _serve(args: list[str], cwd) -> None:
    """Start a serving command, read the URL it prints, check /status answers, stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "trainbox", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "http://" in line, f"trainbox {' '.join(args)} printed no URL: {line}{proc.stderr.read()}"
        url = line[line.index("http://"):].split()[0].rstrip("/")
        with urllib.request.urlopen(url + "/status", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["phase"] == "finished"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
