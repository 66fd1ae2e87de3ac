"""The demo's request mix: chosen so that every attribution label has a real cause behind it.

  shared     a popular system prompt + a short question: hits, and evicted / routing_miss /
             no_match (the first time a worker sees the prompt) when reuse fails
  exact      a system prompt whose length is an exact block multiple: lookup_limit
  volatile   a timestamp injected after the first blocks of a system prompt: no_match
  tenant     a per-tenant cache salt: no_match with extra-key kind cache_salt (by design)
  lora       a LoRA adapter: no_match with extra-key kind lora on a worker new to it
  unique     a long one-off document: no_match, and the cache pressure behind evictions
  logprobs   prompt logprobs requested, so the engine does not read the cache: resident_miss
  disagg     prefill elsewhere, KV transfer to the chosen worker fails: transfer_failure

Prompts are token ids drawn from a seeded RNG; block hashes are vLLM's (sha256 of pickle,
tagged extra keys with the LoRA path, as vLLM 0.31+ computes them), and the extra keys
published in events are vLLM's untagged form without the path. Same seed, same requests.
"""

from __future__ import annotations

import random

import msgspec

from kvmiss.enricher.core.hashing import BlockHasher, LoraRef, RequestExtras, external_hash
from kvmiss.enricher.demo.engine import SimRequest
from kvmiss.schemas.prompt import ExtraKeysSpec, LoraSpec

VOCAB = 32_000
KIND_WEIGHTS = {
    "shared": 0.42, "exact": 0.09, "volatile": 0.09, "tenant": 0.09, "lora": 0.08,
    "unique": 0.13, "logprobs": 0.04, "disagg": 0.06,
}
TENANTS = ("acme", "globex", "initech")
ADAPTERS = (("sql-lora", "/adapters/sql-lora", 1), ("chat-lora", "/adapters/chat-lora", 2))


class Workload:
    """Generates requests and their arrival ticks, deterministically from ``seed``."""

    def __init__(self, seed: int, *, block_size: int = 16, system_prompts: int = 6):
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.hasher = BlockHasher("sha256", seed=None, block_size=block_size)
        self.event_keys = BlockHasher("sha256", seed=None, block_size=block_size,
                                      extra_keys_format="untagged")
        self.prompts = [self._tokens(self.rng.randint(3, 9) * block_size)
                        for _ in range(system_prompts)]
        # Zipf-like popularity: a few prompts carry most of the traffic.
        self.popularity = [1.0 / (rank + 1) for rank in range(system_prompts)]

    def generate(self, count: int, *, mean_per_tick: float = 1.0) -> list[SimRequest]:
        """``count`` requests with non-decreasing arrival ticks (bursty Poisson-like)."""
        rng, out, tick = self.rng, [], 0
        kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
        for i in range(count):
            if i % 40 == 0:  # load phases: quiet, normal, busy
                rate = mean_per_tick * rng.choice((0.6, 1.0, 1.6))
            tick += int(rng.expovariate(rate) + 0.5)
            request = self._make(f"req-{i:04d}", rng.choices(kinds, weights)[0])
            request.arrival_tick = tick
            out.append(request)
        return out

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def _system_prompt(self) -> list[int]:
        return self.rng.choices(self.prompts, self.popularity)[0]

    def _question(self) -> list[int]:
        """A short user turn: never completes a block, so it is never a reuse candidate."""
        return self._tokens(self.rng.randint(1, self.block_size - 1))

    def _make(self, request_id: str, kind: str) -> SimRequest:
        rng, size = self.rng, self.block_size
        extras, kinds, lora, spec = None, (), None, None
        system = self._system_prompt()
        if kind == "exact":
            tokens = list(system)
        elif kind == "volatile":
            at = rng.randrange(size, min(3 * size, len(system)))
            tokens = system[:at] + self._tokens(6) + system[at:] + self._question()
        elif kind == "unique":
            tokens = self._tokens(rng.randint(6, 16) * size) + self._question()
        else:
            tokens = system + self._question()
        if kind == "tenant":
            salt = f"salt-{rng.choice(TENANTS)}"
            extras, kinds = RequestExtras(cache_salt=salt), ("cache_salt",)
            spec = ExtraKeysSpec(cache_salt=salt)
        elif kind == "lora":
            lora = rng.choice(ADAPTERS)
            extras, kinds = RequestExtras(lora=LoraRef(lora[0], lora[1])), ("lora",)
            spec = ExtraKeysSpec(lora=LoraSpec(name=lora[0], path=lora[1]))
        decode_steps = rng.randint(0, 6)
        output = self._tokens(decode_steps * size)
        everything = tokens + output
        chain = [external_hash(d) for d in self.hasher.hash_request(everything, extras)]
        return SimRequest(
            id=request_id, kind=kind, token_ids=tokens, output_ids=output, chain=chain,
            event_extra_keys=self.event_keys.block_extra_keys(everything, extras),
            extra_key_kinds=kinds,
            extra_keys_json=msgspec.json.encode(spec).decode() if spec is not None else None,
            lora_id=lora[2] if lora else None, lora_name=lora[0] if lora else None,
            decode_steps=decode_steps, skip_cache_read=kind == "logprobs",
        )
