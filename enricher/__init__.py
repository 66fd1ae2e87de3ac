"""Turning facts into verdicts, one folder per layer: core/ (hashing, residency index, evidence,
verdict rules), estimates/ (what-if), otlp/ (spans in and out, on the wire), service/ (the
pipeline, `kvmiss serve`), and the front ends cli/, demo/, report/."""

# The one place the version is written: pyproject.toml reads it (setuptools dynamic version),
# `kvmiss --version` prints it, so a wheel, an editable install and the checkout agree.
__version__ = "0.2.0"
