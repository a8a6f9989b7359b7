"""Triton kernels behind the CUDA implementations of the vgraph ops.

Each launcher takes torch tensors on any device Triton can run on: CUDA normally, or CPU
tensors when ``TRITON_INTERPRET=1`` was set before triton was imported (how the kernels are
tested on machines without a GPU).
"""
