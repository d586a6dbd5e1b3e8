"""Structured outputs: a grammar masks the logits so the text stays in a language
(llguidance). Its parts: manager.py (grammars, masks), scheduler.py, engine_core.py,
model_runner.py; messages.py, its GrammarOutput."""
