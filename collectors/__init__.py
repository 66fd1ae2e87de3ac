"""Getting engine facts in: KV-event frames, per-worker streams with continuity, recordings."""
