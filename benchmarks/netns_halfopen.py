"""How long kvmiss takes to notice a half-open KV-event connection, with and without ZMTP
heartbeats, side by side in one run.

An engine host (a network namespace) runs one KV-event publisher (vLLM 0.33's wire protocol,
tests/reliability/publisher_proc.py) streaming ~200 batches/s; the kvmiss host (another
namespace, joined by veth) runs two `kvmiss serve` processes subscribed to it, one with
`[collector] heartbeat_interval_s = 0` (off: before) and one with the defaults (after). Then
every packet on the engine's end of the link is dropped for ``--hold`` seconds (nftables: no
RST either way, both ends keep the connection open), and the link is restored.

Scenarios:
* ``drop``: as above, the engine host's TCP at its defaults (tcp_retries2 = 15: it keeps
  retransmitting for ~15 minutes);
* ``drop-engine-gives-up``: the engine host's ``net.ipv4.tcp_retries2 = 5`` (its end of the
  connection is dropped after ~13 s of unacknowledged data, as it would be after ~15 minutes
  at the default): the partition outlasts the publisher's patience.

Per kvmiss: ``noticed_s`` (drop -> "publisher disconnected" in its log; none = never, within
the hold and ``--observe`` seconds after the restore), ``reconnected_s`` and ``caught_up_s`` (restore ->
reconnect; restore -> every batch published by the restore applied with continuity) and
``probes_after`` (tail probes in the 10 s after catching up: ~0 while the live stream flows, a
few per second while the stream is carried by tail probes alone).

Needs root, iproute2, nftables. Run: ``.venv/bin/python benchmarks/netns_halfopen.py --hold 30 --observe 90``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests" / "peers")]

from netns import ENGINE_ADDR, Link, NetnsKvmiss, unavailable  # noqa: E402
from reliability_rig import Kvmiss, PublisherProcess, Truth, kvmiss_config, wait_until  # noqa: E402

NOTICED, RECONNECTED = "worker w0: publisher disconnected", "worker w0: publisher reconnected"


def count(kvmiss: Kvmiss, text: str) -> int:
    return sum(text in line for line in list(kvmiss.log))


def run(scenario: str, hold_s: float, observe_s: float, workdir: Path) -> dict:
    link = Link()
    pub, processes = None, []
    try:
        if scenario == "drop-engine-gives-up":
            subprocess.run([*Link.prefix(link.engine_ns), "sysctl", "-q", "-w", "net.ipv4.tcp_retries2=5"], check=True)
        k = link.thread(link.kvmiss_ns)
        pub = PublisherProcess(5557, 5558, Truth(), host=ENGINE_ADDR, prefix=Link.prefix(link.engine_ns))
        workers = {"w0": (f"tcp://{ENGINE_ADDR}:5557", f"tcp://{ENGINE_ADDR}:5558")}
        kvmisses = {}
        for name, ports, collector in (("heartbeats off", (4318, 4317, 9464), {"heartbeat_interval_s": 0}),
                                       ("heartbeats 1 s / 4 s (default)", (4328, 4327, 9474), None)):
            http, grpc, metrics = ports
            config = kvmiss_config(http_port=http, grpc_port=grpc, metrics_port=metrics, sink_port=4319,
                                   workers=workers, collector=collector)
            kvmisses[name] = NetnsKvmiss(config, workdir, http_port=http, metrics_port=metrics, grpc_port=grpc,
                                      prefix=Link.prefix(link.kvmiss_ns), thread=k)
            processes.append(kvmisses[name])
        pub.stream(count=10**6, interval_s=0.005, first_block=1_000_000, window=3000)

        def applied(kvmiss: Kvmiss) -> float:
            return kvmiss.scrape().get("kvmiss_stream_last_contiguous_seq", worker="w0")

        pub.wait_reports(200)
        for kvmiss in kvmisses.values():
            wait_until(kvmiss.ready, "kvmiss ready", timeout=30)
            target = pub.last()["seq"]
            wait_until(lambda: applied(kvmiss) >= target, "kvmiss caught up", timeout=30)
        noticed0 = {n: count(kv, NOTICED) for n, kv in kvmisses.items()}
        reconnected0 = {n: count(kv, RECONNECTED) for n, kv in kvmisses.items()}
        link.drop_all()
        dropped = time.monotonic()
        noticed: dict[str, float | None] = {n: None for n in kvmisses}
        while time.monotonic() - dropped < hold_s:
            for n, kv in kvmisses.items():
                if noticed[n] is None and count(kv, NOTICED) > noticed0[n]:
                    noticed[n] = round(time.monotonic() - dropped, 2)
            time.sleep(0.1)
        link.clear()
        restored = time.monotonic()
        target = pub.last()["seq"]
        out = {}
        caught_up: dict[str, float | None] = {n: None for n in kvmisses}
        reconnected: dict[str, float | None] = {n: None for n in kvmisses}
        while time.monotonic() - restored < observe_s:
            now = time.monotonic()
            for n, kv in kvmisses.items():
                if noticed[n] is None and count(kv, NOTICED) > noticed0[n]:
                    noticed[n] = round(now - dropped, 2)
                if reconnected[n] is None and count(kv, RECONNECTED) > reconnected0[n]:
                    reconnected[n] = round(now - restored, 2)
                if caught_up[n] is None and applied(kv) >= target:
                    caught_up[n] = round(now - restored, 2)
            if all(v is not None for v in caught_up.values()) and all(
                    v is not None for n, v in reconnected.items() if noticed[n] is not None):
                break
            time.sleep(0.1)
        probes0 = {n: kv.scrape().get("kvmiss_stream_tail_probes", worker="w0") for n, kv in kvmisses.items()}
        time.sleep(10)
        for n, kv in kvmisses.items():
            m = kv.scrape()
            out[n] = {"noticed_s": noticed[n], "reconnected_s": reconnected[n], "caught_up_s": caught_up[n],
                      "probes_after": int(m.get("kvmiss_stream_tail_probes", worker="w0") - probes0[n]),
                      "gaps": int(m.get("kvmiss_stream_gaps", worker="w0")),
                      "unrecoverable_gaps": int(m.get("kvmiss_stream_unrecoverable_gaps", worker="w0"))}
        return out
    finally:
        for process in processes:
            process.kill()
        if pub is not None:
            pub.kill()
        link.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=float, default=30.0, help="seconds every packet is dropped")
    parser.add_argument("--observe", type=float, default=90.0,
                        help="seconds after the restore to wait for each kvmiss to reconnect and catch up")
    parser.add_argument("--scenario", action="append", choices=["drop", "drop-engine-gives-up"])
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"netns_halfopen: {reason}", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in args.scenario or ["drop", "drop-engine-gives-up"]:
            results[scenario] = run(scenario, args.hold, args.observe, Path(tmp))
            print(f"\n{scenario} (every packet dropped for {args.hold:g} s, then restored; "
                  f"'never': not within {args.observe:g} s of the restore)")
            print(f"  {'kvmiss':32} {'noticed':>9} {'reconnect':>10} {'caught up':>10} {'probes/10s':>11} {'gaps':>5}")
            for name, r in results[scenario].items():
                def fmt(v):
                    return "never" if v is None else f"{v:.1f} s"
                print(f"  {name:32} {fmt(r['noticed_s']):>9} {fmt(r['reconnected_s']):>10} "
                      f"{fmt(r['caught_up_s']):>10} {r['probes_after']:>11} {r['gaps']:>5}")
    print("\n" + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
