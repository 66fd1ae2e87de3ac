"""Keyed block digests: stable under one key, unlinkable across keys, and the secret never shows.
Verdicts built with them carry no block hash in any form.
"""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from kvmiss.enricher.core.privacy import DigestKey, DigestKeyError, load_digest_key
from kvmiss.enricher.core.verdict import REASON_MAX_CHARS, attribute
from kvmiss.schemas.attribution import (
    LABEL_OWNER,
    Evidence,
    History,
    Holder,
    Presence,
    RequestFacts,
    TierHolding,
    TransferAttempt,
    TransferResult,
    WindowStart,
)

SECRET = "s3cret-deployment-key-0123456789"
OTHER = "another-deployment-key-987654321"
H = 0xFEDCBA9876543210  # >= 2**63: the engine's external form reaches the top bit


class TestDigest:
    def test_one_key_gives_one_digest_per_block(self):
        assert DigestKey(SECRET).digest_block(H) == DigestKey(SECRET).digest_block(H)

    def test_str_and_bytes_secrets_are_the_same_key(self):
        assert DigestKey(SECRET).digest_block(H) == DigestKey(SECRET.encode()).digest_block(H)

    def test_different_blocks_give_different_digests(self):
        key = DigestKey(SECRET)
        assert key.digest_block(H) != key.digest_block(H - 1)

    def test_different_keys_give_unlinkable_digests(self):
        ours, theirs = DigestKey(SECRET).digest_block(H), DigestKey(OTHER).digest_block(H)
        assert ours.split(":")[1] != theirs.split(":")[1]

    def test_a_digest_is_the_key_id_and_16_hex_digits(self):
        key = DigestKey(SECRET)
        digest = key.digest_block(H)
        assert re.fullmatch(r"[0-9a-f]{8}:[0-9a-f]{16}", digest)
        assert digest.startswith(key.key_id + ":")

    def test_a_digest_does_not_contain_the_block_hash(self):
        digest = DigestKey(SECRET).digest_block(H)
        assert f"{H:x}" not in digest and str(H) not in digest

    @pytest.mark.parametrize("bad", [-1, 1 << 64])
    def test_only_canonical_uint64_hashes_are_digested(self, bad):
        with pytest.raises(ValueError, match="uint64"):
            DigestKey(SECRET).digest_block(bad)

    def test_both_ends_of_the_uint64_range_are_digested(self):
        key = DigestKey(SECRET)
        assert key.digest_block(0) != key.digest_block((1 << 64) - 1)


class TestKeyId:
    def test_rotation_changes_the_key_id(self):
        assert DigestKey(SECRET).key_id != DigestKey(OTHER).key_id

    def test_the_key_id_is_stable_for_one_secret(self):
        assert DigestKey(SECRET).key_id == DigestKey(SECRET).key_id

    def test_the_key_id_is_eight_hex_digits_not_derived_from_the_secret_text(self):
        key_id = DigestKey(SECRET).key_id
        assert re.fullmatch(r"[0-9a-f]{8}", key_id)
        assert key_id not in SECRET.encode().hex()


class TestSecretNeverShows:
    def test_repr_and_str_show_only_the_key_id(self):
        key = DigestKey(SECRET)
        for text in (repr(key), str(key)):
            assert SECRET not in text
            assert key.key_id in text

    def test_the_secret_is_not_kept_on_the_key(self):
        key = DigestKey(SECRET)
        assert all(SECRET not in str(value) for value in vars(key).values())

    def test_a_short_secret_is_refused_without_echoing_it(self):
        with pytest.raises(DigestKeyError, match="too short") as err:
            DigestKey("short-pw")
        assert "short-pw" not in str(err.value)

    def test_a_secret_of_the_wrong_type_is_refused(self):
        with pytest.raises(DigestKeyError, match="bytes or str"):
            DigestKey(12345678901234567890)


