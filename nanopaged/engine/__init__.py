"""The engine, split as vLLM v1 splits it: the Processor (input side), the
EngineCore and its clients, the OutputProcessor (output side), the loop over
them (LLMEngine), and the messages, settings and events they share (chapter 14).
"""
