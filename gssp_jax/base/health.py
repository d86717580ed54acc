"""Did a finished run learn, and when did it reach its target? Pure functions of the evaluations.

Both the simulator and the plain loop call :func:`judge` when they write
``summary.json``, and :func:`time_to_target_fields` for its time-to-target
figures; the sweep report uses the same functions on ``metrics.jsonl``, so a
summary and a report never disagree. The module needs nothing but Python.

Collapse. A run that ends at ``done`` but learned nothing (MNIST GSSP without
a warm-up: 11.35 % test accuracy, the share of the most frequent test digit)
is recorded as ``collapsed`` with a ``collapse_reason``. Only evaluations after
the learning-rate warm-up are judged (a warm-up may legitimately raise the
loss), and only when there are at least ``MIN_EVALS`` (4) of them: collapse is
a state a run stays in, and a run too short to show that (a smoke run of 16
updates, still near chance but learning) is not judged. Two rules:

* ``chance``: a classifier's test accuracy sits at chance: the last
  ``CHANCE_EVALS`` (2) evaluations are both at most
  ``CHANCE_FACTOR / num_classes``. A constant predictor scores the test share
  of the class it predicts (MNIST: up to 11.35 %, CIFAR-10: 10 %), a nearly
  constant one a little more; 1.5x chance (15 % for 10 classes) covers both,
  while a run that learned is above it once the warm-up is over
  (LeNet-5/MNIST > 90 % after one epoch; the weakest recorded reduced 4-epoch
  CIFAR-10 run, GSSP on ResNet-18 in results, ended at 18.4 %).
* ``loss``: the training loss stopped falling: over the post-warm-up
  evaluations, the mean recorded ``train_loss`` of the second half is not
  below that of the first half, *and* the last one is not below the first one.
  Both must hold, so a healthy run on a plateau (BSP at 99 %, whose loss still
  drifts down under the decaying schedule while it wobbles from evaluation to
  evaluation) is not flagged by noise.

Did it learn at all? A run too short to judge can still end ``done`` having
learned nothing: a local-update scheme shrunk to a smoke size makes one
server update in two epochs and ends below chance. :func:`learning_warnings`
says so, in the summary's ``warnings`` and the run's last line, whatever the
status: fewer than ``MIN_UPDATES`` (10) server updates, or a final test
accuracy at chance (the ``chance`` rule's level).

Time to target. Evaluations are points; the first one at or above the target
over-states the time by up to one evaluation interval. ``time_to_target`` is
interpolated linearly in virtual time between the last evaluation below the
target and the first at or above it (the first evaluation's own time if it is
already at the target); ``time_to_target_first_eval`` keeps the first
evaluation's time.
"""

from __future__ import annotations

from typing import Any, Sequence

CHANCE_FACTOR = 1.5      # "at chance": accuracy <= CHANCE_FACTOR / num_classes
CHANCE_EVALS = 2         # ... in this many last evaluations ("sits" at chance)
MIN_EVALS = 4            # post-warm-up evaluations needed to judge a run at all
MIN_UPDATES = 10         # fewer server updates than this: too few to have learned anything
COLLAPSED = "collapsed"
INTERPOLATION = ("interpolated linearly in virtual time between the last evaluation below the "
                 "target and the first at or above it")

_NUM_CLASSES = {"mnist": 10, "cifar10": 10}   # gssp_jax.data.{mnist,cifar10}.NUM_CLASSES


def num_classes(config) -> int | None:
  """Classes of ``config.dataset`` (None for translation: no chance level)."""
  return _NUM_CLASSES.get(config.dataset)


