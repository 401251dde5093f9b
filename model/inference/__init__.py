"""Inference: sampling from a trained model, the export (safetensors and jax.export) and its
mapping to Hugging Face transformers."""
