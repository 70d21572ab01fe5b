"""`--help` examples of every verb: two or three real command lines each."""

EPILOGS = {
    "train": """
        examples:
          trainbox train                                   # recipe tiny on the embedded Shakespeare corpus
          trainbox train gpt2-125m data.path=data/fineweb train.max_steps=5000
          trainbox train --nproc 2 tiny train.max_steps=50 # two processes through torchrun
          trainbox train --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 llama-1b train.parallel=fsdp
                                                           # node 0 of two; node 1: the same with --node-rank 1
          trainbox train sft model.path=./Qwen2.5-0.5B data.path=chat.jsonl   # every weight of a Llama / Qwen2
          trainbox train dpo model.path=./Qwen2.5-0.5B data.path=prefs.jsonl  # preference pairs (dpo, ipo, ...)
          trainbox train dpo model.path=./Qwen2.5-0.5B data.path=feedback.jsonl dpo.loss=kto   # unpaired (KTO)
          trainbox train tiny --detach                     # in the background: prints the run directory, the
                                                           # monitor URL and the logs / attach / stop commands
          torchrun --nproc_per_node 8 --signals-to-handle SIGTERM,SIGINT,SIGUSR1 -m trainbox train gpt2-125m
                                                           # on SIGTERM / SIGUSR1 (Slurm --signal) every rank saves
                                                           # and exits 0; torchrun itself then exits 1 (its
                                                           # SignalException); --nproc N exits 0
        """,
    "generate": """
        examples:
          trainbox generate runs/tiny --prompt "ROMEO:" --max-tokens 100 --temperature 0.8 --top-k 50 --seed 1
          trainbox generate runs/tiny/checkpoints/step_00000300 --prompt "To be" --top-p 0.9
          trainbox generate runs/t5-tiny --prompt "To be, or <extra_id_0> to be" --temperature 0   # t5: fills spans
        """,
    "eval": """
        examples:
          trainbox eval runs/gpt2-125m --tasks hellaswag,arc_easy --limit 500   # lm-eval's registry (online)
          trainbox eval runs/tiny --tasks my_tasks/quiz.yaml --batch-size 64    # a local task YAML and its data
          trainbox eval hf/gpt2-125m --tasks lambada_openai --device cuda       # a Hugging Face folder: lm-eval's hf
        """,
    "export": """
        examples:
          trainbox export runs/gpt2-125m --format hf --out hf/gpt2-125m   # newest checkpoint of the run
          trainbox export runs/tiny/checkpoints/step_00000400 --format hf --out hf/tiny --force
          # then: GPT2LMHeadModel.from_pretrained("hf/gpt2-125m"), AutoTokenizer.from_pretrained(...)
          trainbox export runs/lora --format hf --out lora-adapter       # PEFT adapter (PeftModel.from_pretrained)
          trainbox export runs/lora --format hf --merge --out lora-merged  # base + adapter, base precision
          trainbox export runs/qlora --format hf --merge --force --out merged  # QLoRA: merge into a bf16 base
          trainbox export runs/sft --format hf --out tuned   # llama: LlamaForCausalLM / Qwen2ForCausalLM + tokenizer
          trainbox export runs/sft --format hf --dtype bf16 --out tuned-bf16   # then: vllm serve tuned-bf16
          trainbox export runs/sft --format gguf --gguf-type q8_0 --out sft.gguf   # llama.cpp: llama-cli -m sft.gguf
        """,
    "chat": """
        examples:
          trainbox chat runs/sft                                   # type a message, Enter; /reset; Ctrl-D ends
          trainbox chat runs/sft --system "Answer briefly." --temperature 0 --max-tokens 64
          printf 'what is two plus three\\nand four plus one\\n' | trainbox chat runs/sft   # one answer a line
        """,
    "config": """
        examples:
          trainbox config show tiny train.max_steps=50     # the resolved config as YAML
          trainbox config schema                           # every key: type, default, description
          trainbox config schema --json                    # the JSON Schema
          trainbox config validate my_run.yaml             # exit 2 with the offending key if invalid
          trainbox config validate moe-gpt2-125m --nproc 4  # the checks `train --nproc 4` makes here before work
        """,
    "prepare": """
        examples:
          trainbox prepare corpus/ --out data/corpus --workers 4 --val-fraction 0.01
          trainbox prepare pile.jsonl.gz --text-key text --format megatron --append-eod --write-vocab --out data/pile
          trainbox prepare chats.jsonl --tokenizer tok/ --out data/sft --val-docs 100   # loss on assistant tokens only
          trainbox prepare prefs.jsonl --tokenizer model/ --out data/prefs --seq-len 1024 --val-docs 200
                                          # rows with chosen and rejected: pairs for `trainbox train dpo`
          trainbox prepare feedback.jsonl --tokenizer model/ --out data/feedback   # rows with completion and label:
                                          # examples for `trainbox train dpo dpo.loss=kto`
        """,
    "inspect": """
        examples:
          trainbox inspect data/corpus --seq-len 1024 --global-batch 512 --epochs 2
          trainbox inspect data/pile_text_document --seq-len 2048
          trainbox inspect data/fineweb/fineweb_val_000000.bin --json
        """,
    "data": """
        examples:
          trainbox data download gpt2-125m                          # what `trainbox train gpt2-125m` reads
          trainbox data download speedrun-124m train.max_steps=100  # fewer steps, fewer shards
          trainbox data fineweb --shards 8 --out data/fineweb       # 800M GPT-2 tokens + the val shard
          HF_ENDPOINT=http://mirror:8080 trainbox data fineweb --shards 2 --out data/fineweb

        Ctrl-C (exit 130) or SIGTERM (exit 143) stops a download and keeps its .part file; the same command
        continues it from there.
        """,
    "tokenizer": """
        examples:
          trainbox tokenizer train corpus/*.txt --vocab-size 4096 --out tok/
          trainbox tokenizer train embedded:shakespeare --vocab-size 2048 --out tok/
        """,
    "launch": """
        examples:
          trainbox launch compose gpt2-125m --image ghcr.io/me/trainbox:0.1.0-cu130-torch2.11.0 --gpus-per-node 8
          trainbox launch k8s gpt2-125m train.max_steps=5000 --image IMG --nodes 2 --gpus-per-node 8 --apply
          trainbox launch slurm gpt2-125m --nodes 4 --gpus-per-node 8 --partition gpu --time 48:00:00
          trainbox launch sky gpt2-125m --nodes 2 --gpus H100:8 --bucket my-runs
          trainbox launch image --push --registries regions.yaml --tag v1 --dry-run   # one digest, every region
          trainbox launch k8s gpt2-125m --image trainbox:v1 --registries regions.yaml --region us-east-1
        """,
    "plan": """
        examples:
          trainbox plan gpt2-125m --gpu H100                # memory per GPU by component, and the verdict
          trainbox plan moe-gpt2-125m model.moe.num_experts=128 --gpu H100 --nproc 2   # does not fit: what would
          trainbox plan gpt2-125m train.parallel=fsdp --nproc 2 --json                  # this machine's GPUs, JSON
        """,
    "doctor": """
        examples:
          trainbox doctor                                  # this machine: torch, GPUs, bf16, caches, disk
          trainbox doctor speedrun-124m                    # exit 1 if something that recipe needs is missing
          trainbox doctor gpt2-125m data.path=/data/fineweb --json
        """,
    "runs": """
        examples:
          trainbox runs                                    # every run under ./runs, newest first
          trainbox runs /data/experiments --json           # machine-readable, one object per run
        """,
    "logs": """
        examples:
          trainbox logs tiny                               # runs/tiny/train.log
          trainbox logs runs/gpt2-125m -f                  # follow until the run ends
          trainbox logs tiny --tail 20
        """,
    "attach": """
        prints train.log and follows it until the run ends (like `trainbox logs RUN -f`), then its state;
        Ctrl-C leaves the run going.
        examples:
          trainbox attach tiny                             # runs/tiny, e.g. after `trainbox train tiny --detach`
          trainbox attach runs/gpt2-125m --tail 20
        """,
    "stop": """
        SIGTERM to the run's process (for `train --nproc N`, its launcher, which forwards it to every rank):
        every rank saves a checkpoint at the next step boundary and exits; then waits (--timeout) and prints
        "stopped at step N". The same train command resumes it. Exit status: 0 when stopped or already
        finished; 1 when it is not running (crashed, failed or stopped before), still running after
        --timeout, or runs on another host (stop it there).
        examples:
          trainbox stop tiny                               # runs/tiny: graceful, waits up to 600 s
          trainbox stop runs/gpt2-125m --timeout 120 --now # SIGKILL if not gone after 120 s
          trainbox stop tiny --now --timeout 0             # SIGKILL at once (resumes from the last checkpoint)
        """,
    "status": """
        exit status 0 when healthy (running with fresh progress, or finished), 1 otherwise, with one
        line saying why: Docker HEALTHCHECK and Kubernetes exec probes call it.
        examples:
          trainbox status tiny                             # from runs/tiny/status.json (+ pid check)
          trainbox status http://127.0.0.1:8080            # asks the run's /health endpoint
          HEALTHCHECK CMD ["trainbox", "status", "http://127.0.0.1:8080"]
        """,
    "plot": """
        examples:
          trainbox plot runs/tiny                          # writes loss.png in the current folder
          trainbox plot runs/a runs/b --out compare.png    # train and val loss vs steps and vs tokens
        """,
    "dashboard": """
        the same page and endpoints (/status /history /metrics /health) as a live run's monitor, filled
        from the run's status.json and metrics.jsonl and refreshed when they change; Ctrl-C stops it.
        A token protects it as monitor.token protects a live run: every endpoint but /health needs
        'Authorization: Bearer TOKEN' (a browser opens /?token=TOKEN once). A run trained with monitor.token
        is served only with one, on any host; its files do not record the run's token, so the token given is
        the one asked for. TRAINBOX_OVERRIDES='monitor.token=TOKEN' gives it without showing it in the process
        list, as it does for `trainbox train`.
        examples:
          trainbox dashboard tiny                          # http://127.0.0.1:8080/ (a free port if busy)
          trainbox dashboard runs/wider --port 8090
          TRAINBOX_OVERRIDES='monitor.token=SECRET' trainbox dashboard guarded --host 0.0.0.0
        """,
}
