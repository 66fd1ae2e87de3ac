"""The compiled residency table against its reference model (enricher/core/residency_table.py).

Both get the same random stream of stores, removals, clears and prunes, and must give the
same answer to every query after every step. Hash values are drawn from a small pool so
that blocks are stored twice, removed, re-stored and pruned; the C table's growth, shrink
and backward-shift deletion are exercised by a second, larger pool.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kvmiss.enricher.core import residency_table
from kvmiss.enricher.core.residency_table import PyBlockTable

compiled = pytest.mark.skipif(not residency_table.ACCELERATED, reason="the C table was not built (no compiler at install)")


def test_the_compiled_table_is_built_where_ci_requires_it():
    """CI (`.ci/run`) installs with a compiler: the fallback must not hide a broken build."""
    if os.environ.get("KVMISS_REQUIRE_ACCELERATED") != "1":
        pytest.skip("set KVMISS_REQUIRE_ACCELERATED=1 to require the compiled table")
    assert residency_table.ACCELERATED


def _ops(pool: list[int]):
    hashes = st.lists(st.sampled_from(pool), min_size=1, max_size=6)
    return st.lists(st.one_of(
        st.tuples(st.just("store"), hashes),
        st.tuples(st.just("remove"), hashes),
        st.tuples(st.just("clear"), st.just(None)),
        st.tuples(st.just("prune"), st.integers(0, 40)),
        st.tuples(st.just("prune_some"), st.tuples(st.integers(0, 40), st.integers(0, 3))),
        st.tuples(st.just("next"), st.just(None)),
    ), max_size=120)


def _same(c, p, pool: list[int], seq: int, base: int) -> None:
    assert len(c) == len(p)
    assert c.older == p.older and c.retained == p.retained
    for h in pool:
        assert (h in c) == (h in p)
        assert c.chain(h) == p.chain(h), h
        assert c.copies(h) == p.copies(h)
        for step in (base - 1, base, (base + seq) // 2, seq, seq + 1):
            assert c.as_of(h, step) == p.as_of(h, step), (h, step)


def _run(ops, pool: list[int], base: int) -> None:
    c, p = residency_table.BlockTable(base), PyBlockTable(base)
    seq = base
    for op, arg in ops:
        ts = float(seq - base)
        if op == "store":
            assert c.store(arg, seq) == p.store(arg, seq)
        elif op == "remove":
            assert c.remove(arg, seq, ts) == p.remove(arg, seq, ts)
        elif op == "clear":
            assert c.clear(seq, ts) == p.clear(seq, ts)
        elif op == "prune":
            horizon = base + arg if arg <= seq - base else None
            assert sorted(c.prune(float(arg), horizon)) == sorted(p.prune(float(arg), horizon))
        elif op == "prune_some":  # in bounded shares of the retention queue: a whole prune's work
            before, limit = arg
            horizon = base + before if before <= seq - base else None
            shares = [c.prune(float(before), horizon, limit + 1) for _ in range(c.retained + 1)]
            assert sorted(h for share in shares for h in share) == sorted(p.prune(float(before), horizon))
            assert all(len(share) <= limit + 1 for share in shares)
        else:
            seq += 1
        _same(c, p, pool, seq, base)


SMALL_POOL = [0, 1, 2, 3, 2**64 - 1, 2**63, 12345678901234567890]


@compiled
@settings(max_examples=300, deadline=None)
@given(_ops(SMALL_POOL), st.sampled_from([0, 7, 10**12]))
def test_compiled_and_reference_tables_agree(ops, base):
    _run(ops, SMALL_POOL, base)


@compiled
def test_they_agree_through_growth_shrink_and_deletion_on_a_larger_population():
    rng = random.Random(11)
    pool = [rng.getrandbits(64) for _ in range(3000)] + list(range(64))  # sequential keys cluster
    c, p = residency_table.BlockTable(), PyBlockTable()
    for seq in range(400):
        batch = rng.sample(pool, 40)
        assert c.store(batch, seq) == p.store(batch, seq)
        gone = rng.sample(pool, 30)
        assert c.remove(gone, seq, float(seq)) == p.remove(gone, seq, float(seq))
        if seq % 97 == 96:
            assert c.clear(seq, float(seq)) == p.clear(seq, float(seq))
        if seq % 50 == 49:
            assert sorted(c.prune(seq - 30.0, seq - 30)) == sorted(p.prune(seq - 30.0, seq - 30))
    for h in pool:
        assert c.chain(h) == p.chain(h) and c.as_of(h, 200) == p.as_of(h, 200)
    assert len(c) == len(p)
    # Everything closes and ages out: the table gives its memory back.
    c.clear(400, 400.0), p.clear(400, 400.0)
    assert sorted(c.prune(1e9, None)) == sorted(p.prune(1e9, None))
    assert len(c) == len(p) == 0 and c.older == 0 and c.nbytes < 4096


@pytest.mark.parametrize("table", [residency_table.BlockTable, PyBlockTable])
def test_bad_values_are_refused_with_a_clear_error_and_leave_the_table_usable(table):
    t = table(100)
    with pytest.raises(OverflowError, match="outside this epoch's range"):
        t.store([1], 99)
    with pytest.raises(OverflowError, match=r"\[0, 2\*\*64\)"):
        t.store([-1], 100)
    with pytest.raises(OverflowError, match=r"\[0, 2\*\*64\)"):
        t.remove([2**64], 100, 0.0)
    t.store([5], 100)
    assert 5 in t and t.copies(5) == 1 and t.as_of(5, 101) == (100, None, False)
    assert "5" not in t and -5 not in t and t.as_of("5", 101) is None


@pytest.mark.parametrize("table", [residency_table.BlockTable, PyBlockTable])
@pytest.mark.parametrize("base", [0, 2**62])
def test_the_last_seq_of_the_span_is_kept_exactly_and_the_next_one_refused(table, base):
    t, last = table(base), base + residency_table.SEQ_SPAN - 1
    t.store([1], base)
    t.remove([1], last, 1.0)
    t.store([1, 2], last)
    assert t.chain(1) == [(last, None, False), (base, last, False)]
    assert t.as_of(1, last) == (base, last, False) and t.as_of(1, 2**63 - 1) == (last, None, False)
    assert t.as_of(2, last + 1) == (last, None, False) and t.as_of(2, -2**63) is None
    with pytest.raises(OverflowError, match="outside this epoch's range"):
        t.store([3], last + 1)
    with pytest.raises(OverflowError, match="outside this epoch's range"):
        t.remove([3], base - 1, 1.0)
    assert 3 not in t and t.prune(2.0, 2**63 - 1) == [1] and t.prune(2.0, None) == []
    assert t.chain(1) == [(last, None, False)] and t.older == 0


@compiled
def test_a_block_stored_again_links_its_history_and_gets_its_slot_back_when_that_ages_out():
    """The compiled table keeps a block's only interval in its slot; a second one moves the
    record to the arena, and pruning the older ones brings it back (memory given back)."""
    c, p = residency_table.BlockTable(), PyBlockTable()
    empty = c.nbytes
    for t in (c, p):
        t.store([7, 8], 0)
        t.remove([7], 1, 1.0)
        t.store([7], 2)
        t.store([7], 2)      # a second live copy, counted in the linked record
        t.remove([7], 3, 3.0)
        t.remove([8], 3, 3.0)
        t.remove([8], 4, 4.0)  # removed again: a closed interval with an unknown store
    assert c.chain(7) == p.chain(7) == [(2, None, False), (0, 1, False)]
    assert c.chain(8) == p.chain(8) == [(None, 4, False), (0, 3, False)]
    assert c.copies(7) == p.copies(7) == 1 and c.older == p.older == 2
    assert c.as_of(7, 2) == p.as_of(7, 2) == (0, 1, False)
    assert c.clear(5, 5.0) == p.clear(5, 5.0) == 1
    assert sorted(c.prune(2.0, 2)) == sorted(p.prune(2.0, 2)) == [7]
    assert c.chain(7) == p.chain(7) == [(2, 5, True)] and c.older == p.older == 1
    assert sorted(c.prune(4.5, 5)) == sorted(p.prune(4.5, 5)) == [8]
    assert c.older == p.older == 0 and c.chain(8) == p.chain(8) == []
    c.store([7], 6), p.store([7], 6)
    assert c.chain(7) == p.chain(7) == [(6, None, False), (2, 5, True)]
    assert sorted(c.prune(9.0, None)) == sorted(p.prune(9.0, None)) == [7]
    assert c.chain(7) == p.chain(7) == [(6, None, False)] and c.older == 0
    assert c.nbytes == empty


@compiled
def test_the_retention_queue_keeps_apply_order_whatever_the_engine_clock_does():
    """The compiled queue stores one ts per run of closes at the same ts; runs must not merge
    across a different ts, so a clock that steps back holds later records as the model does."""
    rng = random.Random(3)
    c, p = residency_table.BlockTable(), PyBlockTable()
    pool = list(range(200))
    for seq in range(300):
        ts = rng.choice([1.0, 2.0, 2.0, 3.0, float(seq), -0.0, 0.0])
        batch = rng.sample(pool, 5)
        assert c.store(batch, seq) == p.store(batch, seq)
        for _ in range(rng.randrange(4)):
            gone = rng.sample(pool, rng.randrange(1, 4))
            assert c.remove(gone, seq, ts) == p.remove(gone, seq, ts)
        if seq % 7 == 6:
            before = rng.choice([0.5, 1.5, 2.5, 3.5, seq / 2])
            assert sorted(c.prune(before, None)) == sorted(p.prune(before, None))
            assert c.retained == p.retained
    for h in pool:
        assert c.chain(h) == p.chain(h)


@compiled
def test_the_compiled_refcount_saturates_at_its_bound_and_removals_still_count(tmp_path):
    """Copies of one block saturate at REFS_MAX (2^31 - 1 in the real build): further stores
    are not counted, removals are, so the interval closes after REFS_MAX removals. A build
    with REFS_MAX=3 shows it (the reference model counts without bound)."""
    import importlib.util
    import shutil
    import sysconfig

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc to build a variant of the table")
    source = Path(residency_table.__file__).with_name("_blocktable.c")
    so = tmp_path / ("_blocktable" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([gcc, "-O1", "-fPIC", "-shared", "-DREFS_MAX=3", "-I" + sysconfig.get_paths()["include"],
                    str(source), "-o", str(so)], check=True, capture_output=True, timeout=120)
    spec = importlib.util.spec_from_file_location("kvmiss.enricher.core._blocktable", so)
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    t = variant.BlockTable(0)
    t.store([5] * 5, 0)
    assert t.copies(5) == 3
    assert t.remove([5, 5], 1, 1.0) == 0 and t.copies(5) == 1
    assert t.remove([5], 1, 1.0) == 1 and t.chain(5) == [(0, 1, False)]
    t.store([5], 2)
    t.store([5] * 4, 3)  # linked (a second interval): saturates the same way
    assert t.copies(5) == 3 and t.remove([5] * 3, 4, 4.0) == 1
    assert t.chain(5) == [(2, 4, False), (0, 1, False)]


def test_the_index_gives_the_same_verdicts_on_the_reference_model():
    """The fallback is a whole working index, not only a table: the worked cases pass on it."""
    env = dict(os.environ, KVMISS_PURE_PYTHON_TABLE="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/enricher/core/test_worked_cases.py", "tests/enricher/core/test_evidence.py"],
        env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[3], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout


def _event(kind: str, hashes: list[int], medium: str | None, group: int | None, spec: str | None = None,
           parent: bool = False, block_size: int = 16):
    from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
    if kind == "clear":
        return AllBlocksCleared()
    if kind == "store":
        return BlockStored(block_hashes=hashes, block_size=block_size, medium=medium, group_idx=group,
                           parent_block_hash=hashes[0] ^ 1 if parent else None, kv_cache_spec_kind=spec,
                           kv_cache_spec_sliding_window=64 if spec == "sliding_window" else None)
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


@compiled
@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(
    st.sampled_from(["store", "store", "remove", "clear"]),
    st.lists(st.sampled_from(SMALL_POOL), min_size=1, max_size=4),
    st.sampled_from([None, "GPU", "CPU", "cpu_pinned"]),
    st.sampled_from([None, 0, 1]),
    st.sampled_from([None, "full_attention", "sliding_window"]),
    st.booleans(),  # with a parent (else a root store: a possible re-announcement when resident)
    st.sampled_from([16, 16, 8, 0])), max_size=8), max_size=25))  # 8: a partial-block store
def test_the_compiled_event_loop_applies_batches_as_the_python_one_does(batches):
    """EpochResidency's compiled applier (any mix of media, groups and mid-batch clears) against
    its own Python loop over the same tables -- fed the event Structs, and fed the packed
    events collectors/_kvwire.c reads from the same batch's payload."""
    import msgspec

    from kvmiss.collectors._kvwire import scan_batch
    from kvmiss.enricher.core.epoch_residency import EpochResidency
    from kvmiss.schemas.events import EventBatch
    from kvmiss.schemas.stream import AppliedBatch, RunStart

    fast, slow, packed = EpochResidency("w", 0, None), EpochResidency("w", 0, None), EpochResidency("w", 0, None)
    slow._applier = None
    for seq, spec in enumerate(batches, start=5):
        events = [_event(*e) for e in spec]
        scanned = scan_batch(msgspec.msgpack.encode(EventBatch(float(seq), events, 0)))
        assert scanned is not None
        for view, given_events in ((fast, list(events)), (slow, list(events)), (packed, scanned[2])):
            view.apply(AppliedBatch(worker="w", epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                    events=given_events, run_start_seq=5, run_start=RunStart.EPOCH_START))
    for other in (fast, packed):
        assert other.same_step_copies == slow.same_step_copies
        assert other.log_removed == slow.log_removed  # evictions counted alike (what-if sizing)
        assert set(other.media) == set(slow.media) and set(other.tiers) == set(slow.tiers)
        assert other.groups == slow.groups and other.primary_group == slow.primary_group
        assert other.unproven == slow.unproven and other.counts == slow.counts
        for a, b in [(other.tiers[k], slow.tiers[k]) for k in other.tiers]:
            assert len(a) == len(b) and a.retained == b.retained
            for h in SMALL_POOL:
                assert a.chain(h) == b.chain(h) and a.copies(h) == b.copies(h)


