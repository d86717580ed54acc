"""gssp_jax: synchronization schemes for distributed training on heterogeneous clusters."""

__version__ = "0.1.0"
