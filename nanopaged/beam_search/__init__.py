"""Beam search: the scheduler forks and prunes beams by cumulative logprob
(`LLM.beam_search`). Its parts: scheduler.py, processor.py, output_processor.py;
messages.py, its request and its hypotheses.

How it joins the base (features.py, the "beam search" row: BeamSearchProcessor
(_beam_sampling_params), BeamSearchOutputProcessor (_request_state, _take_output),
BeamSearchScheduler (_make_group, _request_removed, _needs_output_first, _append_tokens,
_after_update)); the hooks in parentheses. Chapter 10."""
