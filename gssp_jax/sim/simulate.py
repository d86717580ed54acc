"""``simulate_and_evaluate(config, workdir)``: any scheme on a simulated heterogeneous cluster.

The host runs the scheme's protocol over the cluster model event by event
(``sync.TimelineEngine``); every round it produces is applied on the device at
once (``executor.make_round_fn``) and every worker that pulls gets its next
gradient computed on the weights it pulled (``executor.make_job_fn``). Virtual
time is the engine's clock; nothing about it depends on wall time, so the same
config and seed give the same metrics bit for bit (but ``wall_time``), and a
run resumed from a checkpoint (device state + the pickled host state) continues
exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gssp_jax import compress
from gssp_jax import sync
from gssp_jax.data import sharding
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import executor
from gssp_jax.sim import traffic as traffic_lib
from gssp_jax.train import checkpoint as ckpt_lib
from gssp_jax.train import health
from gssp_jax.train import loop as loop_lib
from gssp_jax.train import optim
from gssp_jax.train import step as step_lib
from gssp_jax.train import tasks
from gssp_jax.train import workdir as workdir_lib


class _Ratios:
  """Per-worker keep-ratio of each iteration (GDTopK: by group speed class and worker epoch)."""

  def __init__(self, config, scheme, speeds, steps_per_epoch):
    self.name = config.compress.name
    self.ratio = float(config.compress.ratio)
    self.spe = steps_per_epoch
    self.set_groups(scheme.groups, speeds)

  def set_groups(self, groups: np.ndarray, times: np.ndarray) -> None:
    """The workers' groups, and for GDTopK the groups' speed ranks from ``times``."""
    self.groups = np.asarray(groups)
    if self.name == "gdtopk":
      self.ranks = sync.grouping.group_speed_rank(self.groups, times)

  def __call__(self, worker: int, iteration: int) -> float:
    if self.name != "gdtopk":
      return self.ratio
    epoch = iteration // self.spe + 1
    ratios = compress.gdtopk_group_ratios(epoch, self.ranks)
    return float(ratios[self.groups[worker]])

  def flush(self, worker: int, iteration: int) -> bool:
    """GDTopK: the last iteration of a worker's epoch sends everything and clears its residual."""
    del worker
    return self.name == "gdtopk" and iteration % self.spe == self.spe - 1


def _calibrate(job_fn, state, arrays, batch_size) -> float:
  """Seconds of one worker's gradient job on this machine (best of 5, after compilation)."""
  args = (np.zeros([1], np.int32), np.zeros([1, batch_size], np.int32), np.zeros([1], np.int32),
          np.ones([1], np.float32))
  state = job_fn(state, arrays, *args)
  jax.block_until_ready(state)
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    state = job_fn(state, arrays, *args)
    jax.block_until_ready(state)
    best = min(best, time.perf_counter() - start)
  return best


