"""`kvmiss demo`: a simulated vLLM fleet on real sockets, attributed by the real pipeline and
checked against the simulator's ground truth.

engine (block pool + scheduler) -> publisher (vLLM wire protocol) ~ZeroMQ~> kvmiss collector
-> residency index -> attribution; workload + router drive it, faults break it on purpose,
truth judges it, report sums it up, run wires it.
"""
