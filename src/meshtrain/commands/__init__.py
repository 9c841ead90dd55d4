"""What each CLI verb does beyond training: verify, generate, dry run, the lighthouse, the
planner's estimate / plan / calibrate, and ``meshtrain bench``. ``meshtrain.cli`` parses
and dispatches to these.
"""
