"""The Helm chart (deploy/helm/kvmiss) and the Collector's values (deploy/helm/collector-values.yaml).

Helm v4 itself, built from its pinned module (tests/peers/helm, tests/peers/build_stack.sh),
runs `helm lint --strict` and `helm template` over every values set in the chart's ci/ folder;
the rendered kvmiss.toml of each must be a config kvmiss accepts (parse_config), and no digest
key may reach a ConfigMap. Without helm these tests skip, or fail with KVMISS_REQUIRE_HELM=1.

Opt-in (KVMISS_K8S_APISERVER=1, and `bash tests/peers/build_stack.sh kube-apiserver etcd`):
a real kube-apiserver of Kubernetes v1.36.3 on a real etcd takes every rendered manifest in a
server-side dry-run (its own schema and validation), then fleet-sync's watch runs against it
with the chart's ServiceAccount, Role and RoleBinding applied for real.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvmiss.schemas.config import parse_config, parse_fleet_file

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvmiss"
COLLECTOR_VALUES = ROOT / "deploy" / "helm" / "collector-values.yaml"
EXAMPLES = ROOT / "examples" / "collector"
PEERS = ROOT / "tests" / "peers"
CACHE = Path(os.environ.get("KVMISS_PEERS_CACHE") or Path.home() / ".cache" / "kvmiss-peers")
VALUES_SETS = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.36.3"  # the release tests/peers/kube-apiserver pins
NAMESPACE = "observability"


def peer_binary(name: str, module: str | None = None) -> Path | None:
    """tests/peers/build_stack.sh's cache path: go.mod, go.sum and *.go of the module, hashed."""
    directory = PEERS / (module or name)
    files = [directory / "go.mod", directory / "go.sum", *sorted(directory.glob("*.go"), key=lambda p: p.name)]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]
    path = CACHE / f"{name}-{key}" / name
    return path if os.access(path, os.X_OK) else None


