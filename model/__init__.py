"""Pure JAX / Flax NNX / Optax / Orbax: the transformer, its training and sampling.

Nothing in this package knows about Prefect or the artifact store.
"""
