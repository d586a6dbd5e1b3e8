"""Pipeline parallelism (GPipe): the layers split into stages, one per rank, the hidden
states passed from stage to stage. Its parts: scheduler.py, engine_core.py,
model_runner.py, stage_model.py, hop.py (what passes between stages, and how); the grid
of ranks is the base's (layers/groups.py)."""
