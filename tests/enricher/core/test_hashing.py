"""Block hashes are vLLM's: the 0.33 vectors, extra keys, fast CBOR, lookup limits, bad input."""

from __future__ import annotations

import pickle
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings, strategies as st
from shared_data import load_json

from kvmiss.enricher.core.geometry import lookup_limit_tokens, max_cache_hit_tokens
from kvmiss.enricher.core.hashing import (
    DEFAULT_NONE_HASH_SEED,
    HASH_FUNCTIONS,
    BlockHasher,
    HashingError,
    LoraRef,
    MMItem,
    RequestExtras,
    external_hash,
)

VECTORS = "vllm-0.33.0-hash-vectors.json"
FRAMES = "vllm-0.33.0-event-frames.json"


def extras_of(case: dict) -> RequestExtras:
    """The vector case's request inputs, as the hasher takes them."""
    lora = case["lora_request"]
    digests = case["prompt_embeds_block_digests"]
    return RequestExtras(
        lora=LoraRef(lora["lora_name"], lora["lora_path"]) if lora else None,
        mm_items=tuple(MMItem(m["identifier"], m["offset"], m["length"]) for m in case["mm_features"]),
        cache_salt=case["cache_salt"],
        prompt_embeds_digests=tuple(bytes.fromhex(d["sha256_hex"]) for d in digests) if digests else None,
    )


def as_json(value: Any) -> Any:
    """The vectors' JSON encoding: tuples as lists, bytes as {"bytes_hex": ...}."""
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, (tuple, list)):
        return [as_json(v) for v in value]
    return value


def naive_chain(algo: str, none_hash: bytes, tokens: list[int], size: int, keys: list) -> list[bytes]:
    """vLLM's own loop: hash_fn((parent, tuple(block), extra_keys)) with the generic hash_fn."""
    hash_fn, parent, out = HASH_FUNCTIONS[algo], none_hash, []
    for index, extra in enumerate(keys):
        parent = hash_fn((parent, tuple(tokens[index * size:(index + 1) * size]), extra))
        out.append(parent)
    return out


