"""The OTLP edge: spans in (receiver.py on listener.py), request facts read and verdicts
written on the wire (spans.py, its C twin _otlpwire.c), fragments joined (assembly.py),
spans out (exporter.py, journal.py); the small interfaces between them in interfaces.py."""
