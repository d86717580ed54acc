#!/usr/bin/env bash
# The GPU checks of docs/PERFORMANCE.md ("On a GPU") as one bounded script, for a lent GPU host
# with no package registry. Once, here: bash ../shared/tools/gpu-bundle.sh tensorboardX
# (builds .gpu/: data and the wheels the host lacks). There, from the project root:
#   OUT=/some/dir BUDGET=540 bash benchmarks/gpu_session.sh     # SERVER=0 skips the server part
#   OUT=/some/dir BUDGET=560 STAGES="suite steady transport" bash benchmarks/gpu_session.sh
# STAGES picks stages by name (default: the first session's set, "determinism lenet resnet full
# meshes lenet_calls" with the CPU server beside them). "suite": the test suite on the GPU (8
# xdist workers, stopped with SIGINT at its limit so pytest still prints what failed so far);
# "steady": LeNet-5 `levels` rates with compilation counted apart, for two levels_per_call;
# "transport": benchmarks.dist_transport's ratio, server and shards parts with jax on the GPU
# (the server's apply on the GPU). SUITE_S sets the suite's seconds (default 270), SUITE_N its xdist workers (8), FIRST test files to start with.
# Issue 33's checks of the rebuilt levels executor (STAGES="determinism levels33 resnet33
# proxies33 tests33", about 8 minutes): "levels33": LeNet-5 at 16 workers (SSP, GSSP; target
# steady >= 0.2 of the batched step) and at 256 (GSSP); "resnet33": ResNet-18 at 16 workers, GSSP
# (target >= 0.2, first evaluation within 60 s); "proxies33": eager ops, host reads (the transfer
# guard works on a GPU) and compilations per run; "tests33": tests/test_levels.py and
# tests/test_sim.py on the GPU; "jobs33" (below): the job batch's choice; "graphs33" (below):
# XLA's CUDA graphs for the chunk's loops, without and with; "slots33" (below): a piece's job
# slots; "memory33" (below): the chunk program's device memory. "chunks33" (about
# 3.5 minutes): benchmarks.chunk_profile's device time per piece and top kernels, ResNet-18
# and LeNet-5 at 16 workers, LeNet-5 at 256.
# "serial60 batched60": issue 60's (below).
# "claims35": issue 35's CIFAR-10 study run on the GPU, its finished trials brought back (below).
# Stages run in priority order, each with its own time limit, all within BUDGET seconds; each
# stage's stdout goes to $OUT/<stage>.txt as it runs (so a cut stage keeps what it printed),
# the tails of their stderr to $OUT/errs.txt. The parameter server's throughput (CPU only) runs
# beside the GPU stages on other cores (taskset 8-15 against 0-7).
set -u
STAGES=" ${STAGES:-determinism lenet resnet full meshes lenet_calls} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
T0=$(date +%s); END=$((T0 + ${BUDGET:-540}))
left() { echo $((END - $(date +%s))); }
stage() {  # stage NAME SECONDS CMD...   stdout -> $OUT/NAME.txt, stderr -> /tmp/err_NAME.txt
  local name=$1 want=$2; shift 2
  local l=$(left); local t=$(( want < l - 5 ? want : l - 5 ))
  if (( t < 15 )); then echo "SKIPPED (no time left)" >> $OUT/$name.txt; return; fi
  echo "== $name (timeout $t s) $(date +%T)" | tee -a $OUT/log.txt
  local s=$(date +%s)
  timeout -k 5 $t "$@" >> $OUT/$name.txt 2> /tmp/err_$name.txt; local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - s )) s" | tee -a $OUT/log.txt $OUT/$name.txt
}
source .gpu/env.sh > /tmp/env.log 2>&1; cat /tmp/env.log >> $OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $OUT/log.txt
nproc >> $OUT/log.txt
# CPU-only, in the background on cores 8-15: the parameter server's throughput (grpc, numpy).
want lenet && [ "${SERVER:-1}" = 1 ] && ( taskset -c 8-15 env JAX_PLATFORMS=cpu timeout -k 5 150 python3 -m benchmarks.dist_transport \
    --parts=server,shards --models=resnet18 --seconds=8 --repeats=1 \
    > $OUT/server.txt 2> /tmp/err_server.txt; echo "rc=$?" >> $OUT/server.txt ) &
