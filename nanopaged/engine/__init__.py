"""The engine, split as vLLM v1 splits it: the Processor (input side), the
EngineCore and its clients, the OutputProcessor (output side), and the two loops over
them: LLMEngine (synchronous) and AsyncLLM (streaming). The messages, settings and
events they share are the vocabulary at the package root (chapter 14).
"""
