"""Evaluation on lm-eval's tasks: trainbox adapts its models to lm-eval's model interface; lm-eval owns the tasks,
prompts and metrics.

    adapter.py   TrainboxLM: loglikelihood, loglikelihood_rolling and generate_until on our models and KV cache
    tasks.py     task names, wildcards and task YAML files resolved by lm-eval's TaskManager
    harness.py   `trainbox eval`: checks before any work, lm-eval's simple_evaluate, the record in RUN/eval/
    results.py   the record (RUN/eval/<time>.json) and its score summary
    training.py  train.eval_tasks: the tasks run at intervals while training, on rank 0

lm-eval is the `eval` extra (`pip install 'trainbox[eval]'`); only adapter.py and tasks.py import it, and they are
imported where lm-eval is needed, so the rest of trainbox runs without it.
"""
