"""The run directory (`run.dir/NAME`) and the processes that own it: its lock (lock.py), status.json and the one
health rule (status.py), env.json, the list of runs, their state and the process `trainbox stop` signals
(runs.py). Nothing here knows the training loop: the loop writes these files (train/run_files.py), `runs`,
`status`, `logs` and `stop` read them."""
