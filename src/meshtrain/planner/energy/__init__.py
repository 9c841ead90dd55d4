"""Energy schedules of a pipeline: actions off the critical path at lower clocks
(:mod:`.schedule`).
"""
