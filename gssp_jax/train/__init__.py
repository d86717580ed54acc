"""Training: tasks, the pure step, checkpoints and the loop that writes metrics."""

from gssp_jax.train.loop import train_and_evaluate
from gssp_jax.train.step import TrainState, worker_gradients, mean_worker_gradient

__all__ = ["train_and_evaluate", "TrainState", "worker_gradients", "mean_worker_gradient"]
