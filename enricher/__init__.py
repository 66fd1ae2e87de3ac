"""Turning facts into verdicts, one folder per layer: core/ (hashing, residency index, evidence,
verdict rules), estimates/ (what-if), otlp/ (spans in and out, on the wire), service/ (the
pipeline, `kvmiss serve`), and the front ends cli/, demo/, report/."""
