"""`kvmiss status`: what a running `kvmiss serve` says of itself -- ready or not, and each
worker's event stream: connected or not, since when, and why not.

Reads the service's /readyz (on `[metrics] listen`). Exit status: 0 ready, 1 not ready, 2 when
the service cannot be asked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import urllib.error
import urllib.request

HELP_INPUT = """\
input:    --url of a running kvmiss serve's metrics listener, or --config (its [metrics] listen)
example:  kvmiss status --config kvmiss.toml
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="the metrics listener, e.g. http://127.0.0.1:9464 (default)")
    where.add_argument("--config", metavar="FILE", help="read the address from this config's [metrics] listen")
    parser.add_argument("--json", action="store_true", help="print /readyz's answer as it is")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the answer")


def _base_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    if args.config:
        from kvmiss.schemas.config import load_config, parse_listen_address

        listen = load_config(args.config).metrics.listen
        if not listen:
            raise ValueError(f"{args.config}: metrics.listen is off: serve has no status endpoint")
        host, port = parse_listen_address(listen)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return "http://127.0.0.1:9464"


def run(args: argparse.Namespace) -> int:
    from kvmiss.schemas.config import ConfigError

    try:
        url = _base_url(args) + "/readyz"
    except (ConfigError, ValueError) as exc:
        print(f"kvmiss status: {exc}", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:  # 503: not ready, still an answer
        body = exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"kvmiss status: cannot ask {url}: {reason} (is kvmiss serve running there?)", file=sys.stderr)
        return 2
    try:
        answer = json.loads(body)
    except ValueError:
        print(f"kvmiss status: {url} did not answer with kvmiss's JSON", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(render(answer))
    return 0 if answer.get("ready") else 1


def render(answer: dict) -> str:
    """/readyz's answer as a table a person reads."""
    states = answer.get("workers", {})
    detail = answer.get("detail", {})
    lines = [f"ready: {'yes' if answer.get('ready') else 'NO'}"]
    lines += [f"  {key}: {value}" for key, value in states.items() if key not in detail]
    rows = [("worker", "stream", "cursor", "batches", "since", "endpoint / why not")]
    for worker, entry in detail.items():
        since = entry.get("since")
        when = "" if since is None else datetime.datetime.fromtimestamp(since, datetime.UTC).strftime("%H:%M:%SZ")
        why = entry.get("endpoint", "")
        if entry.get("cause"):
            why += f"  {entry['cause']}: {entry.get('detail') or ''}"
        rows.append((worker, str(entry.get("stream", "?")), str(entry.get("cursor", "?")),
                     str(entry.get("batches_applied", 0)), when, why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows] if len(rows) > 1 else []
    return "\n".join(lines)
