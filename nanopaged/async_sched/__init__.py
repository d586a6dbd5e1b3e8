"""Async scheduling: the next step is scheduled while this one's forward runs (vLLM v1's
AsyncScheduler). Its parts: scheduler.py, engine_core.py, model_runner.py.

How it joins the base (features.py, the "async scheduling" row: AsyncScheduler
(_request_removed, _schedulable, _num_pending_tokens, _may_fit_later, _after_schedule,
_count_computed, _append_tokens), AsyncEngineCore, AsyncModelRunner (_after_sample));
the hooks in parentheses. Chapter 16."""
