"""Serving runtime: a continuous-batching engine and a TGI/OpenAI-compatible HTTP server."""
