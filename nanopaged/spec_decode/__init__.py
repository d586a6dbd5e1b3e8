"""Speculative decoding: cheap proposers guess the next few tokens, and the
rejection sampler keeps the guesses the target model agrees with. Its parts:
scheduler.py, engine_core.py, model_runner.py, the proposers and the rejection sampler;
messages.py, its step messages (the base's with the drafts).

How it joins the base (features.py, the "speculative decoding" row: SpecDecodeScheduler
(_request_removed, _append_slots, _allocate, _after_schedule, _computed, _append_tokens,
_after_update), SpecDecodeEngineCore, SpecDecodeWorker (_load_extra_models),
SpecDecodeModelRunner (_token_ids, _sampled_rows, prepare_inputs, _move_blocks, _sample,
_after_sample)); the hooks in parentheses. Chapter 19."""
