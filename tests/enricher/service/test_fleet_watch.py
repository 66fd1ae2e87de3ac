"""FleetWatch (enricher/service/fleet_watch.py): each source's answer becomes a change, a
refusal is counted and logged once per answer, and a source that fails is logged once and
keeps its last good fleet while the others go on."""

from __future__ import annotations

import asyncio
import logging

from kvmiss.collectors.membership import Desired, FleetMembers, Refusal, RefusalReason
from kvmiss.enricher.service.fleet_watch import FIRST_BATCH_BUCKETS, FirstBatchDelays, FleetWatch
from kvmiss.schemas.config import WorkerSpec


def spec(i: str, port: int) -> WorkerSpec:
    return WorkerSpec(id=i, endpoint=f"tcp://127.0.0.1:{port}")


class Scripted:
    """A source that answers what it is given, in order (an exception is raised)."""

    def __init__(self, name: str, answers: list):
        self.name, self.where, self.answers = name, f"<{name}>", list(answers)

    async def poll(self):
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_changes_refusals_and_a_failing_source(caplog):
    broken = Scripted("dns", [RuntimeError("resolver bug"), RuntimeError("resolver bug"), Desired((spec("d0", 3),))])
    file = Scripted("file", [Desired((spec("f0", 1),)), Refusal(RefusalReason.NOT_TOML, "f: not valid TOML"),
                             Desired((spec("f0", 1), spec("f1", 2)))])
    applied = []
    watch = FleetWatch([broken, file], FleetMembers([spec("s0", 9)]), applied.append, interval_s=0.1,
                       clock=iter(range(100)).__next__)
    caplog.set_level(logging.INFO, logger="kvmiss.fleet")

    first = asyncio.run(watch.poll_once())
    assert [c.source for c in first] == ["file"] and [s.id for s in first[0].joined] == ["f0"]
    assert asyncio.run(watch.poll_once()) == []  # the refusal changes nothing
    assert dict(watch.stats.refused) == {("file", "not_toml"): 1}
    third = asyncio.run(watch.poll_once())
    assert [(c.source, [s.id for s in c.joined]) for c in third] == [("dns", ["d0"]), ("file", ["f1"])]
    assert applied == first + third
    failures = [r for r in caplog.records if "polling <dns> failed" in r.getMessage()]
    assert len(failures) == 1  # twice failed, logged once
    assert any("polling <dns> works again" in r.getMessage() for r in caplog.records)
    refused = [r for r in caplog.records if "update refused" in r.getMessage()]
    assert len(refused) == 1 and "not_toml" in refused[0].getMessage() and "1 workers from file" in refused[0].getMessage()


def test_first_batch_delays_are_a_cumulative_histogram():
    h = FirstBatchDelays()
    for seconds in (0.004, 0.3, 0.3, 120.0):
        h.observe(seconds)
    buckets = dict(h.cumulative())
    assert buckets[str(FIRST_BATCH_BUCKETS[0])] == 1 and buckets["0.5"] == 3 and buckets["60.0"] == 3
    assert buckets["+Inf"] == h.total == 4 and abs(h.sum - 120.604) < 1e-9
