"""DiLoCo replica groups: the outer step (:mod:`.outer`), its 8-bit reduction
(:mod:`.quantized_reduce`), and groups that fail alone through torchft (:mod:`.replica_ft`).
"""
