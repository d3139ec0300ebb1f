"""Prompt text: AUTOMATIC1111 prompt syntax, chunked tokens, textual-inversion embeddings."""
