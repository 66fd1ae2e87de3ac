"""The container image (deploy/container): built with deploy/container/build.sh on the Debian
bases it makes with mmdebstrap, then run for real.

`podman run` cannot create containers on every host (nested VMs without cgroup delegation), so
the image runs through `buildah run --isolation chroot` on a working container made from it:
the image's own filesystem, user, environment and working directory, on the host's network.
Its entrypoint and command come from the image's config, as a runtime would take them.

The build is keyed by the files that go into it (Containerfile, build files, pyproject.toml and
the package folders) and reused while they are unchanged: `localhost/kvmiss-test:<key>`. The
first build on a machine makes the two bases too (about 4-5 minutes), the image about 2.

Without podman, buildah, mmdebstrap or root these tests skip, or fail when
KVMISS_REQUIRE_IMAGE=1 (.ci/run sets it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_sink import OtlpSink, attributes
from zmq_ports import free_tcp, quiet_port

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "container"
CONTAINERFILE = HERE / "Containerfile"
IGNOREFILE = HERE / "Containerfile.dockerignore"
REQUIRED = os.environ.get("KVMISS_REQUIRE_IMAGE") == "1"
UID = 10001
# What decides the image: a change to any of these builds a new one.
KEY_FILES = [CONTAINERFILE, IGNOREFILE, HERE / "kvmiss.toml", HERE / "build.sh",
             HERE / "base-runtime.packages", HERE / "base-build.packages", ROOT / "pyproject.toml"]
COMPILERS = ("gcc", "cc", "c89", "c99", "cpp", "clang", "tcc", "as", "ld", "x86_64-linux-gnu-gcc",
             "x86_64-linux-gnu-gcc-12", "gcc-12")


def package_folders() -> list[str]:
    """The top-level folders pyproject.toml installs packages from."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted({path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()})


def image_key() -> str:
    digest = hashlib.sha256()
    files = list(KEY_FILES)
    for folder in package_folders():
        files += sorted(p for p in (ROOT / folder).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc"))
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def missing_tools() -> list[str]:
    missing = [tool for tool in ("podman", "buildah", "mmdebstrap") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (mmdebstrap's root mode and podman's system store)")
    return missing


def run(args: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


# --- the Containerfile against the project: no tools needed ----------------------------------


def test_the_build_copies_every_package_folder_and_the_ignore_file_lets_them_through():
    """A package folder added to pyproject.toml must reach the build stage, or the wheel lacks it."""
    copied = set(re.findall(r"^COPY (?!--from)(\S+) \1$", CONTAINERFILE.read_text(), re.MULTILINE))
    allowed = {line[1:] for line in IGNOREFILE.read_text().splitlines() if line.startswith("!")}
    for folder in package_folders():
        assert folder in copied, f"Containerfile does not COPY {folder}/"
        assert folder in allowed, f"{IGNOREFILE.name} keeps {folder}/ out of the context"
    assert {"pyproject.toml", "README.md", "deploy/container/kvmiss.toml"} <= allowed


def test_the_images_config_listens_on_all_interfaces_and_takes_the_key_from_the_environment():
    from kvmiss.schemas.config import parse_config

    config = parse_config((HERE / "kvmiss.toml").read_text())
    assert (config.otlp.grpc, config.otlp.http, config.metrics.listen) == ("0.0.0.0:4317", "0.0.0.0:4318", "0.0.0.0:9464")
    assert config.privacy.digest_key_env == "KVMISS_DIGEST_KEY" and config.privacy.digest_key is None
    assert config.fleet.file == "/etc/kvmiss/fleet.toml"
    exposed = re.search(r"^EXPOSE (.+)$", CONTAINERFILE.read_text(), re.MULTILINE).group(1).split()
    assert exposed == ["4317", "4318", "9464"]


# --- the image, built and run ------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    missing = missing_tools()
    if missing:
        message = f"{', '.join(missing)} missing: apt-get install podman buildah mmdebstrap, as root"
        if REQUIRED:
            pytest.fail(f"KVMISS_REQUIRE_IMAGE=1: {message}")
        pytest.skip(message)
    tag = f"localhost/kvmiss-test:{image_key()}"
    if run(["podman", "image", "exists", tag]).returncode != 0:
        started = time.monotonic()
        built = run(["nice", "-n", "10", "bash", str(HERE / "build.sh")], timeout=3600,
                    env={**os.environ, "KVMISS_IMAGE": tag})
        assert built.returncode == 0, f"build.sh failed:\n{built.stderr[-6000:]}"
        print(f"built {tag} in {time.monotonic() - started:.0f} s")
        # One test image at a time: earlier keys' images and the build stages left for the
        # layer cache would otherwise pile up with every source change.
        listed = run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}",
                      "--filter", "reference=localhost/kvmiss-test"]).stdout.split()
        for old in set(listed) - {tag}:
            run(["podman", "image", "rm", old])  # by tag: an image tagged otherwise too keeps that tag
        run(["podman", "image", "prune", "--force", "--filter", "label=io.kvmiss.stage=build"])
    return tag


