"""This machine and this job: where the process stands in a job (:mod:`.job`), the glibc
allocator settings of training processes (:mod:`.allocator`), and a function run on N local
processes over gloo (:mod:`.local_processes`). Low in the tree so that the launcher, the planner's
calibration and the automatic layout all read the same facts.
"""
