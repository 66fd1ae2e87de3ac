"""Turning facts into verdicts: vLLM-compatible hashing, residency index, attribution, spans."""
