"""The cost model: a workload and layout (:mod:`.workload`) priced for memory
(:mod:`.memory`), per-block time (:mod:`.timing`), pipeline bubbles (:mod:`.pipeline`),
overlap (:mod:`.overlap`), context and expert parallelism, and end to end (:mod:`.estimate`).
"""
