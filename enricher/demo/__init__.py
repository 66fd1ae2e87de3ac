"""`kvmiss demo`: a simulated vLLM fleet on real sockets, attributed by the whole real kvmiss
pipeline and checked against the simulator's ground truth.

engine (block pool + scheduler) -> publisher (vLLM wire protocol) ~ZeroMQ~> kvmiss serve
(host: the real Service in-process) <~OTLP~ spans of finished requests (emit: OTel SDK,
router over gRPC, engine over HTTP); kvmiss exports enriched spans to a file, which is read
back (report.data) and scored against the truth (truth, report). workload + router drive
it, faults break it on purpose, timeline keeps the stream facts, run wires it, and
kvmiss.enricher.report draws the HTML report.
"""
