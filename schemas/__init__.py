"""Wire and record types: every Struct kvmiss reads or writes is defined once, here."""