def collapse_reason(history: Sequence[dict], *, metric: str, num_classes: int | None,
                    warmup_epochs: float = 0.0) -> str | None:
  """Why the finished run with evaluations ``history`` collapsed, or None if it did not.

  Args:
    history: the run's evaluations in order (``metrics.jsonl`` lines: ``epoch``,
      ``train_loss``, ``metric``).
    metric: the evaluated metric, e.g. ``test_accuracy`` or ``bleu``.
    num_classes: classes of a classifier (the chance rule), None to skip it.
    warmup_epochs: evaluations at or before this epoch are not judged.

  Returns:
    None, or a one-line reason beginning with the rule's name (``chance:`` or
    ``loss:``).
  """
  if isinstance(warmup_epochs, bool) or not warmup_epochs >= 0:
    raise ValueError(f"warmup_epochs={warmup_epochs!r} is invalid; allowed: a number >= 0")
  if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
    raise ValueError(f"num_classes={num_classes!r} is invalid; allowed: an int >= 2 or None")
  after = [m for m in history if m.get("epoch", 0.0) > warmup_epochs]
  if len(after) < MIN_EVALS:
    return None
  last = [m.get(metric) for m in after[-CHANCE_EVALS:]]
  if (num_classes is not None and metric == "test_accuracy"
      and all(v is not None and v <= CHANCE_FACTOR / num_classes for v in last)):
    return (f"chance: {metric} {last[-1]:.4f} at epoch {after[-1]['epoch']:.2f} and "
            f"<= {CHANCE_FACTOR} / {num_classes} classes in the last {CHANCE_EVALS} evaluations, "
            f"after the {warmup_epochs:g}-epoch warm-up")
  losses = [m["train_loss"] for m in after if m.get("train_loss") is not None]
  if len(losses) >= MIN_EVALS:
    half = len(losses) // 2
    first, second = losses[:half], losses[len(losses) - half:]
    mean_first, mean_second = sum(first) / half, sum(second) / half
    if mean_second >= mean_first and losses[-1] >= losses[0]:
      return (f"loss: train loss stopped falling after the {warmup_epochs:g}-epoch warm-up "
              f"(mean {mean_first:.4f} over the first {half} evaluations, {mean_second:.4f} over "
              f"the last {half}; first {losses[0]:.4f}, last {losses[-1]:.4f})")
  return None


def judge(status: str, history: Sequence[dict], config, metric: str) -> tuple[str, str | None]:
  """``(status, collapse_reason)`` of a run that ended with ``status``: ``done`` becomes
  ``collapsed`` when :func:`collapse_reason` finds a reason; other statuses pass unchanged."""
  if status != "done":
    return status, None
  reason = collapse_reason(history, metric=metric, num_classes=num_classes(config),
                           warmup_epochs=float(config.optimizer.warmup_epochs))
  return (COLLAPSED, reason) if reason else (status, None)


def learning_warnings(history: Sequence[dict], *, metric: str, num_classes: int | None,
                      updates: int | None) -> list[str]:
  """Why a finished run cannot have learned, or ``[]``: too few server updates, accuracy at chance.

  Args:
    history: the run's evaluations in order.
    metric: the evaluated metric.
    num_classes: classes of a classifier (the chance level), None for none.
    updates: the server updates the run applied (``totals.updates``), None if unknown.

  Returns:
    one-line warnings, each saying what to change.
  """
  out = []
  if updates is not None and updates < MIN_UPDATES:
    out.append(f"only {updates} server update{'s' if updates != 1 else ''} (fewer than "
               f"{MIN_UPDATES}): too few to learn; train longer (train.num_epochs, or "
               "train.virtual_budget under a budget), on more data (data.train_size) or with "
               "fewer local steps (local.steps)")
  final = history[-1].get(metric) if history else None
  if (num_classes is not None and metric == "test_accuracy" and final is not None
      and final <= CHANCE_FACTOR / num_classes):
    out.append(f"{metric} {final:.4f} is at chance (at most {CHANCE_FACTOR} / {num_classes} "
               "classes): the model has not learned")
  return out


def time_to(history: Sequence[dict], metric: str, target: float | None, *,
            time_key: str = "virtual_time", interpolate: bool = True) -> float | None:
  """``time_key`` at which ``metric`` first reaches ``target`` (None if never or untimed).

  With ``interpolate``, linear between the last evaluation below the target and
  the first at or above it; without, the first evaluation's own time.
  """
  if not target:
    return None
  prev = None
  for m in history:
    value, t = m.get(metric), m.get(time_key)
    if value is None or t is None:
      continue
    if value >= target:
      if not interpolate or prev is None:
        return float(t)
      (_, t0), frac = prev, (target - prev[0]) / (value - prev[0])
      return float(t0 + frac * (t - t0))
    prev = (value, t)
  return None


def time_to_target_fields(history: Sequence[dict], metric: str,
                          target: float | None) -> dict[str, Any]:
  """The summary's virtual time-to-target keys (interpolated, first evaluation, and how)."""
  return {"time_to_target": time_to(history, metric, target),
          "time_to_target_first_eval": time_to(history, metric, target, interpolate=False),
          "time_to_target_method": INTERPOLATION}
