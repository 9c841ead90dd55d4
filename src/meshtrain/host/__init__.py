"""This machine and this job: where the process stands in a job (:mod:`.job`), the glibc
allocator settings of training processes (:mod:`.allocator`), a function run on N local
processes over gloo (:mod:`.local_processes`), where sockets listen (:mod:`.loopback`,
:mod:`.ft_network`), the run's TLS credentials (:mod:`.credentials`) and forwarders
(:mod:`.tls_forward`, :mod:`.tls_routes`), and the restricted unpickler (:mod:`.safe_unpickle`).
Low in the tree so that the launcher, the planner's calibration, the automatic layout and the
fault-tolerant groups all read the same facts.
"""
