"""Worker processes: one process per rank (executor.py, worker_proc.py), over one host
or many (multinode.py, headless.py, cluster_auth.py), and the stages' progress board
(stage_progress.py).

How it joins the base (features.py, the "worker processes" row): MultiprocExecutor is
chosen instead of the base's executor when the config asks for more than one rank.
Chapter 17."""
