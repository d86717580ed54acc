"""Runs the studies behind the papers' claims, resumably, then writes their reports and the table.

  python -m experiments.reproduce --out=DIR [--only=mnist_tuned,mnist_authors,local_update] \
      [--parallel=N] [--plan] [--merge_from=DIR2] [--save_runs=DIR3] \
      [--publish=results/claims --doc=docs/REPRODUCTION.md]

It first prints what it will run (each study's trials, how many are finished, the estimated
hours left: declared per-trial costs until a study has finished trials, then theirs) and then
runs. A rerun with the same --out skips finished trials and resumes the others from their
checkpoints; Ctrl-C or ``kill`` stops every trial (each records ``interrupted``). --plan
prints the plan, writes the reports and the claims table of what has finished, and runs
nothing. On a GPU the
trials' ``executor='auto'`` picks the GPU executor. Studies, claims and the rule that decides a
claim: ``gssp_jax/studies/reproduce.py``. ``--only=tiny`` checks the whole pipeline in minutes.
--merge_from=DIR2 first adds the finished trials of another --out (run elsewhere, e.g. on a GPU:
virtual time does not depend on the machine) that this one lacks (``reproduce.merge``).
--publish copies the table and the studies' reports into the repository, with the finished
trials' records behind them (under DIR/runs/, without checkpoints), and --doc puts the table into
a document between its markers (``reproduce.BEGIN``/``END``): the committed table is the
command's, not typed by hand, and ``--merge_from=DIR --plan`` rebuilds it from the records.
--mark=<study>/<trial>,... --why=TEXT marks trials the table refuses (run without a commit, or
from a dirty tree) as counted, with the reason, in runs/<study>/provenance.json; the table names
them. --save_runs=DIR copies only the records, every minute while the studies run and once more at
the end: an --out outside the repository does not outlive its machine, so point DIR into the
repository (e.g. results/claims), commit what it holds, and go on with --merge_from=DIR.
"""

import contextlib
import os

from absl import app
from absl import flags

from gssp_jax import cli
from gssp_jax.studies import reproduce
from gssp_jax import xla_env

_OUT = flags.DEFINE_string("out", None, "where the runs, the reports and the claims table go",
                           required=True)
_ONLY = flags.DEFINE_list("only", [], "studies to run (default: "
                          f"{','.join(reproduce.DEFAULT_STUDIES)}); all: "
                          f"{','.join(reproduce.STUDIES)}")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "trials at once (separate processes when > 1)")
_PLAN = flags.DEFINE_bool("plan", False, "print the plan and the table so far; run nothing")
_MERGE_FROM = flags.DEFINE_string("merge_from", None, "first add the finished trials of another "
                                  "--out (e.g. run on a GPU) that this one lacks")
_PUBLISH = flags.DEFINE_string("publish", None, "then copy the table and the studies' reports "
                               "here (e.g. results/claims)")
_SAVE_RUNS = flags.DEFINE_string(
    "save_runs", None, "copy the finished trials' records (no checkpoints) to DIR/runs/, every "
    "minute while the studies run and at the end (interrupted too), so that a later session or "
    "another machine goes on with --merge_from=DIR (--publish does this into its own DIR)")
_DOC = flags.DEFINE_string("doc", None, "with --publish: put the table into this Markdown file, "
                           "between its claims-table markers (e.g. docs/REPRODUCTION.md)")

_MARK = flags.DEFINE_multi_string(
    "mark", [], "first mark this trial (<study>/<trial>; repeat the flag for more: a trial's "
    "name holds commas) of --out as counted by the claims table despite its provenance (no "
    "commit, or a dirty tree), with --why; the table names them")
_WHY = flags.DEFINE_string("why", None, "with --mark: why those trials are kept")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; allowed: flags only")
  if _PARALLEL.value < 1:
    raise ValueError(f"--parallel={_PARALLEL.value} is invalid; allowed: an int >= 1")
  if _DOC.value and not _PUBLISH.value:
    raise ValueError(f"--doc={_DOC.value} is invalid without --publish; allowed: --publish=DIR "
                     "--doc=FILE (the table's files go to DIR, the table into FILE)")
  if _DOC.value:
    reproduce.check_doc(_DOC.value)   # before hours of runs, not after
  if _WHY.value and not _MARK.value:
    raise ValueError("--why is invalid without --mark; allowed: --mark=<study>/<trial> --why=...")
  root = cli.check_workdir(_OUT.value)
  studies = reproduce.select(_ONLY.value)
  if _MARK.value:
    for name, kept in reproduce.mark(root, _MARK.value, _WHY.value or "").items():
      print(f"{name}: {len(kept)} trial(s) marked as counted despite their provenance")
  if _MERGE_FROM.value:
    for name, got in reproduce.merge(_MERGE_FROM.value, root, studies, REPO).items():
      print(f"{name}: {len(got['taken'])} finished trial(s) taken from {_MERGE_FROM.value}"
            + (f"; {len(got['changed'])} left, run with another config: "
               f"{', '.join(got['changed'])}" if got["changed"] else "")
            + (f"; {len(got['busy'])} left, running here: {', '.join(got['busy'])}"
               if got["busy"] else ""))
  rows = reproduce.plan(studies, root, REPO, _PARALLEL.value)   # validates every sweep first
  print(reproduce.describe_plan(rows, _PARALLEL.value), flush=True)
  cli.setup_logging()
  if not _PLAN.value:
    xla_env.use_compilation_cache()
    saver = (reproduce.Saver(root, studies, _SAVE_RUNS.value) if _SAVE_RUNS.value
             else contextlib.nullcontext())
    with cli.sigterm_as_interrupt(), saver:   # saves every minute, and on the way out
      reproduce.run(studies, root, REPO, _PARALLEL.value)
  os.makedirs(root, exist_ok=True)
  if _PLAN.value:   # the reports of what has finished so far, beside the table
    reproduce.write_reports(root, studies)
  paths = reproduce.write_claims(root, studies)
  for kind, path in paths.items():
    print(f"claims {kind}: {path}")
  if _SAVE_RUNS.value:
    saved = reproduce.save_runs(root, studies, _SAVE_RUNS.value)
    print(f"saved: {sum(map(len, saved.values()))} finished trial(s) under "
          f"{os.path.join(_SAVE_RUNS.value, 'runs')} (go on from them with "
          f"--merge_from={_SAVE_RUNS.value})")
  if _PUBLISH.value:
    written = reproduce.publish(root, studies, _PUBLISH.value, _DOC.value)
    print(f"published: {len(written)} files under {_PUBLISH.value}"
          + (f", the table into {_DOC.value}" if _DOC.value else ""))


if __name__ == "__main__":
  cli.run_main(main)