BG=$!; want lenet && [ "${SERVER:-1}" = 1 ] || BG=
P="taskset -c 0-7 python3 -m"
want determinism && stage determinism 70 $P benchmarks.determinism --config=configs/mnist_lenet5.py:smoke --config.executor=levels
want lenet && stage lenet 150 $P benchmarks.sim_efficiency --executor=levels --workers=16,64,256 --schemes=bsp,ssp,gssp --epochs=0.5
want resnet && stage resnet 120 $P benchmarks.sim_efficiency --model=resnet18 --executor=levels --workers=16,64 --schemes=gssp --epochs=0.1
if want full; then
  stage full 110 $P experiments.main --config=configs/sweeps/paper_cifar10_resnet18.py:full --workdir=/tmp/full \
      --config.sync.scheme=gssp --config.train.num_epochs=0.5
  cat /tmp/full/metrics.jsonl >> $OUT/full.txt 2>/dev/null
fi
if want meshes; then
  stage meshes 70 python3 -m experiments.launch --config=configs/mnist_lenet5_hetero.py:smoke --workdir=/tmp/real \
      --config.num_workers=2 --config.sync.num_groups=2 "--config.cluster.tiers=(1.0,3.0)" \
      --config.cluster.base_time=0.05 --processes_per_mesh=1
  cat /tmp/real/summary.json >> $OUT/meshes.txt 2>&1; nvidia-smi >> $OUT/meshes.txt 2>&1
