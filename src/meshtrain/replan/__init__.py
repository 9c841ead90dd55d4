"""Layout changes at run time: the automatic layout (:mod:`.auto`), elastic re-planning on
another world size (:mod:`.elastic`), re-planning from what the run measured
(:mod:`.on_measurement`, :mod:`.measured`, the trainer's :mod:`.monitor`), and the record a
change leaves for the trainer (:mod:`.layout_change`).
"""