def helm_binary() -> Path:
    found = peer_binary("helm") or (Path(os.environ["KVMISS_HELM"]) if os.environ.get("KVMISS_HELM") else None)
    if found is None:
        message = "helm is not built: bash tests/peers/build_stack.sh helm"
        if os.environ.get("KVMISS_REQUIRE_HELM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/kvmiss-helm/cache", "HELM_CONFIG_HOME": "/tmp/kvmiss-helm/config",
           "HELM_DATA_HOME": "/tmp/kvmiss-helm/data"}
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def values_args(name: str | None, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["-f", str(CHART / "ci" / f"{name}-values.yaml")] if name else []
    for item in sets:
        args += ["--set", item]
    return args


def template(helm: Path, name: str | None, *sets: str) -> list[dict]:
    out = run_helm(helm, "template", "kvmiss", str(CHART), "--namespace", NAMESPACE,
                   "--kube-version", KUBE_VERSION, *values_args(name, sets)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    return found[0]


def pod_spec(docs):
    return one(docs, "StatefulSet")["spec"]["template"]["spec"]


def container(docs, name="kvmiss"):
    return next(c for c in pod_spec(docs)["containers"] if c["name"] == name)


def rendered_config(docs):
    return parse_config(one(docs, "ConfigMap")["data"]["kvmiss.toml"], source="rendered kvmiss.toml")


# --- lint and template over every values set -------------------------------------------------


def test_the_values_sets_cover_every_fleet_mode_and_option():
    assert set(VALUES_SETS) >= {"static", "dns", "topics", "endpointslices", "servicemonitor", "existing-secret"}


@pytest.mark.parametrize("name", VALUES_SETS)
def test_lint_strict(helm, name):
    result = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                      "--kube-version", KUBE_VERSION, *values_args(name))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("name", VALUES_SETS)
def test_every_values_set_renders_a_config_kvmiss_accepts(helm, name):
    docs = template(helm, name)
    config = rendered_config(docs)
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert config.otlp.grpc.endswith(f":{ports['otlp']}") and config.otlp.http.endswith(f":{ports['otlp-http']}")
    assert config.metrics.listen.endswith(f":{ports['metrics']}")
    assert config.privacy.digest_key is None and config.privacy.digest_key_env == "KVMISS_DIGEST_KEY"
    assert config.export.journal == "/var/lib/kvmiss/journal"
    values = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    mode = values["fleet"]["mode"]
    assert (config.fleet.dns is not None) == (mode == "dns")
    assert (config.fleet.topics is not None) == (mode == "topics")
    assert (config.fleet.file is not None) == (mode == "endpointslices")
    # The pod's checksum follows the config, so a changed config rolls the replicas.
    annotation = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert len(annotation) == 64


def test_numbers_strings_and_lists_survive_yaml_and_set(helm):
    """Helm reads every YAML number as a float: whole ones must still reach kvmiss as integers
    (msgspec refuses 200000.0 for an int key), fractions as floats, --set ints as ints."""
    out = run_helm(helm, "template", "k", str(CHART), *values_args("static", (
        "config.otlp.max_pending_spans=300000", "config.otlp.max_body_bytes=20971520", "ports.otlp.containerPort=5317",
        "config.attributes.worker={kvmiss.route.worker,x.worker}", "config.export.keep_block_hashes=true")),
        "--set-json", "config.history.wait_s=7.5").stdout
    config = rendered_config([d for d in yaml.safe_load_all(out) if d])
    assert (config.otlp.max_pending_spans, config.history.wait_s, config.otlp.max_body_bytes) == (300000, 7.5, 20971520)
    assert config.otlp.grpc == "0.0.0.0:5317" and config.export.keep_block_hashes is True
    assert list(config.attributes.worker) == ["kvmiss.route.worker", "x.worker"]
    assert config.workers[3].pool_blocks == 16384  # a YAML int inside an array of tables


def test_static_fleet_is_the_listed_workers(helm):
    config = rendered_config(template(helm, "static"))
    assert [(w.id, w.endpoint, w.pool_blocks) for w in config.workers][::3] == [
        ("w0", "tcp://vllm-0.vllm-engines.serving.svc:5557", 0), ("w3", "tcp://vllm-3.vllm-engines.serving.svc:5557", 16384)]
    assert [w.id for w in config.workers] == re.search(r"fleet: (.*)", (EXAMPLES / "replicas.yaml").read_text())[1].split()


def test_dns_fleet_is_the_headless_engine_service(helm):
    config = rendered_config(template(helm, "dns"))
    dns = config.fleet.dns
    assert (dns.name, dns.id, dns.dp_size, dns.empty_grace_s) == ("vllm-engines.serving.svc.cluster.local", "{ip}-dp{dp_rank}", 2, 30.0)
    assert config.workers == []


def test_topics_fleet_binds_the_port_the_services_expose(helm):
    docs = template(helm, "topics")
    config = rendered_config(docs)
    assert config.fleet.topics.bind == "tcp://*:5557" and config.fleet.topics.max_workers == 256
    for service in (d for d in docs if d["kind"] == "Service"):
        assert {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"} in service["spec"]["ports"]
    assert one(docs, "StatefulSet")["spec"]["replicas"] == 1
    failed = run_helm(helm, "template", "k", str(CHART), *values_args("topics", ("replicaCount=2",)), check=False)
    assert failed.returncode != 0 and "replicaCount must be 1" in failed.stderr


def test_endpointslices_fleet_has_the_sidecar_its_rbac_and_a_shared_file(helm):
    docs = template(helm, "endpointslices")
    config = rendered_config(docs)
    sidecar = container(docs, "fleet-sync")
    args = dict(a.removeprefix("--").split("=", 1) for a in sidecar["args"][1:])
    assert sidecar["args"][0] == "fleet-sync" and args["output"] == config.fleet.file
    assert (args["service"], args["namespace"], args["address-type"], args["members"]) == (
        "vllm-engines", "serving", "IPv6", "ready")
    assert config.otlp.grpc == "[::]:4317"
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in pod_spec(docs)["containers"]}
    assert mounts["kvmiss"]["fleet"]["mountPath"] == mounts["fleet-sync"]["fleet"]["mountPath"] == str(Path(config.fleet.file).parent)
    assert mounts["kvmiss"]["fleet"]["readOnly"] is True and "readOnly" not in mounts["fleet-sync"]["fleet"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert "emptyDir" in volumes["fleet"]
    # The API token reaches the sidecar only: kvmiss itself holds no credentials.
    assert pod_spec(docs)["automountServiceAccountToken"] is False
    assert "kube-api-access" in mounts["fleet-sync"] and "kube-api-access" not in mounts["kvmiss"]
    role = one(docs, "Role")
    assert role["metadata"]["namespace"] == "serving"
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec(docs)["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    # What the sidecar would write with these arguments, kvmiss reads.
    from kvmiss.collectors.endpointslices import SliceRendering, render_fleet
    rendering = SliceRendering(port=args["port"], replay_port=args["replay-port"], id=args["id"],
                               members=args["members"], address_type=args["address-type"], dp_size=int(args["dp-size"]))
    slice_ = {"addressType": "IPv6", "metadata": {"name": "s"}, "ports": [{"name": "kv-events", "port": 5557},
              {"name": "kv-replay", "port": 5558}], "endpoints": [{"addresses": ["fd00::1"], "targetRef": {"name": "vllm-0"}}]}
    assert [w.endpoint for w in parse_fleet_file(render_fleet([slice_], rendering).text)] == ["tcp://[fd00::1]:5557"]


def test_no_other_mode_gets_api_access(helm):
    for name in ("static", "dns", "topics"):
        docs = template(helm, name)
        assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
        assert [c["name"] for c in pod_spec(docs)["containers"]] == ["kvmiss"]
        assert pod_spec(docs)["automountServiceAccountToken"] is False


def test_a_chart_without_a_fleet_or_with_an_unknown_mode_is_refused(helm):
    result = run_helm(helm, "template", "k", str(CHART), check=False)
    assert result.returncode != 0 and "fleet.mode static: list the engines" in result.stderr
    result = run_helm(helm, "template", "k", str(CHART), "--set", "fleet.mode=consul", check=False)
    assert result.returncode != 0 and '"consul" is not one of' in result.stderr


# --- the digest key -------------------------------------------------------------------------


def configmap_text(docs) -> str:
    return "\n".join(json.dumps(d) for d in docs if d["kind"] == "ConfigMap")


def test_the_digest_key_is_in_the_secret_and_never_in_a_configmap(helm):
    key = "a-digest-key-nobody-else-has-0123"
    docs = template(helm, "dns", f"digestKey.value={key}")
    secret = one(docs, "Secret")
    assert base64.b64decode(secret["data"]["digest-key"]).decode() == key
    assert key not in configmap_text(docs) and base64.b64encode(key.encode()).decode() not in configmap_text(docs)
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["KVMISS_DIGEST_KEY"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "digest-key"}
    # Without a value the chart makes a random one: also only in the Secret.
    docs = template(helm, "dns")
    generated = base64.b64decode(one(docs, "Secret")["data"]["digest-key"]).decode()
    assert len(generated) == 32 and generated not in configmap_text(docs)
    for name in VALUES_SETS:
        docs = template(helm, name)
        assert "digest_key =" not in one(docs, "ConfigMap")["data"]["kvmiss.toml"]


def test_an_existing_secret_is_used_and_none_is_made(helm):
    docs = template(helm, "existing-secret")
    assert not [d for d in docs if d["kind"] == "Secret"]
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["KVMISS_DIGEST_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kvmiss-digest", "key": "key"}
    assert container(docs)["image"] == "registry.example.com/kvmiss@sha256:" + "0" * 64


def test_a_digest_key_in_the_config_is_refused(helm):
    result = run_helm(helm, "template", "k", str(CHART), *values_args("dns", ("config.privacy.digest_key=0123456789abcdef0",)),
                      check=False)
    assert result.returncode != 0 and "never in the ConfigMap" in result.stderr
    result = run_helm(helm, "template", "k", str(CHART), *values_args("dns", ("digestKey.value=short",)), check=False)
    assert result.returncode != 0 and "at least 16 characters" in result.stderr


# --- the pod, the Services, the PDB, the ServiceMonitor ---------------------------------------


@pytest.mark.parametrize("name", ["dns", "endpointslices"])
def test_non_root_read_only_with_probes_on_healthz_and_readyz(helm, name):
    docs = template(helm, name)
    pod = pod_spec(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    for c in pod["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["limits"]["memory"]
    kvmiss = container(docs)
    assert (kvmiss["livenessProbe"]["httpGet"], kvmiss["readinessProbe"]["httpGet"]) == (
        {"path": "/healthz", "port": "metrics"}, {"path": "/readyz", "port": "metrics"})
    assert kvmiss["args"][:3] == ["serve", "--config", "/etc/kvmiss/kvmiss.toml"]
    assert {m["mountPath"] for m in kvmiss["volumeMounts"]} >= {"/etc/kvmiss", "/var/lib/kvmiss", "/tmp"}


def test_the_headless_service_is_what_the_collector_resolves(helm):
    docs = template(helm, "dns")
    headless = one(docs, "Service", "kvmiss-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"otlp": 4317, "otlp-http": 4318}
    assert one(docs, "StatefulSet")["spec"]["serviceName"] == "kvmiss-headless"
    cluster = one(docs, "Service", "kvmiss")
    assert {p["name"]: p["port"] for p in cluster["spec"]["ports"]} == {"otlp": 4317, "otlp-http": 4318, "metrics": 9464}
    assert cluster["spec"]["selector"] == headless["spec"]["selector"] == one(docs, "StatefulSet")["spec"]["selector"]["matchLabels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": cluster["spec"]["selector"]}}


def test_service_monitor_scrapes_the_cluster_service_once(helm):
    docs = template(helm, "servicemonitor")
    monitor = one(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"]
    selected = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["kvmiss"]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics" and monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    statefulset = one(docs, "StatefulSet")
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert "data" not in {v["name"] for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert not [d for d in template(helm, "dns") if d["kind"] == "ServiceMonitor"]


# --- the Collector's values ----------------------------------------------------------------


def collector_values() -> dict:
    return yaml.safe_load(COLLECTOR_VALUES.read_text())


def test_collector_values_agree_with_examples_collector_and_the_kvmiss_chart():
    values = collector_values()
    example = yaml.safe_load((EXAMPLES / "replicas.yaml").read_text())
    config = values["config"]
    # The same pipelines, receivers and exporters by name as replicas.yaml (the chart's
    # default pipelines set to null).
    pipelines = {k: v for k, v in config["service"]["pipelines"].items() if v is not None}
    assert pipelines == example["service"]["pipelines"]
    assert config["processors"]["tail_sampling"]["policies"] == example["processors"]["tail_sampling"]["policies"]
    assert config["connectors"] == example["connectors"]
    port_of = lambda endpoint: int(str(endpoint).rsplit(":", 1)[1].rstrip("}").split("-")[-1])  # noqa: E731
    for receiver in ("otlp", "otlp/enriched", "otlp/sampler"):
        for protocol, settings in config["receivers"][receiver]["protocols"].items():
            assert port_of(settings["endpoint"]) == port_of(example["receivers"][receiver]["protocols"][protocol]["endpoint"])
    # Each receiver's port is exposed under a port the chart's Service carries.
    ports = {name: p["containerPort"] for name, p in values["ports"].items() if p.get("enabled")}
    assert ports["otlp"] == 4317 and ports["otlp-http"] == 4318  # the chart's default names and ports
    assert {ports["otlp-enriched"], ports["otlp-sampler"], ports["spanmetrics"]} == {4417, 4517, 8889}
    # Tier 1 reaches the kvmiss chart's headless Service on its OTLP port, by trace id.
    kvmiss_values = yaml.safe_load((CHART / "values.yaml").read_text())
    lb = config["exporters"]["loadbalancing/kvmiss"]
    assert lb["routing_key"] == example["exporters"]["loadbalancing/kvmiss"]["routing_key"] == "traceID"
    assert lb["resolver"]["dns"] == {"hostname": f"kvmiss-headless.{NAMESPACE}.svc.cluster.local",
                                     "port": kvmiss_values["ports"]["otlp"]["containerPort"]}
    assert lb["protocol"]["otlp"]["retry_on_failure"] == example["exporters"]["loadbalancing/kvmiss"]["protocol"]["otlp"]["retry_on_failure"]
    # kvmiss exports to this Collector's Service on its tier-2a port.
    export = kvmiss_values["config"]["export"]["endpoint"]
    assert export == f"grpc://{values['fullnameOverride']}:{ports['otlp-enriched']}"
    tier2 = config["exporters"]["loadbalancing/traceid"]["resolver"]["k8s"]
    assert tier2 == {"service": f"{values['fullnameOverride']}.{NAMESPACE}", "ports": [ports["otlp-sampler"]]}
    # Tail sampling waits longer than a kvmiss replica may hold a span.
    wait = float(config["processors"]["tail_sampling"]["decision_wait"].removesuffix("s"))
    history = kvmiss_values["config"]["history"]
    assert wait > history["wait_s"] + history["assemble_wait_s"]


def test_collector_values_render_with_the_upstream_chart_when_given(helm):
    """KVMISS_OTEL_CHART=<a checkout of open-telemetry/opentelemetry-collector>: render it with
    these values; the Collector config in its ConfigMap must be ours, minus the nulls."""
    chart = os.environ.get("KVMISS_OTEL_CHART")
    if not chart:
        pytest.skip("KVMISS_OTEL_CHART (the upstream opentelemetry-collector chart directory) is not set")
    out = run_helm(helm, "template", "otelcol-gateway", chart, "--namespace", NAMESPACE,
                   "--kube-version", KUBE_VERSION, "-f", str(COLLECTOR_VALUES)).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    relay = yaml.safe_load(one(docs, "ConfigMap")["data"]["relay"])
    assert set(relay["service"]["pipelines"]) == {"traces/ingest", "traces/enriched", "traces/sample", "metrics/spanmetrics"}
    assert "jaeger" not in relay["receivers"] and relay["exporters"]["loadbalancing/kvmiss"]["resolver"]["dns"]["port"] == 4317
    service = one(docs, "Service", "otelcol-gateway")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}.items() >= {
        "otlp": 4317, "otlp-http": 4318, "otlp-enriched": 4417, "otlp-sampler": 4517, "spanmetrics": 8889}.items()


# --- opt-in: a real kube-apiserver ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory):
    if os.environ.get("KVMISS_K8S_APISERVER") != "1":
        pytest.skip("opt-in: KVMISS_K8S_APISERVER=1 (bash tests/peers/build_stack.sh kube-apiserver etcd)")
    etcd, kube = peer_binary("etcd", "kube-apiserver"), peer_binary("kube-apiserver")
    kubectl = shutil.which("kubectl")
    if etcd is None or kube is None or kubectl is None:
        pytest.fail("KVMISS_K8S_APISERVER=1 needs etcd and kube-apiserver (tests/peers/build_stack.sh) and kubectl")
    d = tmp_path_factory.mktemp("k8s")
    subprocess.run(["openssl", "genrsa", "-out", d / "sa.key", "2048"], check=True, capture_output=True)
    subprocess.run(["openssl", "rsa", "-in", d / "sa.key", "-pubout", "-out", d / "sa.pub"], check=True, capture_output=True)
    (d / "tokens.csv").write_text("admin-token,admin,admin,system:masters\n")
    client, peer, secure = free_port(), free_port(), free_port()
    logs = [open(d / "etcd.log", "w"), open(d / "apiserver.log", "w")]
    procs = [subprocess.Popen([str(etcd), "--data-dir", str(d / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{client}",
                               "--advertise-client-urls", f"http://127.0.0.1:{client}",
                               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                               "--initial-cluster", f"default=http://127.0.0.1:{peer}"], stdout=logs[0], stderr=logs[0])]
    procs.append(subprocess.Popen([
        str(kube), f"--etcd-servers=http://127.0.0.1:{client}", "--bind-address=127.0.0.1", f"--secure-port={secure}",
        f"--cert-dir={d / 'certs'}", f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={d / 'sa.pub'}",
        f"--service-account-signing-key-file={d / 'sa.key'}", "--service-cluster-ip-range=10.96.0.0/16",
        "--enable-priority-and-fairness=false"], stdout=logs[1], stderr=logs[1]))
    server = f"https://127.0.0.1:{secure}"
    kube_args = [kubectl, f"--server={server}", "--token=admin-token", "--insecure-skip-tls-verify"]
    started = time.monotonic()
    try:
        while subprocess.run([*kube_args, "get", "--raw", "/readyz"], capture_output=True).returncode != 0:
            assert all(p.poll() is None for p in procs), (d / "apiserver.log").read_text()[-3000:]
            assert time.monotonic() - started < 180, (d / "apiserver.log").read_text()[-3000:]
            time.sleep(1)
        for namespace in (NAMESPACE, "serving"):
            subprocess.run([*kube_args, "create", "namespace", namespace], check=True, capture_output=True)
        yield {"server": server, "kubectl": kube_args, "dir": d, "ready_s": time.monotonic() - started}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()


def kubectl(apiserver, *args, stdin: str | None = None, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([*apiserver["kubectl"], *args], input=stdin, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
    return result


@pytest.mark.parametrize("name", VALUES_SETS)
def test_server_side_dry_run_on_a_real_apiserver(helm, apiserver, name):
    docs = [d for d in template(helm, name) if d["kind"] != "ServiceMonitor"]  # a CRD this server lacks
    result = kubectl(apiserver, "apply", "--dry-run=server", "--validate=strict", "-o", "name", "-f", "-",
                     stdin=yaml.safe_dump_all(docs))
    assert len(result.stdout.split()) == len(docs), result.stdout


def test_fleet_sync_watches_a_real_apiserver_with_the_charts_rbac(helm, apiserver, tmp_path):
    """The chart's ServiceAccount, Role and RoleBinding applied for real; fleet-sync watches
    with that account's token (the Role is all it has), while slices are created and changed."""
    import aiohttp

    from kvmiss.collectors.endpointslices import KubeApi, SliceRendering, SliceWatch, WatchSettings

    docs = [d for d in template(helm, "endpointslices") if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    kubectl(apiserver, "apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
    token = kubectl(apiserver, "create", "token", "kvmiss", "-n", NAMESPACE).stdout.strip()
    (tmp_path / "token").write_text(token)
    assert kubectl(apiserver, "auth", "can-i", "list", "endpointslices.discovery.k8s.io", "-n", "serving",
                   f"--as=system:serviceaccount:{NAMESPACE}:kvmiss", check=False).stdout.strip() == "yes"
    assert kubectl(apiserver, "auth", "can-i", "list", "secrets", "-n", "serving",
                   f"--as=system:serviceaccount:{NAMESPACE}:kvmiss", check=False).stdout.strip() == "no"

    def eslice(name, endpoints):
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv6",
                "metadata": {"name": name, "namespace": "serving", "labels": {"kubernetes.io/service-name": "vllm-engines"}},
                "ports": [{"name": "kv-events", "port": 5557, "protocol": "TCP"}, {"name": "kv-replay", "port": 5558, "protocol": "TCP"}],
                "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod}}
                              for ip, pod, ready in endpoints]}

    kubectl(apiserver, "apply", "-f", "-", stdin=json.dumps(eslice("vllm-engines-a", [("fd00::1", "vllm-0", True),
                                                                                        ("fd00::2", "vllm-1", False)])))
    output = tmp_path / "fleet.toml"
    # The server's self-signed chain (its cert names 127.0.0.1), checked as a pod checks ca.crt.
    api = KubeApi(server=apiserver["server"], namespace="serving", token_file=tmp_path / "token",
                  ca_file=apiserver["dir"] / "certs" / "apiserver.crt")
    ids = lambda: [w.id for w in parse_fleet_file(output.read_text())] if output.exists() else None  # noqa: E731

    async def scenario():
        state = SliceWatch(api, "vllm-engines", SliceRendering(address_type="IPv6"), output, WatchSettings(settle_s=0.1))
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(state.run(session, stop=stop))
            try:
                await wait_for(lambda: ids() == ["vllm-0"], task)
                started = time.monotonic()
                await asyncio.to_thread(kubectl, apiserver, "apply", "-f", "-", stdin=json.dumps(eslice(
                    "vllm-engines-a", [("fd00::1", "vllm-0", True), ("fd00::2", "vllm-1", True)])))
                await asyncio.to_thread(kubectl, apiserver, "apply", "-f", "-", stdin=json.dumps(eslice(
                    "vllm-engines-b", [("fd00::3", "vllm-2", True)])))
                await wait_for(lambda: ids() == ["vllm-0", "vllm-1", "vllm-2"], task)
                joined_s = time.monotonic() - started
                await asyncio.to_thread(kubectl, apiserver, "delete", "endpointslice", "vllm-engines-a", "-n", "serving")
                await wait_for(lambda: ids() == ["vllm-2"], task)
                return state, joined_s
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)

    state, joined_s = asyncio.run(scenario())
    assert state.lists == 1  # one list, then the watch carried every change
    print(f"apiserver ready in {apiserver['ready_s']:.1f} s; two applies to file: {joined_s:.2f} s; "
          f"{state.writes} writes")


async def wait_for(predicate, task, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_the_dry_run_refuses_what_kubernetes_refuses(helm, apiserver):
    """The check can fail: a port name over 15 characters renders (Helm knows no Kubernetes
    rules) and is refused by the server's validation, naming the field."""
    docs = template(helm, "dns", "ports.otlp-http-with-a-long-name.enabled=true",
                    "ports.otlp-http-with-a-long-name.containerPort=4319", "ports.otlp-http-with-a-long-name.servicePort=4319",
                    "ports.otlp-http-with-a-long-name.protocol=TCP")
    result = kubectl(apiserver, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(
        [d for d in docs if d["kind"] == "StatefulSet"]), check=False)
    assert result.returncode != 0 and "must be no more than 15 characters" in result.stderr, result.stderr