class TestVllmVectors:
    def test_none_hash_is_the_seed_string_hashed_and_unseeded_xxhash_is_refused(self):
        for entry in load_json(VECTORS)["none_hash"]:
            algo, seed = entry["hash_fn"], entry["PYTHONHASHSEED"]
            if not entry["reproducible"]:
                with pytest.raises(HashingError, match="PYTHONHASHSEED"):
                    BlockHasher(algo, seed=seed, block_size=16)
                continue
            assert entry["seed_string"] == (DEFAULT_NONE_HASH_SEED if seed is None else seed)
            preimage = bytes.fromhex(entry["none_hash_preimage_hex"])
            if algo.endswith("_cbor"):
                assert preimage == cbor2.dumps(entry["seed_string"], canonical=True)
            else:
                assert preimage == pickle.dumps(entry["seed_string"], pickle.HIGHEST_PROTOCOL)
            hasher = BlockHasher(algo, seed=seed, block_size=16)
            assert hasher.none_hash.hex() == entry["none_hash_hex"]

    def test_every_case_reproduces_hashes_external_ints_and_preimages(self):
        vectors = load_json(VECTORS)
        checked, mismatches = 0, []
        for case in vectors["cases"]:
            tokens, extras = case["token_ids"], extras_of(case)
            for result in case["results"]:
                if "skipped" in result:
                    continue
                where = f"{case['id']}/{result['hash_fn']}/seed={result['PYTHONHASHSEED']}"
                hasher = BlockHasher(
                    result["hash_fn"],
                    seed=result["PYTHONHASHSEED"],
                    block_size=case["block_size"],
                    lookahead_tokens=case["num_hash_lookahead_tokens"],
                )
                digests = hasher.hash_request(tokens, extras)
                got = {
                    "none_hash_hex": hasher.none_hash.hex(),
                    "num_full_blocks": hasher.num_hashed_blocks(len(tokens)),
                    "block_hashes_hex": [d.hex() for d in digests],
                    "block_hashes_external_int": [external_hash(d) for d in digests],
                }
                mismatches += [f"{where}: {k}" for k, v in got.items() if v != result[k]]
                keys = hasher.block_extra_keys(tokens, extras)
                parent = None
                for block, extra in zip(result["blocks"], keys, strict=True):
                    start, end = block["token_range"]
                    preimage = hasher.preimage(parent, tokens[start:end], extra)
                    if as_json(extra) != block["extra_keys"]:
                        mismatches.append(f"{where} block {block['index']}: extra_keys")
                    if preimage.hex() != block["preimage_hex"]:
                        mismatches.append(f"{where} block {block['index']}: preimage")
                    parent = hasher.hash_block(parent, tokens[start:end], extra)
                    if parent.hex() != block["hash_hex"] or external_hash(parent) != block["external_int"]:
                        mismatches.append(f"{where} block {block['index']}: hash_block")
                checked += 1
        assert mismatches == []
        assert checked == sum("skipped" not in r for c in vectors["cases"] for r in c["results"]) > 0

    def test_untagged_keys_have_the_shape_033_publishes_in_events(self):
        for case in load_json(VECTORS)["cases"]:
            hasher = BlockHasher("sha256_cbor", seed="0", block_size=case["block_size"],
                                 extra_keys_format="untagged")
            keys = hasher.block_extra_keys(case["token_ids"], extras_of(case))
            published = [b["event_extra_keys"] for b in case["results"][0]["blocks"]]
            assert [as_json(k) for k in keys[: len(published)]] == published, case["id"]

    def test_expected_max_cache_hit_follows_the_lookup_limit(self):
        for case in load_json(VECTORS)["cases"]:
            blocks = case["results"][0]["num_full_blocks"]
            hit = max_cache_hit_tokens(case["num_tokens"], case["block_size"], blocks)
            assert hit == case["expected_max_cache_hit_tokens_if_every_block_cached"], case["id"]


class TestEventFrameInputs:
    def test_request_a_plain_chain(self):
        inputs = load_json(FRAMES)["hash_inputs"]
        req = inputs["request_A"]
        hasher = BlockHasher(inputs["hash_fn"], seed=inputs["PYTHONHASHSEED"], block_size=req["block_size"])
        assert hasher.none_hash.hex() == inputs["none_hash_hex"]
        assert [d.hex() for d in hasher.hash_request(req["token_ids"])] == req["block_hashes_hex"]

    def test_request_b_lora_and_salt(self):
        inputs = load_json(FRAMES)["hash_inputs"]
        req = inputs["request_B"]
        hasher = BlockHasher(inputs["hash_fn"], seed=inputs["PYTHONHASHSEED"], block_size=req["block_size"])
        extras = RequestExtras(lora=LoraRef(req["lora"]["name"], req["lora"]["path"]),
                               cache_salt=req["cache_salt"])
        assert as_json(hasher.block_extra_keys(req["token_ids"], extras)) == req["hashed_extra_keys"]
        assert [d.hex() for d in hasher.hash_request(req["token_ids"], extras)] == req["block_hashes_hex"]


class TestLookupLimit:
    @pytest.mark.parametrize(("prompt", "limit"), [(0, 0), (1, 0), (16, 0), (17, 16), (32, 16), (33, 32)])
    def test_last_prompt_token_is_never_served_from_cache(self, prompt, limit):
        assert lookup_limit_tokens(prompt, 16) == limit

    def test_hit_is_capped_by_the_cached_prefix(self):
        assert max_cache_hit_tokens(100, 16, 2) == 32
        assert max_cache_hit_tokens(100, 16, 7) == 96
        assert max_cache_hit_tokens(0, 16, 0) == 0


