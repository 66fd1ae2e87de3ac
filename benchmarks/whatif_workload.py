"""A seeded single-worker chat workload for the what-if harness (benchmarks/whatif_vllm_pool.py).

Pure standard library, no vLLM: the stream depends only on the seed and the parameters, never
on the pool, so runs at M, 2M and 4M blocks see the very same requests at the very same times.

What the stream holds (token ids are random ints in [3, 500]):

* a few shared system prompts of 2-6 blocks (plus a ragged tail of 0-15 tokens, as real system
  prompts rarely end on a block boundary), chosen with skewed popularity;
* ``session``: multi-turn chats. Turn 1 = system prompt + user text. Turn k+1 = the previous
  turn's prompt + its output + new user text, so the blocks holding the previous output come
  back as prompt blocks. Turn k+1 arrives ``nominal_service(k) + think_time`` after turn k
  *arrived* (nominal service = (output tokens + 1) engine steps), which keeps arrival times
  independent of the pool; if a crowded pool delayed turn k, turn k+1 can arrive before turn k
  finished (the harness counts those as ``early_turns``);
* ``single``: one question under a shared system prompt;
* ``one_hit``: a prompt of fresh random tokens, never seen again (cache pollution);
* ``repeat``: an exact re-send of an earlier single / one-hit prompt (regenerate), with a new
  output. A repeated prompt that is an exact multiple of the block size exercises vLLM's lookup
  limit (the last block is recomputed and cached a second time).

Every request's output tokens are drawn up front too (the engine runs them with ``ignore_eos``
and ``max_tokens`` = their count), so the next turn's prompt is known without running anything.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

TOKEN_LO, TOKEN_HI = 3, 500


@dataclass(frozen=True)
class WorkloadParams:
    """Defaults tuned (seed 1-3, 8 seqs, 10 ms steps) so that a 64-block pool evicts all the
    time (~11k BlockRemoved per 2000 requests) while admission waits stay at 0-1 requests,
    peak in-use ~57-63 of 63; 32-48 blocks make requests wait; 256 keeps most of the reuse."""

    requests: int = 2000
    block_size: int = 16
    step_s: float = 0.010  # the engine step the nominal service time is counted in
    conversation_rate: float = 2.0  # new conversations per second (Poisson)
    system_prompts: int = 4
    system_blocks: tuple[int, int] = (2, 6)
    # Share of new conversations by kind (normalised).
    mix: tuple[tuple[str, float], ...] = (
        ("session", 0.45), ("single", 0.25), ("one_hit", 0.20), ("repeat", 0.10))
    turns: tuple[int, int] = (2, 5)  # turns of a session, uniform
    first_user_tokens: tuple[int, int] = (16, 64)
    user_tokens: tuple[int, int] = (8, 40)  # later turns' new user text
    one_hit_tokens: tuple[int, int] = (32, 128)
    output_tokens: tuple[int, int] = (4, 32)
    think_time_mean_s: float = 3.0  # exponential, plus think_time_min_s
    think_time_min_s: float = 0.5
    repeat_min_age_s: float = 1.0  # a repeat re-sends a prompt at least this old


@dataclass(frozen=True)
class PlannedRequest:
    request_id: str
    arrival_time: float
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    kind: str
    session_id: str | None = None
    turn: int = 0
    prev_request_id: str | None = None  # the previous turn of the same session


@dataclass
class Workload:
    params: WorkloadParams
    seed: int
    requests: list[PlannedRequest] = field(default_factory=list)
    system_prompts: list[tuple[int, ...]] = field(default_factory=list)

    def max_total_tokens(self) -> int:
        return max((len(r.prompt) + len(r.output) for r in self.requests), default=0)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randint(TOKEN_LO, TOKEN_HI) for _ in range(n))


def generate(seed: int, params: WorkloadParams | None = None) -> Workload:
    """The request stream for ``seed``, sorted by arrival, cut to ``params.requests``."""
    p = params or WorkloadParams()
    rng = random.Random(f"kvmiss-whatif-workload:{seed}")
    B = p.block_size
    systems = []
    for _ in range(p.system_prompts):
        blocks = rng.randint(*p.system_blocks)
        systems.append(_tokens(rng, blocks * B + rng.randint(0, B - 1)))
    sys_weights = [1.0 / (i + 1) for i in range(len(systems))]  # Zipf-like popularity
    kinds = [k for k, _ in p.mix]
    kind_weights = [w for _, w in p.mix]

    def output() -> tuple[int, ...]:
        return _tokens(rng, rng.randint(*p.output_tokens))

    raw: list[dict] = []  # unsorted requests; ids assigned after sorting
    resendable_times: list[float] = []  # arrival times of single/one_hit prompts, sorted
    resendable: list[tuple[int, ...]] = []
    arrivals: list[float] = []  # every generated arrival, sorted
    t = 0.0
    conversation = 0
    # Generate until the first `requests` arrivals are surely complete: conversations start in
    # time order, and a session's later turns land later still, so stop once enough requests
    # have arrived before the newest conversation's start.
    while True:
        t += rng.expovariate(p.conversation_rate)
        if bisect.bisect_right(arrivals, t) >= p.requests:
            break
        conversation += 1
        kind = rng.choices(kinds, kind_weights)[0]
        if kind == "repeat":
            cut = bisect.bisect_right(resendable_times, t - p.repeat_min_age_s)
            if cut == 0:
                kind = "single"
            else:
                prompt = resendable[rng.randrange(cut)]
                raw.append(dict(arrival_time=t, prompt=prompt, output=output(), kind="repeat"))
                bisect.insort(arrivals, t)
                continue
        if kind == "one_hit":
            prompt = _tokens(rng, rng.randint(*p.one_hit_tokens))
        else:
            system = rng.choices(systems, sys_weights)[0]
            prompt = system + _tokens(rng, rng.randint(*p.first_user_tokens))
        if kind in ("single", "one_hit"):
            raw.append(dict(arrival_time=t, prompt=prompt, output=output(), kind=kind))
            bisect.insort(arrivals, t)
            i = bisect.bisect_right(resendable_times, t)
            resendable_times.insert(i, t)
            resendable.insert(i, prompt)
            continue
        session = f"s{conversation}"
        arrival = t
        prev = None
        for turn in range(1, rng.randint(*p.turns) + 1):
            if turn > 1:
                prompt = prev["prompt"] + prev["output"] + _tokens(rng, rng.randint(*p.user_tokens))
                think = p.think_time_min_s + rng.expovariate(1.0 / p.think_time_mean_s)
                arrival = prev["arrival_time"] + (len(prev["output"]) + 1) * p.step_s + think
            cur = dict(arrival_time=arrival, prompt=prompt, output=output(), kind="session",
                       session_id=session, turn=turn, prev=prev)
            raw.append(cur)
            bisect.insort(arrivals, arrival)
            prev = cur
    raw.sort(key=lambda r: r["arrival_time"])
    raw = raw[: p.requests]
    ids = {id(r): f"req-{i:05d}" for i, r in enumerate(raw)}
    out = []
    for r in raw:
        prev = r.get("prev")
        out.append(PlannedRequest(
            request_id=ids[id(r)], arrival_time=round(r["arrival_time"], 6), prompt=r["prompt"],
            output=r["output"], kind=r["kind"], session_id=r.get("session_id"),
            turn=r.get("turn", 0), prev_request_id=ids.get(id(prev)) if prev is not None else None))
    return Workload(params=p, seed=seed, requests=out, system_prompts=systems)


if __name__ == "__main__":  # a quick look at one stream
    import collections
    import sys

    w = generate(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    kinds = collections.Counter(r.kind for r in w.requests)
    span = w.requests[-1].arrival_time - w.requests[0].arrival_time
    print(f"{len(w.requests)} requests over {span:.1f} s ({len(w.requests) / span:.2f}/s): {dict(kinds)}")
    print("system prompts (tokens):", [len(s) for s in w.system_prompts])
    lens = sorted(len(r.prompt) for r in w.requests)
    print("prompt tokens p50/p90/max:", lens[len(lens) // 2], lens[int(len(lens) * 0.9)], lens[-1],
          "max total:", w.max_total_tokens())
