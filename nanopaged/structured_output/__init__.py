"""Structured outputs: a grammar masks the logits so the text stays in a language
(llguidance). Its parts: manager.py (grammars, masks), scheduler.py, engine_core.py,
model_runner.py; messages.py, its GrammarOutput.

How it joins the base (features.py, the "structured outputs" row:
StructuredOutputProcessor (_check_structured_outputs), StructuredOutputScheduler
(_make_group, _request_removed, _num_tokens_allowed, _after_schedule, _check_stop),
StructuredOutputEngineCore (_deferred_sampling), StructuredOutputModelRunner
(_sample_step, _compute_logits)); the hooks in parentheses. Chapter 18."""
