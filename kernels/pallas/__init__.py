"""Pallas implementations of the kernel-worthy primitives, chosen by jaxserve.kernels.table; each is tested
against its pure-JAX reference in jaxserve.kernels."""
