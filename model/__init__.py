"""The ML core, by concern: the network (``network/``), its training (``training/``: the
step, the loop, the optimizer, evaluation, checkpoints, sharding and memory, and the
processes that run a training), inference (``inference/``: sampling, the export and its
transformers mapping) and the data (``data/``: splits, shards, rows and batches), with the
error family every room shares (``errors.py``). Nothing here knows about Prefect or the
store."""
