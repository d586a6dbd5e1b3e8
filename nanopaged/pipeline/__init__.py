"""Pipeline parallelism (GPipe): the layers split into stages, one per rank, the hidden
states passed from stage to stage. Its parts: scheduler.py, engine_core.py,
model_runner.py, stage_model.py, hop.py (what passes between stages, and how); the grid
of ranks is the base's (layers/groups.py).

How it joins the base (features.py, the "pipeline parallelism" row: PipelineScheduler
(_schedulable, _after_schedule), PipelineEngineCore, PipelineModelRunner (_forward,
_after_forward, _profile_forward), PipelineStageModel); the hooks in parentheses.
Chapter 20."""
