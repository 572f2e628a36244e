"""Pallas kernels for jaxengine, each beside a pure-jnp reference with the same signature.

This package imports nothing from `jaxengine`: kernels and references stand alone.
"""