@compiled
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62)), st.integers(-2**62, 2**62),
       st.lists(st.floats(allow_nan=False, width=64)), st.floats(allow_nan=False))
def test_the_batch_log_bisect_matches_the_standard_library(seqs, seq, times, t):
    import bisect
    from array import array

    from kvmiss.enricher.core.residency_table import bisect_left
    log_seq, log_ts = array("q", sorted(seqs)), array("d", sorted(times))
    assert bisect_left(log_seq, seq) == bisect.bisect_left(log_seq, seq)
    assert bisect_left(log_ts, t) == bisect.bisect_left(log_ts, t)
    with pytest.raises(TypeError):
        bisect_left(array("i", [1, 2]), 1)


def test_a_seq_past_the_tables_range_starts_a_fresh_view_instead_of_stopping_the_flow():
    """2^31 batches past an epoch's first cannot be packed (`SEQ_SPAN`); such a seq is months
    of batches or garbage that passed continuity as a hole. The index keeps going with a fresh
    view (no residency carried over)."""
    from kvmiss.enricher.core.index import ResidencyIndex
    from kvmiss.schemas.events import BlockStored
    from kvmiss.schemas.stream import AppliedBatch, RunStart

    index = ResidencyIndex(["w"])

    def apply(seq: int, h: int) -> None:
        index.apply(AppliedBatch(worker="w", epoch=0, seq=seq, ts=float(len(index.views("w"))), recv_ts=0.0,
                                 events=[BlockStored(block_hashes=[h], block_size=16)], run_start_seq=0,
                                 run_start=RunStart.EPOCH_START))

    apply(0, 11)
    apply(2**41, 22)
    views = index.views("w")
    assert len(views) == 2 and views[0].first_seq == 2**41
    assert 22 in views[0].media["GPU"] and 11 not in views[0].media["GPU"]
    assert 11 in views[1].media["GPU"]
