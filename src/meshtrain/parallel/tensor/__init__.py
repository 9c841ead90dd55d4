"""Tensor parallelism (and sequence parallelism): split layers, their collectives and
the vocab-parallel loss.
"""