def simulate_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains ``config`` on the simulated cluster in ``workdir`` (resuming if possible)."""
  task = loop_lib.prepare_run(config, workdir)

  W, B = config.num_workers, config.batch_size
  shards = sharding.worker_shards(task.num_train, W, config.seed)
  spe = shards.shape[1] // B                         # iterations per worker per epoch
  total_pushes = max(W, round(config.train.num_epochs * spe) * W)
  eval_pushes = max(1, round(config.train.eval_every * spe)) * W
  stop = config.train.stop_after_updates
  end_pushes = min(total_pushes, stop) if stop else total_pushes

  cluster = cluster_lib.cluster_from_config(config)
  speeds = (cluster.trace.mean(0) if cluster.trace is not None else cluster.speeds)
  scheme = sync.scheme_from_config(config, worker_times=speeds)
  R = scheme.num_replicas
  schedule = optim.learning_rate_schedule(config.optimizer, spe, round(total_pushes / W))
  tx = optim.make_sync_chain(config.optimizer, scheme.transform, R)
  compressor = loop_lib.make_compressor(_one_worker(config))   # None for "none"

  rng = jax.random.PRNGKey(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  params, model_state = task.init(init_rng)
  sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
  dense_bytes = step_lib.tree_bytes(params)
  stats_bytes = step_lib.tree_bytes(model_state)
  pull_bytes = step_lib.tree_bytes(params) + stats_bytes
  state = executor.init_state(params, model_state, tx, compressor, W, R, train_rng)
  job_fn = executor.make_job_fn(task.loss, compressor, dense_bytes, stats_bytes)
  round_fn = executor.make_round_fn(tx)
  run_steps = executor.make_round_runner(job_fn, round_fn)
  arrays = jax.device_put(task.train)
  ratio_of = _Ratios(config, scheme, speeds, spe)
  calibrated = None
  if config.cluster.calibrate:
    calibrated = _calibrate(job_fn, jax.tree.map(jnp.copy, state), arrays, B)
    cluster = cluster_lib.cluster_from_config(config, base_time=calibrated)
    logging.info("calibrated base_time: %.4f s per iteration of %d samples", calibrated, B)

  sent_cache = {"job": np.full([W], -1, np.int64), "bytes": np.zeros([W], np.int64)}

  def sent_bytes(w: int, k: int) -> int:
    """The bytes worker ``w``'s job ``k`` actually pushes, read from the device (DGC only).

    DGC's count depends on the gradient (a sampled threshold), so unlike top-k
    and GDTopK it cannot be known from the ratio; a deterministic count would
    no longer be DGC. The engine times push ``(w, k)`` at the start of
    iteration ``k``, after job ``k`` was dispatched at the pull before it, so
    the worker's ``job_bytes`` slot holds it. One read fetches every worker's
    slot, so the host waits for the device about once per round with pulls,
    not once per job.
    """
    if sent_cache["job"][w] != k:
      sent_cache["bytes"][:] = np.asarray(jax.device_get(state.job_bytes), np.int64)
      sent_cache["job"][:] = host["jobs"] - 1
      if sent_cache["job"][w] != k:
        raise RuntimeError(f"push ({w}, {k}) timed before its job was dispatched")
    return int(sent_cache["bytes"][w])

  def push_payload(w, k):
    """Bytes of push ``(w, k)``, equal to what its job adds to ``bytes_pushed``."""
    if config.compress.name == "none" or ratio_of.flush(w, k):
      return dense_bytes + stats_bytes
    if config.compress.name == "dgc":
      return sent_bytes(w, k)   # the job's slot already includes stats_bytes
    return compress.expected_push_bytes(sizes, ratio_of(w, k),
                                        scope=config.compress.scope) + stats_bytes

  links = traffic_lib.Traffic(scheme.name, cluster, push_payload, dense_bytes + stats_bytes,
                              pull_bytes)
  engine = sync.TimelineEngine(
      scheme.make_protocol(), cluster.compute_time,
      push_delay=lambda w, k: links.push_delay(engine.protocol, w, k),
      pull_delay=lambda w: links.pull_delay(engine.protocol, w),
      message_delay=lambda m: links.message_delay(engine.protocol, m, engine.iteration),
      record=False)
  acct = sync.accounting.Accounting(W, R, aggregating=scheme.name == "inhad")
  eval_replica = getattr(engine.protocol, "global_replica", None)   # GSSP global: its server

  host = {"jobs": np.zeros([W], np.int64), "wall_time": 0.0,
          "pushed_per_worker": np.zeros([W], np.int64), "pulls_per_worker": np.zeros([W], np.int64),
          "server_bytes": 0, "local_bytes": 0, "node_push_bytes": 0, "updates": 0,
          "next_eval": eval_pushes,
          "num_evals": 0, "rounds": 0, "next_epoch_end": W * spe,
          "groups": [scheme.groups.tolist()]}
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       config.train.max_checkpoints)
  host_path = lambda step: os.path.join(workdir, "checkpoints", f"host_{step}.pkl")
  # The newest step whose host state was written too (a crash between the two writes
  # leaves a device checkpoint without it; the older complete one is used instead).
  latest = next((step for step in sorted(checkpointer.all_steps(), reverse=True)
                 if os.path.exists(host_path(step))), None)
  if latest is not None:
    state, _ = checkpointer.restore(latest, state)
    state = jax.device_put(state)
    with open(host_path(latest), "rb") as f:
      saved = pickle.load(f)
    engine.load_state_dict(saved["engine"])
    acct.load_state_dict(saved["acct"])
    host = {"local_bytes": 0, "node_push_bytes": 0, **saved["host"]}
    logging.info("resumed from the checkpoint at %d pushes", latest)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  history = workdir_lib.restart_metrics(metrics_path, engine.num_pushes, key="pushes")

  orders: dict = {}

  def batch_indices(w: int, k: int) -> np.ndarray:
    epoch, pos = divmod(k, spe)
    if (w, epoch) not in orders:
      orders[(w, epoch)] = sharding.worker_order(shards, config.seed, w, epoch)
      for key in [key for key in orders if key[0] == w and key[1] < epoch]:
        del orders[key]
    return orders[(w, epoch)][pos * B:(pos + 1) * B]

  def next_jobs(workers: np.ndarray) -> executor.Jobs:
    """The next job of each of ``workers`` (they just pulled); counts them as dispatched."""
    workers = np.asarray(workers, np.int64)
    ks = host["jobs"][workers].copy()
    host["jobs"][workers] += 1
    pairs = [(int(w), int(k)) for w, k in zip(workers, ks)]
    return executor.Jobs(
        workers=workers.astype(np.int32),
        idx=np.stack([batch_indices(w, k) for w, k in pairs]).astype(np.int32),
        iters=ks.astype(np.int32),
        ratios=np.array([ratio_of(w, k) for w, k in pairs], np.float32),
        flushes=np.array([ratio_of.flush(w, k) for w, k in pairs], bool))

  if engine.num_pushes == 0 and host["jobs"].sum() == 0:
    state = run_steps(state, arrays, [executor.Step(None, next_jobs(np.arange(W)))])

  def regroup(measured: np.ndarray) -> None:
    """GSSP: new groups from the speeds measured over the last epoch, at the next barrier."""
    groups = sync.make_groups(config.sync.grouping, W, config.sync.num_groups, measured)
    if not np.array_equal(groups, engine.protocol.route):
      engine.protocol.request_regroup(groups)
      ratio_of.set_groups(groups, measured)
      host["groups"].append(groups.tolist())
      host["ratio_groups"] = (ratio_of.groups, getattr(ratio_of, "ranks", None))
      logging.info("regrouping at %d pushes: %s", engine.num_pushes, groups.tolist())

  if "ratio_groups" in host:   # resumed after a regrouping
    ratio_of.groups, ratio_of.ranks = host["ratio_groups"]

  metric_name = "bleu" if isinstance(task, tasks.TranslationTask) else "test_accuracy"
  target = config.train.target_bleu if metric_name == "bleu" else config.train.target_accuracy
  session_start, session_pushes = time.perf_counter(), engine.num_pushes
  wall_base = host["wall_time"]
  status = "failed"

  def save(step: int):
    host["wall_time"] = wall_base + time.perf_counter() - session_start
    checkpointer.save(step, state, {"pushes": step})
    checkpointer.wait()
    tmp = host_path(step) + ".tmp"
    with open(tmp, "wb") as f:
      pickle.dump({"engine": engine.state_dict(), "acct": acct.state_dict(), "host": host}, f)
    os.replace(tmp, host_path(step))
    kept = checkpointer.all_steps()   # host states of steps Orbax dropped go too
    directory = os.path.dirname(host_path(step))
    for name in os.listdir(directory):
      if name.startswith("host_") and name.endswith(".pkl") and int(name[5:-4]) not in kept:
        os.remove(os.path.join(directory, name))

  def traffic() -> dict[str, int]:
    """Bytes so far; the totals are sums of the per-worker counts (pushes counted at evaluations)."""
    return {"bytes_pushed": int(host["pushed_per_worker"].sum()) + host["node_push_bytes"],
            "bytes_pulled": int(host["pulls_per_worker"].sum()) * pull_bytes,
            "bytes_between_servers": host["server_bytes"],
            "bytes_local": host["local_bytes"]}

  def evaluate():
    nonlocal state
    loss_sum, loss_count, pushed = jax.device_get((state.loss_sum, state.loss_count,
                                                   state.push_bytes))
    if not np.isfinite(loss_sum):
      raise FloatingPointError(
          f"non-finite training loss before {engine.num_pushes} pushes (virtual time "
          f"{engine.now:.1f} s); the run stopped. Lower optimizer.learning_rate "
          f"({config.optimizer.learning_rate}) or set optimizer.grad_clip")
    if links.counts_device_pushes:   # InHAD's and CASP's are counted per round (traffic.py)
      host["pushed_per_worker"] += np.asarray(pushed, np.int64)
    state = state.replace(loss_sum=jnp.zeros([], jnp.float32), loss_count=jnp.zeros([], jnp.int32),
                          push_bytes=jnp.zeros([W], jnp.int32))
    params_eval, ms_eval = executor.served_weights(state, eval_replica)
    blocked = engine.blocked_time_so_far()
    results = task.evaluate(params_eval, ms_eval)
    return {
        "epoch": engine.num_pushes / (W * spe),
        "pushes": int(engine.num_pushes),
        "updates": int(host["updates"]),
        "virtual_time": float(engine.now),
        "wall_time": wall_base + time.perf_counter() - session_start,
        "train_loss": float(loss_sum) / max(int(loss_count), 1),
        **results,
        **traffic(),
        "bytes_pushed_per_worker": host["pushed_per_worker"].tolist(),
        "bytes_pulled_per_worker": (host["pulls_per_worker"] * pull_bytes).tolist(),
        "blocked_time": float(blocked.mean()),
        "blocked_time_per_worker": blocked.tolist(),
        "staleness": acct.summary(),
        "updates_per_replica": acct.version.tolist(),
    }

  try:
    while engine.num_pushes < end_pushes:
      for rnd in engine.step():
        args = sync.round_args(rnd)
        args["learning_rate"] = np.float32(schedule(engine.num_pushes // W))
        acct.apply(rnd)
        host["rounds"] += 1
        host["updates"] += int(rnd.applies.any())
        host["server_bytes"] += engine.protocol.server_payloads(rnd) * pull_bytes
        # Before the pulled workers' next jobs: DGC's count reads the arrived jobs' bytes.
        links.count_round(engine.protocol, rnd, engine.iteration, host)
        pulled = np.flatnonzero(rnd.pulls)
        jobs = next_jobs(pulled) if pulled.size else None
        state = run_steps(state, arrays, [executor.Step(args, jobs)])
        if host["rounds"] % 64 == 0:
          jax.block_until_ready(state.loss_sum)   # keep the dispatch queue short
      if engine.num_pushes >= host["next_epoch_end"]:
        host["next_epoch_end"] += W * spe
        measured = engine.measured_times()
        if config.sync.regroup_every_epoch and engine.num_pushes < end_pushes:
          regroup(measured)
      if engine.num_pushes >= host["next_eval"] or engine.num_pushes == total_pushes:
        record = evaluate()
        host["next_eval"] += eval_pushes
        host["num_evals"] += 1
        with open(metrics_path, "a") as f:
          f.write(json.dumps(record, sort_keys=True) + "\n")
        history.append(record)
        elapsed = time.perf_counter() - session_start
        rate = (engine.num_pushes - session_pushes) / max(elapsed, 1e-9)
        eta = (end_pushes - engine.num_pushes) / max(rate, 1e-9)
        logging.info("%s epoch %.2f | virtual %.1f s | loss %.4f | %s %.4f | "
                     "blocked %.1f s | staleness mean %.2f | ETA %s", scheme.name,
                     record["epoch"], record["virtual_time"], record["train_loss"],
                     metric_name, record[metric_name], record["blocked_time"],
                     record["staleness"]["mean"], workdir_lib.format_duration(eta))
        if host["num_evals"] % config.train.checkpoint_every == 0:
          save(engine.num_pushes)
    status = "done" if engine.num_pushes >= total_pushes else "stopped"
    save(engine.num_pushes)
  except KeyboardInterrupt:
    status = "interrupted"
    raise
  except FloatingPointError:
    status = "diverged"
    raise
  finally:
    checkpointer.close()
    reached = next((m for m in history if target and m.get(metric_name, 0) >= target), None)
    status, collapse = health.judge(status, history, config, metric_name)
    summary = {
        "config": json.loads(config.to_json()),
        "status": status,
        "collapse_reason": collapse,
        "final": history[-1] if history else None,
        "metric": metric_name,
        "target": target or None,
        **health.time_to_target_fields(history, metric_name, target),
        "wall_time_to_target": reached["wall_time"] if reached else None,
        "pushes_to_target": reached["pushes"] if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
        "scheme": {**sync.registry.describe(scheme), "groups": host["groups"][-1],
                   "groups_history": host["groups"]},
        "cluster": {**cluster.describe(), "calibrated_base_time": calibrated},
        "totals": {
            "pushes": int(engine.num_pushes), "updates": int(host["updates"]),
            "rounds": int(host["rounds"]), "samples": int(engine.num_pushes) * B,
            "virtual_time": float(engine.now),
            "wall_time": wall_base + time.perf_counter() - session_start,
            **traffic(),
            "blocked_time_per_worker": engine.blocked_time_so_far().tolist(),
            "staleness": acct.summary(),
        },
    }
    workdir_lib.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary


def _one_worker(config):
  """A copy of ``config`` with one worker: the executor runs a compressor per worker."""
  one = ml_collections.ConfigDict(config.to_dict())
  one.num_workers = 1
  return one