class TestExtraKeys:
    hasher = BlockHasher("sha256_cbor", seed="0", block_size=16)

    def test_mm_offsets_are_relative_to_the_block_and_negative_for_a_tail(self):
        extras = RequestExtras(mm_items=(MMItem("img", 20, 30),))
        keys = self.hasher.block_extra_keys(range(64), extras)
        assert keys == [None, (("mm", "img", 4),), (("mm", "img", -12),), (("mm", "img", -28),)]

    def test_item_ending_at_a_block_start_stays_out_of_that_block(self):
        extras = RequestExtras(mm_items=(MMItem("a", 0, 16), MMItem("b", 16, 2), MMItem("c", 20, 4)))
        keys = self.hasher.block_extra_keys(range(32), extras)
        assert keys == [(("mm", "a", 0),), (("mm", "b", 0), ("mm", "c", 4))]

    def test_salt_only_on_block_zero_and_an_empty_salt_is_no_salt(self):
        assert self.hasher.block_extra_keys(range(32), RequestExtras(cache_salt="s")) == [
            (("cache_salt", "s"),), None]
        assert self.hasher.block_extra_keys(range(32), RequestExtras(cache_salt="")) == [None, None]

    def test_order_is_lora_then_mm_then_salt_then_prompt_embeds(self):
        extras = RequestExtras(LoraRef("l", "/p"), (MMItem("m", 3, 2),), "s", (b"d" * 32,))
        tagged = self.hasher.block_extra_keys(range(16), extras)
        untagged = BlockHasher("sha256_cbor", seed="0", block_size=16, extra_keys_format="untagged")
        assert tagged == [(("lora", "l", "/p"), ("mm", "m", 3), ("cache_salt", "s"),
                           ("prompt_embeds", b"d" * 32))]
        assert untagged.block_extra_keys(range(16), extras) == [("l", ("m", 3), "s", b"d" * 32)]

    def test_tagged_keys_need_the_lora_path_untagged_do_not(self):
        extras = RequestExtras(lora=LoraRef("l"))
        with pytest.raises(HashingError, match="lora.path"):
            self.hasher.hash_request(range(16), extras)
        untagged = BlockHasher("sha256_cbor", seed="0", block_size=16, extra_keys_format="untagged")
        assert untagged.block_extra_keys(range(16), extras) == [("l",)]

    def test_lookahead_appends_the_next_tokens_and_waits_for_them(self):
        hasher = BlockHasher("sha256_cbor", seed="0", block_size=4, lookahead_tokens=2)
        assert hasher.block_extra_keys(list(range(10)), RequestExtras(cache_salt="s")) == [
            ((("cache_salt", "s"),), 4, 5), (None, 8, 9)]
        assert hasher.num_hashed_blocks(9) == 1

    def test_too_few_prompt_embeds_digests_is_an_error(self):
        with pytest.raises(HashingError, match="prompt_embeds_digests"):
            self.hasher.hash_request(range(32), RequestExtras(prompt_embeds_digests=(b"x" * 32,)))


# Token ids at every CBOR width boundary, ids whose payload holds the sentinel's five 0xff
# bytes (forcing the block-by-block path), a bignum, and ordinary ids.
_SENTINEL_ID = 0x45_FF_FFFF_FFFF  # CBOR 1b 00 00 45 ff ff ff ff ff: the sentinel's encoding
_EDGES = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, _SENTINEL_ID, 2**64 - 1, 2**70]
token_ids = st.one_of(st.sampled_from(_EDGES), st.integers(0, 150_000), st.integers(0, 2**64 - 1))
_DIGESTS = tuple(bytes([i]) * 16 + b"\xff" * 16 for i in range(96))  # one per block, and more


