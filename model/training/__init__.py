"""Training, whole: the compiled step and its settings, the loop and its hooks, the
optimizers, evaluation, checkpoints, where state and batches live (placement: the sharding),
the memory estimate, and the processes that run one training (launch, supervision, the
process group, stop signals, the CPU step tuner, the trackers it writes to)."""