fi
want lenet_calls && stage lenet 80 $P benchmarks.sim_efficiency --executor=levels --workers=256 --schemes=gssp --levels_per_call=4,16 --epochs=0.25
# SIGINT a minute before the limit, so pytest (12 workers took over 20 s to stop) prints its summary.
# The package and the bundled wheels go into the interpreter's own site-packages first: the
# README examples' test runs them with only what is installed. FIRST (test files) run first.
if want suite; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation .gpu/whl/*.whl -e . \
      >> $OUT/log.txt 2>&1
  stage suite ${SUITE_S:-270} timeout -s INT -k 40 $(( ${SUITE_S:-270} - 60 )) python3 -m pytest \
      -v -n ${SUITE_N:-8} ${FIRST:-} tests --ignore=tests/test_notebooks.py -p no:cacheprovider \
      --timeout=240 -rfE --tb=short --durations=15
fi
want levels33 && stage levels33 120 $P benchmarks.sim_efficiency --executor=levels --workers=16 \
    --schemes=ssp,gssp --epochs=1
# 256 workers for 2 epochs: at 0.25 epoch (2026-11-27: 0.01) the span between the first and the
# last evaluation held about one and a half chunks of 256 jobs (8,192 samples each).
want levels33 && stage levels33 80 $P benchmarks.sim_efficiency --executor=levels --workers=256 \
    --schemes=gssp --epochs=2
want resnet33 && stage resnet33 130 $P benchmarks.sim_efficiency --model=resnet18 --executor=levels \
    --workers=16 --schemes=gssp --epochs=0.2
# The job batch on the GPU (config.level_job_batch; "jobs33", about 3.5 minutes): ResNet-18's
# 16 job slots in one vmap (0 there), one at a time and 4 at a time; LeNet-5's, all or one.
want jobs33 && stage jobs33 150 $P benchmarks.sim_efficiency --model=resnet18 --executor=levels \
    --workers=16 --schemes=gssp --epochs=0.1 --level_job_batch=0,1,4
want jobs33 && stage jobs33 75 $P benchmarks.sim_efficiency --executor=levels --workers=16 \
    --schemes=ssp,gssp --epochs=0.5 --level_job_batch=0,1
# CUDA graphs for the chunk's loops ("graphs33", about 2.5 minutes): LeNet-5's rounds are
# launch-bound (about 25 kernels each, 2026-11-27), and XLA:GPU's command buffers can record a
# while loop's body (+WHILE) and a conditional (+CONDITIONAL) as CUDA graph nodes; the same runs
# without and with them (the flags are XLA's; gssp_jax appends its deterministic flag to them).
want graphs33 && stage graphs33 70 $P benchmarks.sim_efficiency --executor=levels --workers=16 \
    --schemes=ssp,gssp --epochs=0.5
want graphs33 && stage graphs33 80 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
    $P benchmarks.sim_efficiency --executor=levels --workers=16 --schemes=ssp,gssp --epochs=0.5
# A piece's job slots on the GPU ("slots33", about 3.5 minutes; config.level_job_slots, J): GSSP's
# pieces at 16 workers hold 10.4 jobs on average, so J = 16 leaves a third of the slots padded
# (each padded slot computes a gradient); this CPU found J = 12 as many pieces with 87 % of the
# job slots and 80 % of the round slots used, J = 8 a third more pieces at 99 % and 89 %.
want slots33 && stage slots33 80 $P benchmarks.sim_efficiency --executor=levels --workers=16 \
    --schemes=gssp --epochs=0.5 --level_job_slots=0,12,8
want slots33 && stage slots33 130 $P benchmarks.sim_efficiency --model=resnet18 --executor=levels \
    --workers=16 --schemes=gssp --epochs=0.1 --level_job_slots=0,12,8
# The chunk program's device memory on the GPU's own buffer assignment ("memory33", about a
# minute: compiled, not run): ResNet-18 at 16 and 256 workers, every job slot in one vmap.
want memory33 && stage memory33 90 $P benchmarks.level_memory --model=resnet18 --workers=16,256 \
    --one_vmap
# Issue 60 ("serial60 batched60", about 8 minutes): the simulator as run against the serial
# loop on the same card (target >= 3x: SSP and GSSP, LeNet-5 at 16 and 256 workers, ResNet-18 at
# 16; the loop measured before and after each scheme) and against the batched step (target 0.2
# as run); then one :full ResNet-18 trial (the "full" stage), BSP and GSSP.
want serial60 && stage serial60 200 $P benchmarks.serial_loop --models=lenet5 --workers=16,256 \
    --schemes=ssp,gssp --executors=auto --epochs=0.5 --serial_seconds=3
want serial60 && stage serial60 150 $P benchmarks.serial_loop --models=resnet18 --workers=16 \
    --schemes=ssp,gssp --executors=auto --epochs=0.1 --serial_seconds=3
want batched60 && stage batched60 120 $P benchmarks.sim_efficiency --workers=16,256 \
    --schemes=ssp,gssp --epochs=0.5
want proxies33 && stage proxies33 45 $P benchmarks.sim_overhead --parts=proxies --workers=16 \
    --schemes=ssp,gssp
if want tests33; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation .gpu/whl/*.whl -e . \
      >> $OUT/log.txt 2>&1
  stage tests33 130 python3 -m pytest -q -n 4 tests/test_levels.py tests/test_sim.py \
      -p no:cacheprovider -rfE --tb=short
fi
# Where a chunk's device time goes (benchmarks/chunk_profile.py): per-piece time, slot fill, the
# top kernels of one traced chunk; ResNet-18 and LeNet-5 at 16 workers, LeNet-5 at 256.
want chunks33 && stage chunks33 100 $P benchmarks.chunk_profile --model=resnet18 --epochs=0.05 \
    --skip=3 --trace=1
want chunks33 && stage chunks33 45 $P benchmarks.chunk_profile --epochs=0.25 --trace=0
want chunks33 && stage chunks33 60 $P benchmarks.chunk_profile --workers=256 --epochs=0.1 \
    --skip=2 --trace=1
want steady && stage steady 130 $P benchmarks.sim_efficiency --executor=levels --workers=16,256 --schemes=ssp,gssp \
    --levels_per_call=1,8 --epochs=0.25
want transport && stage transport 150 python3 -m benchmarks.dist_transport --parts=ratio,server,shards \
    --models=resnet18 --rounds=3 --seconds=6 --repeats=1 --num_servers=1,4
# Issue 35's studies on the GPU ("claims35"; CLAIMS_ONLY, default cifar10_tuned; CLAIMS_S
# seconds, default 420; CLAIMS_PARALLEL trials at once, default 4): virtual time does not depend
# on the machine, so the finished trials (copied back without checkpoints) join the CPU's with
#   python -m experiments.reproduce --out=DIR --only=cifar10_tuned --merge_from=<files_at>/claims35 --plan
# The timeout's SIGTERM stops the trials as Ctrl-C does (each records `interrupted`).
if want claims35; then
  stage claims35 ${CLAIMS_S:-420} $P experiments.reproduce --only=${CLAIMS_ONLY:-cifar10_tuned} \
      --out=/tmp/claims35 --parallel=${CLAIMS_PARALLEL:-4}
  mkdir -p $OUT/claims35 && ( cd /tmp/claims35 && find runs \( -name checkpoints -o -name tensorboard \) \
      -prune -o -type f -print | tar -cf - -T - ) | tar -xf - -C $OUT/claims35
fi
[ -n "$BG" ] && wait $BG
for f in /tmp/err_*.txt; do echo "##### $f"; grep -v -E "^I[0-9]{4}|checkpoint|^\s*$" $f | tail -25; done > $OUT/errs.txt 2>&1
echo "total $(( $(date +%s) - T0 )) s" >> $OUT/log.txt
