"""The attribution core: block hashes, the residency index, evidence and the verdict rules.

Pure: no sockets, clocks or threads (times are arguments). Start at verdict.py for the
labels and their precedence, evidence.py for what the index proves at a lookup time.
"""
