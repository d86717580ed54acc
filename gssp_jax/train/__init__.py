"""The training loop (``loop``) that drives an executor and writes a run's metrics, what it
observes on the way (``observe``), and loading a trained run (``trained``). The pieces a run is
built from are ``gssp_jax.base``'s."""

from gssp_jax.base.step import TrainState, worker_gradients, mean_worker_gradient

__all__ = ["train_and_evaluate", "load_trained", "TrainState", "worker_gradients",
           "mean_worker_gradient"]


def __getattr__(name):
  # The loop is imported on first use: importing the package (for TrainState) does not pull in
  # the executors and the simulator the loop drives.
  if name == "train_and_evaluate":
    from gssp_jax.train.loop import train_and_evaluate  # pylint: disable=g-import-not-at-top
    return train_and_evaluate
  if name == "load_trained":
    from gssp_jax.train.trained import load_trained  # pylint: disable=g-import-not-at-top
    return load_trained
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
