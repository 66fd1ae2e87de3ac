"""Keyed digests of block hashes: stable within one deployment, unlinkable across deployments.

A block hash is a function of prompt tokens and extra keys. Anyone who can guess a prompt can
recompute its hashes, so exporting them raw would let a trace reader confirm what a prompt
contained and link requests across deployments. A keyed BLAKE2b digest keeps the one property
traces need: the same block gives the same digest under one key, so misses can be grouped by
block. Every digest carries the key id, so a key rotation shows up as a new id rather than as
an unexplained change in every digest; the id is a one-way function of the secret.

``DigestKey.digest_block`` is pure and thread-safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

MIN_SECRET_BYTES = 16

# Domain separation: the key id, the derived BLAKE2b key and the block digests are three
# different functions of the secret, so none of them can be turned into another.
_KEY_ID_DOMAIN = b"kvmiss/digest-key-id/v1\x00"
_KEY_PERSON = b"kvmiss.key.v1"  # BLAKE2b person: at most 16 bytes
_BLOCK_PERSON = b"kvmiss.block.v1"
_TEXT_PERSON = b"kvmiss.text.v1"

_UINT64_LIMIT = 1 << 64
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class DigestKeyError(ValueError):
    """The digest secret is missing or unusable. Messages never contain the secret."""


@dataclasses.dataclass(frozen=True, repr=False)
class DigestKey:
    """A deployment's digest key, built from its secret (bytes, or str encoded as UTF-8).

    Only the key id and a derived key are kept; the secret itself is not stored, and
    ``repr``/``str`` show the key id alone. A derived 32-byte key lets secrets of any length
    work (BLAKE2b keys are limited to 64 bytes).
    """

    secret: dataclasses.InitVar[bytes | str]
    key_id: str = dataclasses.field(init=False)
    _key: bytes = dataclasses.field(init=False)

    def __post_init__(self, secret: bytes | str) -> None:
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if not isinstance(secret, bytes):
            raise DigestKeyError("digest secret must be bytes or str")
        if len(secret) < MIN_SECRET_BYTES:
            raise DigestKeyError(
                f"digest secret is too short: use at least {MIN_SECRET_BYTES} bytes of random data"
            )
        key_id = hashlib.sha256(_KEY_ID_DOMAIN + secret).hexdigest()[:8]
        key = hashlib.blake2b(secret, digest_size=32, person=_KEY_PERSON).digest()
        object.__setattr__(self, "key_id", key_id)
        object.__setattr__(self, "_key", key)

    def __repr__(self) -> str:
        return f"DigestKey(key_id={self.key_id!r})"

    def digest_block(self, block_hash: int) -> str:
        """``"<key_id>:<16 hex>"`` for a canonical uint64 block hash."""
        if not 0 <= block_hash < _UINT64_LIMIT:
            raise ValueError("block hash must be a canonical uint64 (0 <= h < 2**64)")
        mac = hashlib.blake2b(
            block_hash.to_bytes(8, "big"), key=self._key, digest_size=8, person=_BLOCK_PERSON
        )
        return f"{self.key_id}:{mac.hexdigest()}"

    def digest_text(self, value: str) -> str:
        """``"<key_id>:<16 hex>"`` for an extra-key value (a salt, an adapter): comparable
        within one deployment key, never reversible. Domain-separated from block digests."""
        mac = hashlib.blake2b(value.encode(), key=self._key, digest_size=8, person=_TEXT_PERSON)
        return f"{self.key_id}:{mac.hexdigest()}"


def load_digest_key(secret: str | None, env_name: str | None) -> DigestKey:
    """The configured key: an inline ``secret``, or the value of environment variable ``env_name``.

    Exactly one source must be configured, so a forgotten inline value cannot silently
    override the deployment's variable (or the reverse).
    """
    if secret is not None and env_name is not None:
        raise DigestKeyError(
            "configure the digest secret inline or through an environment variable, not both"
        )
    if secret is not None:
        return DigestKey(secret)
    if env_name is None:
        raise DigestKeyError(
            "no digest secret configured: name the environment variable that holds it"
        )
    # A secret pasted where the variable name belongs must not end up in an error message.
    if not _ENV_NAME.fullmatch(env_name):
        raise DigestKeyError("the digest secret's environment variable name is not a valid name")
    value = os.environ.get(env_name)
    if not value:
        raise DigestKeyError(f"environment variable {env_name} (digest secret) is not set or empty: "
                             f"set it to a secret of at least {MIN_SECRET_BYTES} bytes, e.g. "
                             f"{env_name}=$(openssl rand -hex 16), the same on every replica")
    try:
        return DigestKey(value)
    except DigestKeyError as err:
        raise DigestKeyError(f"environment variable {env_name}: {err}") from None
