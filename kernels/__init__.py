"""Compute primitives that deserve fused kernels. Each module's functions are the pure-JAX references:
the default on CPU and the oracle for any accelerated version."""
