"""Beam search: the scheduler forks and prunes beams by cumulative logprob
(`LLM.beam_search`). Its part: scheduler.py."""