@pytest.fixture(scope="module")
def inspected(image) -> dict:
    return json.loads(run(["podman", "image", "inspect", image]).stdout)[0]


@pytest.fixture(scope="module")
def container(image):
    name = f"kvmiss-test-{uuid.uuid4().hex[:8]}"
    made = run(["buildah", "from", "--pull-never", "--name", name, image])
    assert made.returncode == 0, made.stderr
    yield name
    run(["buildah", "rm", name])


def in_image(container: str, *command: str, env: dict | None = None, volumes: tuple = (),
             timeout: float = 120) -> subprocess.CompletedProcess:
    return run(buildah_run(container, list(command), env=env, volumes=volumes), timeout=timeout)


def buildah_run(container: str, command: list[str], env: dict | None = None, volumes: tuple = ()) -> list[str]:
    args = ["buildah", "run", "--isolation", "chroot"]
    for name, value in (env or {}).items():
        args += ["--env", f"{name}={value}"]
    for volume in volumes:
        args += ["--volume", volume]
    return args + [container, "--", *command]


def test_the_image_runs_kvmiss_as_uid_10001_with_the_serve_command_and_its_ports(inspected):
    config = inspected["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["kvmiss"]
    assert config["Cmd"] == ["serve", "--config", "/etc/kvmiss/kvmiss.toml"]
    assert set(config["ExposedPorts"]) == {"4317/tcp", "4318/tcp", "9464/tcp"}
    # The build stage with its compiler and headers is ~230 MB over the runtime: a runtime
    # image this large would mean it leaked in.
    assert inspected["Size"] < 450e6, inspected["Size"]


def test_inside_it_runs_as_non_root_with_the_compiled_parts_and_no_compiler(container):
    from kvmiss.enricher import __version__

    identity = in_image(container, "id", "-u")
    assert identity.stdout.strip() == str(UID), identity
    version = in_image(container, "kvmiss", "--version")
    assert version.returncode == 0 and version.stdout.startswith(f"kvmiss {__version__} "), version
    imported = in_image(container, "python", "-c",
                        "import kvmiss.enricher.core._blocktable, kvmiss.enricher.otlp._otlpwire, "
                        "kvmiss.collectors._kvwire, kvmiss.enricher.otlp.spans as s; print(s.WIRE_SCAN)")
    assert imported.returncode == 0 and imported.stdout.strip() == "True", imported
    # Every executable on PATH, and the compiler's own directory, which no PATH names.
    listing = in_image(container, "sh", "-c",
                       'for d in $(echo "$PATH" | tr : " "); do ls -1 "$d" 2>/dev/null; done; ls -d /usr/lib/gcc 2>/dev/null || true')
    assert listing.returncode == 0 and "kvmiss" in listing.stdout.split(), listing
    found = set(listing.stdout.split()) & {*COMPILERS, "/usr/lib/gcc"}
    assert not found, f"compiler parts in the runtime image: {sorted(found)}"
    # The user cannot change the installed program.
    writable = in_image(container, "sh", "-c", "test -w /opt/kvmiss/bin || test -w /etc/kvmiss/kvmiss.toml; echo $?")
    assert writable.stdout.strip() == "1", writable


def test_the_shipped_config_needs_the_key_and_a_destination_and_then_checks_out(container):
    check = ["kvmiss", "serve", "--config", "/etc/kvmiss/kvmiss.toml", "--check"]
    key = {"KVMISS_DIGEST_KEY": "container-test-key-0001"}
    no_key = in_image(container, *check, "--export", "grpc://collector:4317")
    assert no_key.returncode == 2 and "KVMISS_DIGEST_KEY" in no_key.stderr, no_key
    nowhere = in_image(container, *check, env=key)
    assert nowhere.returncode == 2 and "export" in nowhere.stderr, nowhere
    checked = in_image(container, *check, "--export", "grpc://collector:4317", env=key)
    assert checked.returncode == 0, checked
    out = checked.stdout
    assert "otlp: grpc 0.0.0.0:4317, http 0.0.0.0:4318" in out and "metrics: 0.0.0.0:9464" in out, out
    assert "residency table: compiled" in out and "KV-event reader: compiled" in out, out


def test_kvmiss_demo_runs_in_the_image_with_no_wrong_verdict(container):
    demo = in_image(container, "kvmiss", "demo", "--out", "/tmp/kvmiss-demo-out", timeout=300)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "wrong verdicts: 0" in demo.stdout, demo.stdout[-3000:]
    assert "exported spans checked: no raw prompt material" in demo.stdout
    report = in_image(container, "test", "-s", "/tmp/kvmiss-demo-out/report.html")
    assert report.returncode == 0


P, H, Q, R = 1001, 1002, 1003, 1004  # block hashes: parent, evicted, never stored, on w1


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def send(exporter, requests: list[tuple[str, str, int]]) -> None:
    """A router span (kvmiss's inputs) and its child llm_request per (request id, worker,
    cached tokens), through the OTel SDK's own exporter."""
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("container-test")
    for rid, chain, lookup in requests:
        with tracer.start_as_current_span("route", attributes={
                "gen_ai.request.id": rid, "kvmiss.route.worker": "w0", "kvmiss.route.policy": "prefix",
                "gen_ai.usage.cache_read.input_tokens": 16, "kvmiss.block_hashes": chain,
                "kvmiss.lookup_time_unix_nano": int(lookup * 1e9)}):
            with tracer.start_as_current_span("llm_request", kind=trace.SpanKind.SERVER,
                                              attributes={"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": 40}):
                pass
    provider.shutdown()


def test_serve_in_the_image_enriches_real_otlp_into_a_sink_outside_it(container, inspected, tmp_path):
    """The image's own entrypoint, command and config, with the export destination and ports
    given as flags; workers from a mounted [fleet] file; KV events from two real SGLang
    publishers and spans from the OTel SDK's gRPC and HTTP exporters, all outside the image."""
    from sglang_publisher import batch, close, publisher

    sink = OtlpSink()
    eps = {w: (free_tcp(), free_tcp()) for w in ("w0", "w1")}
    pubs = {w: publisher(endpoint=ep, replay_endpoint=rep, topic=f"kv@{w}@m") for w, (ep, rep) in eps.items()}
    fleet = tmp_path / "fleet.toml"
    fleet.write_text("".join(f'[[workers]]\nid = "{w}"\nendpoint = "{ep}"\nreplay_endpoint = "{rep}"\n\n'
                             for w, (ep, rep) in eps.items()))
    fleet.chmod(0o644)
    grpc, http, metrics = quiet_port(), quiet_port(), quiet_port()
    # Loopback addresses: with the host's network there is no container boundary, so the
    # image's 0.0.0.0 would open the host's interfaces (the --check test reads those defaults).
    command = [*inspected["Config"]["Entrypoint"], *inspected["Config"]["Cmd"],
               "--export", sink.endpoint, "--otlp-grpc", f"127.0.0.1:{grpc}",
               "--otlp-http", f"127.0.0.1:{http}", "--metrics", f"127.0.0.1:{metrics}"]
    log = tmp_path / "serve.log"
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(buildah_run(container, command, env={"KVMISS_DIGEST_KEY": "container-test-key-0001"},
                                            volumes=(f"{fleet}:/etc/kvmiss/fleet.toml:ro",)),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{metrics}"
    try:
        deadline = time.monotonic() + 60
        while get(f"{base}/healthz")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        print(f"serve in the image: /healthz after {time.monotonic() - started:.2f} s")
        # buildah's own chroot helper (root) runs kvmiss as its child.
        serve = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "kvmiss"]
        assert len(serve) == 1 and serve[0].uids().real == UID and serve[0].uids().effective == UID

        def ready_with_both() -> bool:
            status, body = get(f"{base}/readyz")
            return status == 200 and {"w0", "w1"} <= set(json.loads(body)["workers"])

        while not ready_with_both():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        # The [fleet] file's workers joined at start-up: lookups within membership_uncertainty_s
        # (the image config's) of a join are unsettled, and an unsettled worker cannot prove routing_miss.
        time.sleep(2.5)
        t0 = time.time()
        pubs["w0"].publish(batch(t0, stored=[([P, H], None)]))
        pubs["w0"].publish(batch(t0 + 0.01, removed=[[H]]))
        pubs["w1"].publish(batch(t0, stored=[([P, R], None)]))
        for k in range(2, 6):
            pubs["w0"].publish(batch(t0 + 0.01 * k))
            pubs["w1"].publish(batch(t0 + 0.01 * k))
        assert ready_with_both()
        lookup = t0 + 0.035
        send(GrpcSpanExporter(endpoint=f"127.0.0.1:{grpc}", insecure=True),
             [("evicted", [P, H, 7], lookup), ("never", [P, Q, 7], lookup)])
        send(HttpSpanExporter(endpoint=f"http://127.0.0.1:{http}/v1/traces"), [("routing", [P, R, 7], lookup)])
        spans = sink.wait_for_spans(6, timeout=30)
        assert len(spans) == 6, (len(spans), log.read_text()[-4000:])
        labels = {attributes(s)["gen_ai.request.id"]: attributes(s).get("kvmiss.label") for s in spans if s.name == "route"}
        assert labels == {"evicted": "evicted", "never": "no_match", "routing": "routing_miss"}, [
            (attributes(s)["gen_ai.request.id"], attributes(s).get("kvmiss.reason")) for s in spans if s.name == "route"]
        for s in spans:
            assert "kvmiss.block_hashes" not in attributes(s)
        status, text = get(f"{base}/metrics")
        assert status == 200
        judged = dict(re.findall(r'^kvmiss_requests_total\{[^}]*label="(\w+)"[^}]*\} ([0-9.]+)$', text, re.MULTILINE))
        assert judged == {"evicted": "1.0", "no_match": "1.0", "routing_miss": "1.0"}, judged
        assert re.search(r'^kvmiss_export_spans_delivered_total\{exporter="http"\} 6\.0$', text, re.MULTILINE), text

        serve[0].send_signal(signal.SIGTERM)  # what a runtime's stop sends (STOPSIGNAL)
        assert proc.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pub in pubs.values():
            close(pub)
        sink.close()
