"""Training: tasks, the pure step, checkpoints and the loop that writes metrics."""

from gssp_jax.train.step import TrainState, worker_gradients, mean_worker_gradient

__all__ = ["train_and_evaluate", "load_trained", "TrainState", "worker_gradients",
           "mean_worker_gradient"]


def __getattr__(name):
  # The loop is imported on first use, so that the executors' modules (the simulator imports
  # train.step, train.checkpoint) never pull in the loop that drives them.
  if name == "train_and_evaluate":
    from gssp_jax.train.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
    return train_and_evaluate
  if name == "load_trained":
    from gssp_jax.train.trained import load_trained  # pylint: disable=g-import-not-at-top
    return load_trained
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
