"""tritonclient gRPC streaming client for the `llm` ensemble: one-shot `generate` and `StreamingSession`."""

from client.generate import GenerationError, GenerationResult, StreamingSession, build_inputs, generate

__all__ = ["GenerationError", "GenerationResult", "StreamingSession", "build_inputs", "generate"]
