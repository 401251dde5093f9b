"""Serving a trained model over HTTP: the continuous-batching engine and the OpenAI-compatible API."""
