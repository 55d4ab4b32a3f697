"""Pallas kernels for NVIDIA GPUs (Mosaic GPU), one folder per op.

Each op folder holds `api.py` (the implementation table: the caller's `implementation=`
picks the kernel or a jnp form, common.py), `reference.py` (plain jnp: the CPU path and the
test oracle) and `mosaic_gpu*.py` (SM90 today; SM100 variants in their own files). Kernels
know nothing of the engine: arrays in, arrays out.
"""
