"""Training across sites: wide-area links (:mod:`.wide_area`), what crosses them
(:mod:`.across_sites`), and DiLoCo replica groups priced (:mod:`.diloco_cost`).
"""
