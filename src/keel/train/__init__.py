"""Training: the one training step, the trainer, run directories, checkpoints, optimiser, guard, evaluation."""
