"""Generation engine: model loading, slot KV memory, continuous batching, warmup.

Importing the package imports nothing heavy: the detokenizer step imports `engine.detokenize`
inside a numpy<2 text environment that cannot import torch or transformers.
"""
