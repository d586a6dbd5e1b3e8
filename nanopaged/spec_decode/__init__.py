"""Speculative decoding: cheap proposers guess the next few tokens, and the
rejection sampler keeps the guesses the target model agrees with. Its parts:
scheduler.py, engine_core.py, model_runner.py, the proposers and the rejection sampler;
messages.py, its step messages (the base's with the drafts)."""
