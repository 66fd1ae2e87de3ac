"""Estimates, kept apart from the proofs: what a different cache would have done (whatif.py,
`kvmiss whatif`). Never a label; nothing in core/ imports them."""
