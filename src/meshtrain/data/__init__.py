"""Everything between files on disk and micro-batches: tokenizers, source readers,
``meshtrain prepare`` and its memory-mapped shards, packing, samplers, mixtures, the built-in
corpus and prefetching.
"""
