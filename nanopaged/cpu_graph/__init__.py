"""CPU graphs: decode steps replayed without the Python (as CUDA graphs do on a GPU).
Its part: model_runner.py."""
