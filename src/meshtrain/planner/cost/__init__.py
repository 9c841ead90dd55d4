"""The cost model: a workload and layout (:mod:`.workload`) priced as a runtime runs it
(:mod:`.runtime`: the stacks and their traits) for memory (:mod:`.memory`), per-block time
(:mod:`.timing`), pipeline bubbles (:mod:`.pipeline`), overlap (:mod:`.overlap`), context and
expert parallelism, offload of the ZeRO shard to the host or NVMe (:mod:`.offload`), and end
to end (:mod:`.estimate`); why a layout does not fit (:mod:`.fit_advice`).
"""