@st.composite
def request_extras(draw) -> RequestExtras | None:
    if draw(st.booleans()):
        return None
    spans = draw(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20)), max_size=4))
    items, end = [], 0
    for i, (gap, length) in enumerate(spans):
        items.append(MMItem(f"mm-{i}", end + gap, length))
        end += gap + length
    return RequestExtras(
        lora=draw(st.none() | st.builds(LoraRef, st.text(max_size=6), st.text(max_size=6))),
        mm_items=tuple(items),
        cache_salt=draw(st.none() | st.text(max_size=6)),
        prompt_embeds_digests=_DIGESTS if draw(st.booleans()) else None,
    )


class TestRequestPath:
    """`hash_request` assembles preimages itself; they must be vLLM's generic encodings."""

    @settings(max_examples=300, deadline=None)
    @given(
        algo=st.sampled_from(sorted(HASH_FUNCTIONS)),
        key_format=st.sampled_from(["tagged", "untagged"]),
        size=st.sampled_from([1, 4, 16, 24]),
        lookahead=st.integers(0, 2),
        tokens=st.lists(token_ids, max_size=96),
        extras=request_extras(),
    )
    def test_preimages_and_hashes_equal_vllms_generic_loop(
        self, algo, key_format, size, lookahead, tokens, extras
    ):
        hasher = BlockHasher(algo, seed="0", block_size=size, extra_keys_format=key_format,
                             lookahead_tokens=lookahead)
        keys = hasher.block_extra_keys(tokens, extras)
        expected = naive_chain(algo, hasher.none_hash, tokens, size, keys)
        assert hasher.hash_request(tokens, extras) == expected
        parents = [hasher.none_hash, *expected]
        encode = (lambda obj: cbor2.dumps(obj, canonical=True)) if algo.endswith("_cbor") else (
            lambda obj: pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))
        assert hasher.request_preimages(tokens, extras) == [
            encode((parents[i], tuple(tokens[i * size:(i + 1) * size]), key))
            for i, key in enumerate(keys)
        ]

    def test_an_id_that_encodes_like_the_block_sentinel_still_hashes_like_vllm(self):
        hasher = BlockHasher("sha256_cbor", seed="0", block_size=2)
        tokens = [1, _SENTINEL_ID, 3, 4, 5]
        assert hasher.hash_request(tokens) == naive_chain("sha256_cbor", hasher.none_hash, tokens, 2,
                                                          [None, None])


class TestBadInput:
    def test_unknown_algorithm(self):
        with pytest.raises(HashingError, match="unknown hash algorithm 'md5'"):
            BlockHasher("md5", seed="0", block_size=16)

    @pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
    def test_xxhash_without_a_seed_cannot_be_reproduced(self, algo):
        with pytest.raises(HashingError, match="pass the engines' PYTHONHASHSEED"):
            BlockHasher(algo, seed=None, block_size=16)

    @pytest.mark.parametrize("bad", [["1"], [1.0], [None], [-1], [True]])
    @pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
    def test_token_ids_must_be_non_negative_ints(self, algo, bad):
        hasher = BlockHasher(algo, seed=None, block_size=1)
        with pytest.raises(HashingError, match="token_ids"):
            hasher.hash_request([5, *bad])
        with pytest.raises(HashingError, match="token_ids"):
            hasher.hash_block(None, bad, None)

    @pytest.mark.parametrize(
        "kwargs",
        [{"block_size": 0}, {"block_size": 16, "extra_keys_format": "tags"},
         {"block_size": 16, "lookahead_tokens": -1}, {"block_size": 16, "seed": 0}],
    )
    def test_bad_configuration(self, kwargs):
        with pytest.raises(HashingError):
            BlockHasher("sha256", **{"seed": None, **kwargs})

    @pytest.mark.parametrize(
        "items", [(MMItem("a", 10, 4), MMItem("b", 2, 4)), (MMItem("a", 0, 8), MMItem("b", 4, 8)),
                  (MMItem("a", -1, 4),), (MMItem("a", 0, 0),)],
    )
    def test_mm_items_must_be_sorted_disjoint_spans(self, items):
        with pytest.raises(HashingError, match="mm_items"):
            RequestExtras(mm_items=items)
