"""The model: Llama over a flat token batch, and finding, fetching and converting
model folders (chapter 05).
"""