class TestLoadDigestKey:
    ENV = "KVMISS_TEST_DIGEST_SECRET"

    def test_an_inline_secret_is_used(self):
        assert load_digest_key(SECRET, None).key_id == DigestKey(SECRET).key_id

    def test_an_environment_variable_is_read(self, monkeypatch):
        monkeypatch.setenv(self.ENV, SECRET)
        assert load_digest_key(None, self.ENV).key_id == DigestKey(SECRET).key_id

    def test_nothing_configured_is_an_error(self):
        with pytest.raises(DigestKeyError, match="no digest secret configured"):
            load_digest_key(None, None)

    def test_both_configured_is_an_error_that_does_not_echo_the_secret(self, monkeypatch):
        monkeypatch.setenv(self.ENV, SECRET)
        with pytest.raises(DigestKeyError, match="not both") as err:
            load_digest_key(SECRET, self.ENV)
        assert SECRET not in str(err.value)

    def test_an_unset_variable_is_named_in_the_error(self, monkeypatch):
        monkeypatch.delenv(self.ENV, raising=False)
        with pytest.raises(DigestKeyError, match=f"{self.ENV} .*not set or empty"):
            load_digest_key(None, self.ENV)

    def test_a_short_secret_in_the_environment_names_the_variable_not_the_value(self, monkeypatch):
        monkeypatch.setenv(self.ENV, "tiny-pw")
        with pytest.raises(DigestKeyError, match=self.ENV) as err:
            load_digest_key(None, self.ENV)
        assert "tiny-pw" not in str(err.value)

    def test_a_secret_pasted_as_the_variable_name_is_not_echoed(self):
        pasted = "s3cret/with+base64=="
        with pytest.raises(DigestKeyError, match="not a valid name") as err:
            load_digest_key(None, pasted)
        assert pasted not in str(err.value)


# --- verdicts: no field may carry a block hash, in any form ----------------------------------

# At least 13 characters in every form (unsigned, signed int64, hex), longer than any seq or
# timestamp the evidence can carry, so a match is never chance.
uint64s = st.integers(min_value=1 << 48, max_value=(1 << 64) - (1 << 48))
seqs = st.none() | st.integers(min_value=0, max_value=(1 << 32) - 1)
times = st.none() | st.floats(min_value=0.0, max_value=2e9)


def sometimes(strategy):
    """Usually empty, so the later precedence rules (history, presence) get exercised too."""
    return st.one_of(st.just(()), st.just(()), st.just(()), strategy.map(tuple))


@st.composite
def facts_and_evidence(draw):
    b = draw(st.integers(min_value=1, max_value=64))
    n = draw(st.integers(min_value=0, max_value=40 * b))
    chain = st.lists(uint64s, min_size=n // b, max_size=n // b + 1)
    attempts = st.builds(TransferAttempt, st.sampled_from(TransferResult))
    facts = RequestFacts(
        prompt_tokens=n,
        cached_tokens=draw(st.integers(min_value=0, max_value=n)),
        block_size=b,
        worker=draw(st.none() | st.just("A")),
        lookup_time=draw(times),
        block_hashes=draw(st.none() | chain | st.lists(uint64s, max_size=2)),
        extra_key_kinds=tuple(draw(st.lists(st.sampled_from(["lora", "cache_salt", "mm"])))),
        transfers=draw(sometimes(st.lists(attempts))),
    )
    evidence = st.builds(
        Evidence,
        history=st.just(History.CONTINUOUS) | st.sampled_from(History),
        presence=st.sampled_from(Presence),
        epoch=seqs,
        stored_seq=seqs,
        removed_seq=seqs,
        removed_ts=times,
        removed_by_clear=st.booleans(),
        window_start=st.none() | st.sampled_from(WindowStart),
        window_start_ts=times,
        gap_from_seq=seqs,
        gap_to_seq=seqs,
        applied_through_ts=times,
        tiers=sometimes(st.lists(st.builds(TierHolding, st.just("CPU"), times), max_size=1)),
        holders=sometimes(st.lists(st.builds(Holder, st.just("B"), st.just("GPU"), times))),
    )
    return facts, draw(st.none() | evidence)


def hash_forms(h: int) -> set[str]:
    signed = h - (1 << 64) if h >= 1 << 63 else h  # how OTel int attributes carry it
    return {str(h), str(signed), f"{h:x}", f"{h:X}", f"{h:016x}"}


@settings(max_examples=500)
@given(facts_and_evidence())
def test_no_verdict_field_carries_a_block_hash_and_every_reason_is_bounded(case):
    facts, evidence = case
    verdict = attribute(facts, evidence, digest=DigestKey(SECRET).digest_block)
    encoded = msgspec.json.encode(verdict).decode()
    for h in facts.block_hashes or ():
        for form in hash_forms(h):
            assert form not in encoded
    assert 0 < len(verdict.reason) <= REASON_MAX_CHARS
    assert verdict.owner is LABEL_OWNER[verdict.label]
