"""gssp_jax: synchronization schemes for distributed training on heterogeneous clusters."""

from gssp_jax import xla_env as _xla_env

# XLA reads XLA_FLAGS when the first backend starts; importing the library sets the
# deterministic-ops flag before that (GSSP_DETERMINISTIC=0 opts out; see xla_env).
_xla_env.apply_deterministic_env()
# jax's INFO line "Unable to initialize backend 'tpu'" on every machine without one: not a fault.
_xla_env.quiet_backend_probe()

__version__ = "0.1.0"
