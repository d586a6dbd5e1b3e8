"""CPU graphs: decode steps replayed without the Python (as CUDA graphs do on a GPU).
Its part: model_runner.py.

How it joins the base (features.py, the "CPU graphs" row: CPUGraphModelRunner
(_forward)); the hooks in parentheses. Chapter 12."""
