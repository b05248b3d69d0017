"""A scheduler's plan bound to tensors: the runner, the actions of each op, weights resident on the device."""
