"""The training loop and what it applies to a model: the layout check, parallelization, the optimizer,
the workload's step and its checkpoints."""
