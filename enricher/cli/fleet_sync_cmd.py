"""`kvmiss fleet-sync --service vllm-engines --output /etc/kvmiss/fleet/fleet.toml`: the sidecar
that keeps a ``[fleet] file`` equal to the ready endpoints of the engines' Service.

In a pod it lists and watches the Service's EndpointSlices through the API server with the
pod's service account (Role: list, watch endpointslices in discovery.k8s.io) and replaces the
file by rename whenever the rendered fleet changes (collectors/endpointslices.py). With
``--from-json FILE`` (``-`` for stdin) it renders ``kubectl get endpointslices -o json`` output
once instead. A failed call or an invalid render leaves the last file in place.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

HELP_INPUT = """\
input:    the EndpointSlices (discovery.k8s.io/v1) of --service, from the API server (in a pod:
          its service account) or --from-json (kubectl get endpointslices -o json); writes
          --output, a [fleet] file of [[workers]] (docs/FLEET.md), by rename
example:  kubectl get endpointslices -l kubernetes.io/service-name=vllm-engines -o json \\
            | kvmiss fleet-sync --service vllm-engines --from-json - --output fleet.toml
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", required=True, help="the engines' Service (label kubernetes.io/service-name)")
    parser.add_argument("--namespace", help="its namespace (default: the pod's own)")
    parser.add_argument("--output", required=True, help="the [fleet] file to keep up to date")
    parser.add_argument("--port", default="kv-events",
                        help="the slices' KV-event port: a port name or number (default kv-events)")
    parser.add_argument("--replay-port", default="kv-replay",
                        help="the replay port's name or number (default kv-replay); '' for no replay endpoint")
    parser.add_argument("--id", default="{pod}",
                        help="worker id template over {pod} {namespace} {ip} {host} {hostname} {node} {zone} "
                             "{dp_rank}: what routers put in kvmiss.route.worker (default {pod})")
    parser.add_argument("--endpoint", default="tcp://{host}:{port}", help="endpoint template (default %(default)s)")
    parser.add_argument("--replay-endpoint", default="tcp://{host}:{replay_port}",
                        help="replay endpoint template (default %(default)s)")
    parser.add_argument("--members", choices=("ready", "serving"), default="ready",
                        help="ready: endpoints the Service routes to (default); serving: also draining ones "
                             "still serving")
    parser.add_argument("--address-type", choices=("IPv4", "IPv6"), default="IPv4",
                        help="the slices' address family (one: a dual-stack pod is one worker)")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per endpoint (default 1)")
    parser.add_argument("--settle-s", type=float, default=0.2,
                        help="write a burst of changes once, this long after its last event (default 0.2)")
    parser.add_argument("--from-json", metavar="FILE", help="render this EndpointSlice JSON once ('-': stdin), no API")
    parser.add_argument("--api-server", help="API server URL (default: in-cluster, from KUBERNETES_SERVICE_HOST)")
    parser.add_argument("--token-file", help="bearer token file (default: the pod's service account token)")
    parser.add_argument("--ca-file", help="CA bundle for the API server (default: the service account's ca.crt)")
    parser.add_argument("--log-level", default="INFO")


def rendering_from(args):
    from kvmiss.collectors.endpointslices import SliceRendering

    return SliceRendering(port=args.port, replay_port=args.replay_port or None, id=args.id,
                          endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, members=args.members,
                          address_type=args.address_type, dp_size=args.dp_size)


def run(args: argparse.Namespace) -> int:
    from kvmiss.collectors.endpointslices import (
        SERVICE_ACCOUNT_DIR,
        KubeApi,
        WatchSettings,
        render_fleet,
        slices_of,
        watch,
        write_fleet,
    )
    from kvmiss.schemas.config import ConfigError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rendering = rendering_from(args)
    try:
        rendering.check()
    except ConfigError as exc:
        print(f"kvmiss fleet-sync: --{exc}", file=sys.stderr)
        return 2
    if args.from_json:
        text = sys.stdin.read() if args.from_json == "-" else Path(args.from_json).read_text()
        try:
            rendered = render_fleet(slices_of(json.loads(text)), rendering, service=args.service)
        except (ValueError, ConfigError) as exc:
            print(f"kvmiss fleet-sync: {exc}", file=sys.stderr)
            return 1
        for reason in rendered.skipped:
            print(f"kvmiss fleet-sync: {reason}", file=sys.stderr)
        changed = write_fleet(args.output, rendered.text)
        print(f"{args.output}: {rendered.workers} workers{'' if changed else ' (unchanged)'}")
        return 0
    try:
        if args.api_server:
            namespace = args.namespace or (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
            api = KubeApi(server=args.api_server, namespace=namespace)
        else:
            api = KubeApi.in_cluster(args.namespace)
    except Exception as exc:
        print(f"kvmiss fleet-sync: {exc}", file=sys.stderr)
        return 2
    # An empty --token-file / --ca-file means none (a plain-HTTP API proxy, the system CAs).
    if args.token_file is not None:
        api = dataclasses.replace(api, token_file=Path(args.token_file) if args.token_file else None)
    if args.ca_file is not None:
        api = dataclasses.replace(api, ca_file=Path(args.ca_file) if args.ca_file else None)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await watch(api, args.service, rendering, args.output, WatchSettings(settle_s=args.settle_s), stop)

    asyncio.run(main())
    return 0
