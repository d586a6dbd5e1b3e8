"""Worker processes: one process per rank (executor.py, worker_proc.py), over one host
or many (multinode.py, headless.py, cluster_auth.py), and the stages' progress board
(stage_progress.py)."""
