"""What a training run is built from, below the simulator and the real runtime.

``tasks`` (model, data and loss of a config), ``optim`` (the optimizers and the sync chain a
scheme's server applies), ``step`` (the pure training step, a worker's gradient), ``run`` (a
run's model initialisation and data), ``checkpoint`` and ``workdir`` (a run's files),
``interrupt`` (Ctrl-C and SIGTERM as a save), ``health`` (collapse and divergence) and
``environment`` (what a run records about its machine). The simulator (``sim``), the real
runtime (``runtime``) and the fused BSP loop (``executors``) build on these; the training loop
that drives them (``train``) sits above all three.
"""
