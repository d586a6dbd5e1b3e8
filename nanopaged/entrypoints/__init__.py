"""The entry layer: `LLM` (offline batches), the chat REPL and the OpenAI-compatible
server (openai/, on the engine's `AsyncLLM`). They turn user requests into engine requests
and nothing else (chapters 07, 15).
"""
