"""What-if sizing (enricher/estimates/whatif.py, `kvmiss whatif`): the pool model against a brute-force
simulation of the same policy, the regime where estimates are uncertain, output chains from
parent links, and the command over a real recording file."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
from hypothesis import given, settings, strategies as st

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.enricher.estimates.whatif import PoolRequest, curve, output_chains, replay
from kvmiss.schemas.events import BlockStored, EventBatch

B = 4


def brute_force(requests: list[PoolRequest], pool_blocks: int, block_size: int) -> list[int]:
    """The same policy with plain lists and linear scans: free list head first, a taken
    block loses its hash, hits are the longest cached run under the lookup limit, blocks are
    freed tail first at finish (to the back with a hash, to the front without)."""
    free = list(range(1, pool_blocks))
    hashed: dict[int, int] = {}
    refs: dict[int, int] = {}
    cached = [0] * len(requests)
    held: dict[int, list[int]] = {}
    events = sorted([(r.lookup_time, 1, i) for i, r in enumerate(requests)]
                    + [(r.finish_time, 0, i) if r.finish_time > r.lookup_time else (r.lookup_time, 2, i)
                       for i, r in enumerate(requests)])
    for _, kind, i in events:
        r = requests[i]
        if kind == 1:
            hits = []
            for h in r.chain[:max(0, (r.prompt_tokens - 1) // block_size)]:
                holders = sorted(b for b, x in hashed.items() if x == h)
                if not holders:
                    break
                hits.append(holders[0])
            for b in hits:
                refs[b] = refs.get(b, 0) + 1
                if b in free:
                    free.remove(b)
            blocks = list(hits)
            total = -(-(r.prompt_tokens + r.output_tokens) // block_size)
            for k in range(len(hits), total):
                if not free:
                    break
                b = free.pop(0)
                hashed.pop(b, None)
                refs[b] = 1
                if k < len(r.chain):
                    hashed[b] = r.chain[k]
                blocks.append(b)
            held[i], cached[i] = blocks, len(hits) * block_size
        else:
            blocks = held.pop(i)
            for k, h in enumerate(r.output_chain):
                at = len(r.chain) + k
                if at < len(blocks) and blocks[at] not in hashed:
                    hashed[blocks[at]] = h
            for b in reversed(blocks):
                refs[b] -= 1
                if not refs[b]:
                    del refs[b]
                    if b in hashed:
                        free.append(b)
                    else:
                        free.insert(0, b)  # a block caching nothing is reused first
    return cached


@st.composite
def workloads(draw):
    prefixes = draw(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=5), min_size=1, max_size=4))
    requests, t = [], 0.0
    for _ in range(draw(st.integers(1, 30))):
        t += draw(st.floats(0.0, 2.0))
        chain = list(draw(st.sampled_from(prefixes))) + draw(st.lists(st.integers(41, 90), max_size=3))
        prompt = len(chain) * B + draw(st.integers(0, B - 1))
        out = draw(st.integers(0, 2 * B))
        full_out = (prompt + out) // B - len(chain)
        requests.append(PoolRequest(lookup_time=t, finish_time=t + draw(st.floats(0.0, 3.0)), prompt_tokens=prompt,
                                    output_tokens=out, chain=chain,
                                    output_chain=[1000 + len(requests) * 10 + k for k in range(max(0, full_out))]))
    return requests


@settings(max_examples=300, deadline=None)
@given(workloads(), st.integers(2, 40))
def test_the_pool_model_equals_a_brute_force_simulation_of_the_same_policy(requests, pool_blocks):
    result = replay(requests, pool_blocks, B)
    assert result.per_request == brute_force(requests, pool_blocks, B)
    for r, cached in zip(requests, result.per_request):
        assert cached <= max(0, (r.prompt_tokens - 1) // B) * B  # the lookup limit holds


def repeat(chain: list[int], t: float, out: int = 0) -> PoolRequest:
    return PoolRequest(lookup_time=t, finish_time=t + 0.1, prompt_tokens=len(chain) * B + 1, output_tokens=out,
                       chain=chain)


def test_a_chain_evicted_at_one_size_is_served_at_a_larger_one():
    a, b = [1, 2, 3], [11, 12, 13]
    requests = [repeat(a, 0), repeat(b, 1), repeat(a, 2)]  # 4 blocks each (3 full + 1 partial)
    small = replay(requests, 5, B)  # 4 usable blocks: b's blocks take a's
    big = replay(requests, 9, B)
    assert small.per_request == [0, 0, 0] and big.per_request == [0, 0, 3 * B]


def test_the_tail_of_a_freed_chain_is_evicted_before_its_head():
    long, other = [1, 2, 3, 4], [21, 22]
    requests = [repeat(long, 0), repeat(other, 1), repeat(long, 2)]
    # 6 usable blocks: long takes 5 (4 full + 1 partial) and frees them tail first, the
    # partial one to the front; other needs 3: that one, the unused one, then long's last
    result = replay(requests, 7, B)
    assert result.per_request[2] == 3 * B  # blocks 1..3 of long survived, block 4 did not


def test_a_pool_crowded_at_the_recorded_size_marks_every_estimate_uncertain():
    requests = [PoolRequest(lookup_time=0.0, finish_time=10.0, prompt_tokens=8 * B + 1, output_tokens=0,
                            chain=list(range(1, 9))),
                PoolRequest(lookup_time=1.0, finish_time=2.0, prompt_tokens=8 * B + 1, output_tokens=0,
                            chain=list(range(11, 19)))]
    results = curve(requests, 12, B, scales=(1.0, 2.0))  # 11 usable: the second cannot be admitted
    assert all(r.uncertain and "waited" in r.reason for r in results.values())
    roomy = curve(requests, 64, B, scales=(1.0, 2.0))
    assert not any(r.uncertain for r in roomy.values())


def test_output_blocks_are_followed_by_parent_link_within_the_requests_lifetime():
    stores = [(0.5, 3, [30, 31]), (0.7, 31, [32]), (5.0, 32, [99]), (0.6, 7, [70])]
    chains = output_chains(stores, [(0.0, 1.0, [1, 2, 3], 3), (0.0, 1.0, [7], 1), (0.0, 1.0, [], 2)])
    assert chains == [[30, 31, 32], [70], []]


def test_whatif_command_over_a_recording(tmp_path):
    """A worker that stored a chain, evicted most of it, and was asked for it again."""
    rec = tmp_path / "events.rec"
    enc = msgspec.msgpack.Encoder()
    with RecordingWriter(rec) as writer:
        for seq, (ts, hashes) in enumerate([(1.0, [1, 2, 3]), (2.0, [11, 12, 13]), (3.0, [1, 2, 3])]):
            payload = enc.encode(EventBatch(ts=ts, events=[BlockStored(block_hashes=hashes, block_size=B)], dp_rank=0))
            writer.write(RecordedMessage(recv_ts=ts, worker="w0", socket="sub",
                                         frames=[b"kv", seq.to_bytes(8, "big"), payload]))
    requests = tmp_path / "requests.jsonl"
    rows = [{"worker": "w0", "prompt_tokens": 13, "cached_tokens": 0, "block_size": B, "lookup_time": t,
             "finish_time": t + 0.1, "output_tokens": 0, "block_hashes": chain}
            for t, chain in ((0.9, [1, 2, 3]), (1.9, [11, 12, 13]), (2.9, [1, 2, 3]))]
    requests.write_text("".join(json.dumps(r) + "\n" for r in rows))
    command = [sys.executable, "-m", "kvmiss.enricher.cli", "whatif", "--events", str(rec), "--requests", str(requests)]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and "--pool-blocks" in refused.stderr  # the pool size is not guessed
    done = subprocess.run(command + ["--pool-blocks", "6", "--scales", "1,2", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    # 5 usable blocks: the second chain takes the first's tail (its partial block, then hashes 3
    # and 2), so only block 0 is served again; at 2x all three full blocks are.
    assert [(r["scale"], r["pool_blocks"], r["predicted_cached_tokens"]) for r in lines] == [(1.0, 6, 4), (2.0, 12, 12)]
    for r in lines:
        assert r["observed_cached_tokens"] == 0 and r["requests"] == 3 and r["prompt_tokens"] == 39
        assert r["predicted_hit_ratio"] == round(r["predicted_cached_tokens"] / 39, 5) and r["uncertain"] is False
    # The engine cached nothing where the replay of the same pool keeps 4 of 39 tokens: the
    # replay does not model that engine, and the output says so (scale 1 only).
    assert lines[0]["calibration"]["gap_points"] == round(100 * 4 / 39, 1)
    assert "smaller than --pool-blocks" in lines[0]["calibration"]["likely_cause"]
    assert "calibration" not in lines[1]
    text = subprocess.run(command + ["--pool-blocks", "6", "--scales", "1,2"], capture_output=True, text=True)
    assert "w0: at scale 1 the replay predicts 10.3% against 0.0% observed (+10.3 points)" in text.stdout
    assert text.stdout.count("likely: ") == 1


def test_a_scale_one_prediction_within_a_point_needs_no_explanation():
    from kvmiss.enricher.cli.whatif_cmd import calibration_gap
    assert calibration_gap({"predicted_hit_ratio": 0.483, "observed_hit_ratio": 0.480}) is None
    assert calibration_gap({"predicted_hit_ratio": 0.40, "observed_hit_ratio": 0.45}) == -5.0


# --- the live estimate on an evicted miss ---------------------------------------------------------


def test_the_live_estimate_counts_the_evictions_between_the_blocks_removal_and_the_lookup():
    from fleet_builders import evicting_worker

    from kvmiss.enricher.estimates.whatif import eviction_estimate

    index, view = evicting_worker(3)
    margin = index.tail_margin_s
    at = lambda pool: eviction_estimate(view, 12, 1020.5, margin, pool)  # noqa: E731
    assert at(17).reuse_distance_blocks == 4  # itself and the 3 evicted after it
    assert [at(pool).scale for pool in (17, 9, 5, 3, 2)] == ["1.25", "1.5", "2", "4", "8"]
    index, view = evicting_worker(12)
    assert eviction_estimate(view, 12, 1020.5, margin, 2).scale == ">8"
    assert eviction_estimate(view, 12, 1020.5, margin, 0) is None  # the pool is not known
    index, view = evicting_worker(0, clear_at=12)
    assert eviction_estimate(view, 12, 1020.5, margin, 64) is None  # a reset: no pool size keeps it
