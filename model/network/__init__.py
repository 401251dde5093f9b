"""The network: the transformer (one forward pass for training and sampling) and its
hand-written kernels."""
