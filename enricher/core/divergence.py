"""Divergence detail for `no_match`: where did the request leave a chain the worker had?

When the request's parent block (h[i-1]) was on the chosen worker and another child of
that parent was too, the request diverged from that sibling inside block i: either in its
tokens (report the first differing token index within the prompt) or, with identical
tokens, only in its extra keys (report which kinds differ). Only indices and kinds leave
this module.

The index feeds `SiblingRegistry.note` with GPU stores when divergence detail is enabled
(it costs a token decode per stored event); the registry is bounded (LRU over parents,
a few children each).
"""

from __future__ import annotations

import collections
from array import array
from typing import Any

from kvmiss.schemas.attribution import Divergence, DivergenceKind
from kvmiss.schemas.events import BlockStored
from kvmiss.schemas.prompt import ExtraKeysSpec

MAX_PARENTS = 100_000
MAX_CHILDREN = 4


class Sibling:
    """One stored child block: its hash, tokens and the event's extra-key facts."""

    __slots__ = ("block_hash", "stored_seq", "tokens", "extra_keys", "lora_name")

    def __init__(self, block_hash: int, stored_seq: int, tokens: array[int], extra_keys: Any,
                 lora_name: str | None):
        self.block_hash = block_hash
        self.stored_seq = stored_seq
        self.tokens = tokens
        self.extra_keys = extra_keys  # the event's (untagged) extra keys of this block, or None
        self.lora_name = lora_name


class SiblingRegistry:
    """Children seen under each parent hash (None: chain roots are not kept). Not thread-safe."""

    def __init__(self, max_parents: int = MAX_PARENTS, max_children: int = MAX_CHILDREN):
        self.max_parents = max_parents
        self.max_children = max_children
        self._children: collections.OrderedDict[int, list[Sibling]] = collections.OrderedDict()

    def note(self, event: BlockStored, seq: int) -> None:
        if not event.block_size:
            return
        tokens = event.tokens()
        parent = event.parent_block_hash
        b = event.block_size
        for k, block_hash in enumerate(event.block_hashes):
            if parent is not None:
                extra = event.extra_keys[k] if event.extra_keys and k < len(event.extra_keys) else None
                self._add(parent, Sibling(block_hash, seq, array("q", tokens[k * b:(k + 1) * b]),
                                          extra, event.lora_name))
            parent = block_hash

    def _add(self, parent: int, sibling: Sibling) -> None:
        children = self._children.get(parent)
        if children is None:
            children = self._children[parent] = []
            if len(self._children) > self.max_parents:
                self._children.popitem(last=False)
        else:
            self._children.move_to_end(parent)
        children[:] = [c for c in children if c.block_hash != sibling.block_hash][-(self.max_children - 1):]
        children.append(sibling)

    def siblings(self, parent: int, before_seq: int) -> list[Sibling]:
        """Children of ``parent`` stored before ``before_seq`` (the lookup step)."""
        return [c for c in self._children.get(parent, ()) if c.stored_seq < before_seq]


def _kinds_of_event_keys(sibling: Sibling) -> set[str]:
    kinds = {"lora"} if sibling.lora_name else set()
    for item in sibling.extra_keys or ():
        if isinstance(item, (list, tuple)):
            kinds.add("mm")
        elif isinstance(item, (bytes, bytearray)):
            kinds.add("prompt_embeds")
    return kinds


def diverge(request_tokens: list[int], request_extras: ExtraKeysSpec | None, block: int,
            block_size: int, siblings: list[Sibling]) -> Divergence:
    """Compare the request's block ``block`` with the siblings its parent had."""
    if not siblings:
        return Divergence(DivergenceKind.UNKNOWN)
    start = block * block_size
    mine = request_tokens[start:start + block_size]
    best: tuple[int, Sibling] | None = None
    for sibling in siblings:
        shared = next((j for j, (x, y) in enumerate(zip(mine, sibling.tokens)) if x != y),
                      min(len(mine), len(sibling.tokens)))
        if best is None or shared > best[0]:
            best = (shared, sibling)
    assert best is not None
    shared, sibling = best
    if shared < len(mine):
        return Divergence(DivergenceKind.TOKENS, first_token_index=start + shared)
    request_kinds = set(request_extras.kinds()) - {"cache_salt"} if request_extras else set()
    differing = request_kinds ^ _kinds_of_event_keys(sibling)
    if not differing and request_extras is not None and request_extras.lora and sibling.lora_name:
        if request_extras.lora.name != sibling.lora_name:
            differing = {"lora"}
    if not differing:  # same kinds: values differ (an mm id, an adapter path) or unknown
        differing = request_kinds or {"unknown"}
    return Divergence(DivergenceKind.EXTRA_KEYS, differing_kinds=tuple(sorted(differing)))
