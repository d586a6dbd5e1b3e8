"""Async scheduling: the next step is scheduled while this one's forward runs (vLLM v1's
AsyncScheduler). Its parts: scheduler.py, engine_core.py, model_runner.py."""
