"""Beam search: the scheduler forks and prunes beams by cumulative logprob
(`LLM.beam_search`). Its parts: scheduler.py, processor.py, output_processor.py;
messages.py, its request and its hypotheses."""
