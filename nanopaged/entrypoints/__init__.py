"""The entry layer: `LLM` (offline batches), the chat REPL, `AsyncLLM` (streaming),
the OpenAI-compatible server, and the tracer. They turn user requests into
engine requests and nothing else (chapters 07, 13, 15).
"""
