"""examples/collector/: OpenTelemetry Collector configurations around kvmiss.

These tests parse the YAML (with every ``${env:NAME:-default}`` at its default) and check the
facts that would silently break kvmiss, which a Collector accepts without complaint (the
Collector's own ``validate`` and the end-to-end runs are in tests/stack): every component a pipeline names is defined and
used, connectors join pipelines of the right types, ports agree with the kvmiss TOMLs (which
load with kvmiss's own load_config), the scale-out example balances by trace id over
replicas that each subscribe to the whole fleet, retries kvmiss's pushback per replica, tail
sampling keeps every miss and waits long enough, span metrics carry the verdict with a
cardinality cap. The checks of the scale-out example are functions, and each is also shown
to fail on a broken copy of the example.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from example_checks import EXAMPLES, LOOPBACK, host_port, with_env_defaults

from kvmiss.schemas.attribution import Label
from kvmiss.schemas.config import Config, ConfigError, load_config, parse_config
from kvmiss.schemas.labels import NOT_MISSES

COLLECTOR = EXAMPLES / "collector"
CONFIGS = ["single.yaml", "replicas.yaml"]
WORKER_ATTRIBUTE = "kvmiss.route.worker"
# Component types of otelcol-contrib these examples may use (loadbalancing is being renamed
# load_balancing; both names are accepted by current releases).
KNOWN_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch", "tail_sampling"},
    "exporters": {"otlp", "loadbalancing", "load_balancing", "prometheus"},
    "connectors": {"routing", "spanmetrics"},
}
SIGNALS = {"traces", "metrics", "logs"}


def load(name: str) -> dict:
    return yaml.safe_load(with_env_defaults((COLLECTOR / name).read_text()))


def pipelines(config: dict) -> dict[str, dict]:
    return config["service"]["pipelines"]


def signal(pipeline_id: str) -> str:
    return pipeline_id.split("/")[0]


def kind(component_id: str) -> str:
    return component_id.split("/")[0]


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(duration))
    assert match, f"not a duration: {duration!r}"
    return float(match[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match[2]]


def receiver_endpoints(config: dict) -> dict[tuple[str, str], str]:
    """(receiver id, protocol) -> endpoint."""
    out = {}
    for rid, spec in config["receivers"].items():
        for protocol, settings in (spec or {}).get("protocols", {}).items():
            out[(rid, protocol)] = settings["endpoint"]
    return out


def pipelines_with(config: dict, role: str, component: str) -> list[str]:
    return [pid for pid, p in pipelines(config).items() if component in p.get(role, [])]


# --- both configurations: the structure a Collector checks at start-up ------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_every_pipeline_names_only_defined_components(name):
    config = load(name)
    connectors = set(config.get("connectors") or {})
    for pid, p in pipelines(config).items():
        assert signal(pid) in SIGNALS, f"{name}: pipeline {pid}: unknown signal"
        assert p.get("receivers"), f"{name}: pipeline {pid} has no receiver"
        assert p.get("exporters"), f"{name}: pipeline {pid} has no exporter"
        for rid in p["receivers"]:
            assert rid in config["receivers"] or rid in connectors, f"{name}: {pid}: receiver {rid} undefined"
        for prid in p.get("processors", []):
            assert prid in (config.get("processors") or {}), f"{name}: {pid}: processor {prid} undefined"
        for eid in p["exporters"]:
            assert eid in config["exporters"] or eid in connectors, f"{name}: {pid}: exporter {eid} undefined"


@pytest.mark.parametrize("name", CONFIGS)
def test_every_defined_component_is_used_and_of_a_known_type(name):
    config = load(name)
    used = {role: set() for role in ("receivers", "processors", "exporters")}
    for p in pipelines(config).values():
        for role in used:
            used[role].update(p.get(role, []))
    for section in ("receivers", "processors", "exporters", "connectors"):
        for cid in config.get(section) or {}:
            assert kind(cid) in KNOWN_TYPES[section], f"{name}: {section}.{cid}: not an otelcol-contrib type used here"
            if section == "connectors":
                assert cid in used["exporters"] and cid in used["receivers"], \
                    f"{name}: connector {cid} must be an exporter of one pipeline and a receiver of another"
            else:
                assert cid in used[section], f"{name}: {section}.{cid} is defined but in no pipeline"


@pytest.mark.parametrize("name", CONFIGS)
def test_connectors_join_pipelines_of_the_right_signals(name):
    config = load(name)
    expected = {"spanmetrics": ("traces", "metrics"), "routing": ("traces", "traces")}
    for cid, spec in (config.get("connectors") or {}).items():
        source, target = expected[kind(cid)]
        assert {signal(p) for p in pipelines_with(config, "exporters", cid)} == {source}, f"{name}: {cid}"
        assert {signal(p) for p in pipelines_with(config, "receivers", cid)} == {target}, f"{name}: {cid}"
        if kind(cid) == "routing":
            named = set(spec.get("default_pipelines", []))
            for route in spec["table"]:
                named.update(route["pipelines"])
            assert named == set(pipelines_with(config, "receivers", cid)), \
                f"{name}: {cid}: routed-to pipelines must be exactly those that receive from it"


@pytest.mark.parametrize("name", CONFIGS)
def test_no_two_receivers_share_a_port(name):
    ports = [host_port(e)[1] for e in receiver_endpoints(load(name)).values()]
    assert len(ports) == len(set(ports)), f"{name}: receiver ports collide: {sorted(ports)}"


# --- single.yaml + kvmiss-single.toml -----------------------------------------------------------

def test_single_kvmiss_config_loads_with_kvmiss_own_loader():
    config = load_config(COLLECTOR / "kvmiss-single.toml")
    assert config.workers, "kvmiss-single.toml subscribes to no worker"
    assert config.export.endpoint


def test_single_collector_exports_to_the_port_kvmiss_listens_on():
    collector, kvmiss = load("single.yaml"), load_config(COLLECTOR / "kvmiss-single.toml")
    host, port = host_port(collector["exporters"]["otlp/kvmiss"]["endpoint"])
    kv_host, kv_port = host_port(kvmiss.otlp.grpc)
    assert port == kv_port, "otlp/kvmiss must target kvmiss's [otlp] grpc port"
    assert host == kv_host or (kv_host in LOOPBACK and host in LOOPBACK) or kv_host == "0.0.0.0"


def test_single_kvmiss_exports_to_the_collectors_enriched_receiver():
    collector, kvmiss = load("single.yaml"), load_config(COLLECTOR / "kvmiss-single.toml")
    scheme = kvmiss.export.endpoint.split("://")[0]
    assert scheme == "grpc"
    endpoints = receiver_endpoints(collector)
    assert host_port(kvmiss.export.endpoint)[1] == host_port(endpoints[("otlp/enriched", "grpc")])[1]


def test_single_kvmiss_listens_on_no_port_the_collector_uses():
    collector, kvmiss = load("single.yaml"), load_config(COLLECTOR / "kvmiss-single.toml")
    collector_ports = {host_port(e)[1] for e in receiver_endpoints(collector).values()}
    kvmiss_ports = {host_port(a)[1] for a in (kvmiss.otlp.grpc, kvmiss.otlp.http, kvmiss.metrics.listen)}
    assert not collector_ports & kvmiss_ports, "kvmiss and the Collector run on one host"


def test_single_spans_go_through_kvmiss_once_then_to_the_backend():
    config = load("single.yaml")
    ingest = pipelines_with(config, "receivers", "otlp")
    enriched = pipelines_with(config, "receivers", "otlp/enriched")
    assert [pipelines(config)[p]["exporters"] for p in ingest] == [["otlp/kvmiss"]]
    assert [pipelines(config)[p]["exporters"] for p in enriched] == [["otlp/backend"]]


def test_single_collector_retries_and_queues_when_kvmiss_pushes_back():
    exporter = load("single.yaml")["exporters"]["otlp/kvmiss"]
    assert exporter["retry_on_failure"]["enabled"] and exporter["sending_queue"]["enabled"]


# --- replicas.yaml + kvmiss-replica.toml ---------------------------------------------------------
#
# Every replica subscribes to the whole fleet and the Collector balances by trace id. The fleet
# is stated once, independently of the replica config, on the "fleet:" comment line of
# replicas.yaml, so a worker dropped from (or added to) kvmiss-replica.toml alone is caught.

REPLICAS_YAML = "replicas.yaml"
REPLICA_TOML = COLLECTOR / "kvmiss-replica.toml"
LOADBALANCING = ("loadbalancing", "load_balancing")


def declared_fleet() -> list[str]:
    lines = re.findall(r"^#\s*fleet:\s*(.*)$", (COLLECTOR / REPLICAS_YAML).read_text(), re.M)
    assert len(lines) == 1, f"{REPLICAS_YAML} must state the fleet on exactly one '# fleet:' line"
    fleet = lines[0].split()
    assert fleet and len(fleet) == len(set(fleet)), f"fleet line: {lines[0]!r}"
    return fleet


def replica() -> Config:
    return load_config(REPLICA_TOML)


def replica_config_for(host: str) -> Path:
    """The config a resolver host runs: a kvmiss-replica-<host>.toml if one existed (which
    test_replicas_one_config_for_every_replica_and_it_loads forbids), else kvmiss-replica.toml."""
    own = COLLECTOR / f"kvmiss-replica-{host}.toml"
    return own if own.exists() else REPLICA_TOML


def tier1_exporter_id(config: dict) -> str:
    """The one exporter of the pipeline that takes what routers and engines send."""
    (ingest,) = pipelines_with(config, "receivers", "otlp")
    (eid,) = pipelines(config)[ingest]["exporters"]
    return eid


def resolver_targets(exporter: dict) -> list[tuple[str, int]]:
    static = exporter["resolver"].get("static")
    assert static and set(exporter["resolver"]) == {"static"}, \
        "a static resolver (a stable list; dns/k8s move traces whenever a replica restarts)"
    return [host_port(h) for h in static["hostnames"]]


# The checks, each a function so that the negative tests below can show it fails.

def check_tier1_balances_by_trace_id(config: dict) -> None:
    """Tier 1: one loadbalancing exporter by trace id over the replicas; no routing by worker
    anywhere (a replica must be able to get any worker's requests)."""
    (ingest,) = pipelines_with(config, "receivers", "otlp")
    eid = tier1_exporter_id(config)
    assert kind(eid) in LOADBALANCING, f"{ingest} must export to a loadbalancing exporter, not {eid}"
    exporter = config["exporters"][eid]
    assert exporter.get("routing_key") == "traceID", \
        f"{eid}: routing_key must be traceID (kvmiss joins a request's spans within their trace)"
    assert "routing_attributes" not in exporter, f"{eid}: routing_attributes with trace-id routing"
    assert "endpoint" not in exporter["protocol"]["otlp"], f"{eid}: the resolver supplies endpoints"
    assert not [c for c in config.get("connectors") or {} if kind(c) == "routing"], \
        "no routing connector: every replica judges every worker's requests"
    assert WORKER_ATTRIBUTE not in yaml.safe_dump(config), \
        f"nothing may route on {WORKER_ATTRIBUTE}: replicas are not assigned workers"
    processors = pipelines(config)[ingest].get("processors", [])
    assert processors[:1] == ["memory_limiter"] and "batch/to-kvmiss" in processors, processors
    targets = resolver_targets(exporter)
    assert len(targets) >= 2 and len(set(targets)) == len(targets), f"{eid}: replicas {targets}"


def check_replica_serves_whole_fleet(config: Config, fleet: list[str]) -> None:
    """A replica subscribes to every worker of the fleet, once, and to nothing else."""
    ids = [w.id for w in config.workers]
    assert len(ids) == len(set(ids)), f"a worker is listed twice: {sorted(ids)}"
    missing = sorted(set(fleet) - set(ids))
    assert not missing, f"the replica does not subscribe to {missing}: it cannot rule them out as holders"
    extra = sorted(set(ids) - set(fleet))
    assert not extra, f"{extra} are not in the declared fleet ({REPLICAS_YAML} '# fleet:' line)"
    streams = [w.sub_endpoint() for w in config.workers]
    assert len(streams) == len(set(streams)), "two workers share one event stream"
    assert all(w.replay_address() for w in config.workers), "every stream needs its replay endpoint"


def check_exporter_reaches_replicas(config: dict, replica_config: Config) -> None:
    """Each resolver target is a replica's OTLP/gRPC listener, reachable from the gateways."""
    eid = tier1_exporter_id(config)
    kv_host, kv_port = host_port(replica_config.otlp.grpc)
    assert kv_host not in LOOPBACK, "replicas must listen beyond loopback: the gateways are other hosts"
    for host, port in resolver_targets(config["exporters"][eid]):
        assert port == kv_port, f"{eid} -> {host}:{port}, but kvmiss-replica.toml listens on {kv_port}"


def check_retries_per_replica(exporter: dict, single: dict) -> None:
    """kvmiss's UNAVAILABLE / 503 pushback is retried and queued per replica, with at least
    single.yaml's patience, and not at the loadbalancing level (which would re-send the
    parts other replicas had accepted)."""
    otlp = exporter["protocol"]["otlp"]
    retry, queue = otlp.get("retry_on_failure") or {}, otlp.get("sending_queue") or {}
    assert retry.get("enabled") and queue.get("enabled"), "each replica's sends must retry and queue"

    def patience(r: dict) -> float:
        value = seconds(r.get("max_elapsed_time", "300s"))
        return float("inf") if value == 0 else value

    assert patience(retry) >= patience(single["retry_on_failure"]), "gives up sooner than single.yaml"
    assert queue.get("queue_size", 1000) >= single["sending_queue"]["queue_size"], "a smaller queue than single.yaml"
    for key in ("retry_on_failure", "sending_queue"):
        assert not (exporter.get(key) or {}).get("enabled", False), \
            f"{key} at the loadbalancing level re-sends whole batches to every replica (duplicates)"


# The example passes them.

def test_replicas_one_config_for_every_replica_and_it_loads():
    assert sorted(COLLECTOR.glob("kvmiss-replica*.toml")) == [REPLICA_TOML], \
        "one replica config, used by every replica (no per-shard configs)"
    assert not (COLLECTOR / "sharded.yaml").exists()
    assert replica().workers and replica().export.endpoint


def test_replicas_tier1_balances_by_trace_id_without_routing_by_worker():
    assert WORKER_ATTRIBUTE in Config().attributes.worker, "kvmiss reads the worker id from this attribute"
    check_tier1_balances_by_trace_id(load(REPLICAS_YAML))


def test_replicas_every_resolver_host_runs_a_config_with_the_whole_fleet():
    config, fleet = load(REPLICAS_YAML), declared_fleet()
    assert len(fleet) >= 2
    hosts = [h for h, _ in resolver_targets(config["exporters"][tier1_exporter_id(config)])]
    assert hosts
    for host in hosts:
        check_replica_serves_whole_fleet(load_config(replica_config_for(host)), fleet)


def test_replicas_exporter_port_is_the_replicas_grpc_port():
    check_exporter_reaches_replicas(load(REPLICAS_YAML), replica())


def test_replicas_retry_pushback_like_single_yaml():
    config = load(REPLICAS_YAML)
    check_retries_per_replica(config["exporters"][tier1_exporter_id(config)],
                              load("single.yaml")["exporters"]["otlp/kvmiss"])


def test_replicas_export_to_tier2s_enriched_receiver_which_never_feeds_kvmiss_again():
    config = load(REPLICAS_YAML)
    endpoint = replica().export.endpoint
    enriched_port = host_port(receiver_endpoints(config)[("otlp/enriched", "grpc")])[1]
    assert endpoint.startswith("grpc://") and host_port(endpoint)[1] == enriched_port
    assert host_port(endpoint)[0] not in LOOPBACK, "the gateways are other hosts"
    (enriched,) = pipelines_with(config, "receivers", "otlp/enriched")
    assert tier1_exporter_id(config) not in pipelines(config)[enriched]["exporters"], \
        "enriched spans must not go through kvmiss again"


def test_replicas_read_the_digest_key_from_the_environment():
    privacy = replica().privacy
    assert privacy.digest_key is None and privacy.digest_key_env, \
        "one key for every replica, from the environment, never in the file"


def test_replicas_trace_id_tier_feeds_the_samplers():
    config = load(REPLICAS_YAML)
    lb = config["exporters"]["loadbalancing/traceid"]
    assert lb["routing_key"] == "traceID"
    sampler_port = host_port(receiver_endpoints(config)[("otlp/sampler", "grpc")])[1]
    assert all(host_port(h)[1] == sampler_port for h in lb["resolver"]["static"]["hostnames"])
    (sample,) = pipelines_with(config, "receivers", "otlp/sampler")
    assert "tail_sampling" in pipelines(config)[sample]["processors"]
    (enriched,) = pipelines_with(config, "receivers", "otlp/enriched")
    assert "loadbalancing/traceid" in pipelines(config)[enriched]["exporters"]
    # enrichment before sampling: nothing on the way to kvmiss samples
    for pid in pipelines_with(config, "receivers", "otlp") + [enriched]:
        assert "tail_sampling" not in pipelines(config)[pid].get("processors", [])


def test_replicas_tail_sampling_keeps_every_miss_label_and_samples_hits():
    policies = load(REPLICAS_YAML)["processors"]["tail_sampling"]["policies"]
    kept = [p for p in policies if p["type"] == "string_attribute" and p["string_attribute"]["key"] == "kvmiss.label"]
    assert len(kept) == 1 and not kept[0]["string_attribute"].get("invert_match", False)
    misses = {label.value for label in Label} - {label.value for label in NOT_MISSES}
    assert set(kept[0]["string_attribute"]["values"]) == misses
    sampled = [p for p in policies if p["type"] == "probabilistic"]
    assert sampled and all(0 < p["probabilistic"]["sampling_percentage"] < 100 for p in sampled)


def test_replicas_tail_sampling_waits_longer_than_kvmiss_holds_a_span():
    sampling = load(REPLICAS_YAML)["processors"]["tail_sampling"]
    history = replica().history
    held = history.assemble_wait_s + history.wait_s
    wait = seconds(sampling["decision_wait"])
    assert wait > held, f"decision_wait {wait}s must exceed kvmiss's longest hold ({held}s)"
    assert sampling["num_traces"] >= wait * sampling["expected_new_traces_per_sec"]


def test_replicas_spanmetrics_carry_the_verdict_with_a_cardinality_cap():
    config = load(REPLICAS_YAML)
    spanmetrics = config["connectors"]["spanmetrics"]
    dimensions = [d["name"] for d in spanmetrics["dimensions"]]
    assert "kvmiss.label" in dimensions and "kvmiss.owner" in dimensions
    forbidden = {"kvmiss.first_miss_digest", "kvmiss.first_miss_block", "gen_ai.request.id", "kvmiss.reason"}
    assert not forbidden & set(dimensions), "high-cardinality attribute as a metric dimension"
    limit = spanmetrics["aggregation_cardinality_limit"]
    assert isinstance(limit, int) and limit > 0
    # before sampling: fed by the enriched pipeline, not by the sampled one
    (enriched,) = pipelines_with(config, "receivers", "otlp/enriched")
    assert "spanmetrics" in pipelines(config)[enriched]["exporters"]
    (sample,) = pipelines_with(config, "receivers", "otlp/sampler")
    assert "spanmetrics" not in pipelines(config)[sample]["exporters"]


# ... and broken copies of it fail them.

def replica_text_without(worker_id: str) -> str:
    text = REPLICA_TOML.read_text()
    block = re.compile(rf'^\[\[workers\]\]\nid = "{re.escape(worker_id)}"\n(?:(?!\[)\S.*\n)*\n?', re.M)
    changed, count = block.subn("", text)
    assert count == 1, f"no single [[workers]] block for {worker_id} in {REPLICA_TOML.name}"
    return changed


@pytest.mark.parametrize("worker_id", [w.id for w in load_config(REPLICA_TOML).workers])
def test_a_replica_config_missing_one_worker_is_detected(worker_id):
    broken = parse_config(replica_text_without(worker_id), source="broken copy")
    assert len(broken.workers) == len(replica().workers) - 1
    with pytest.raises(AssertionError, match=worker_id):
        check_replica_serves_whole_fleet(broken, declared_fleet())


def test_a_replica_config_with_a_worker_outside_the_fleet_or_listed_twice_is_refused():
    text = REPLICA_TOML.read_text()
    extra = '\n[[workers]]\nid = "w9"\nendpoint = "tcp://vllm-9:5557"\nreplay_endpoint = "tcp://vllm-9:5558"\n'
    with pytest.raises(AssertionError, match="w9"):
        check_replica_serves_whole_fleet(parse_config(text + extra), declared_fleet())
    # a worker listed twice: kvmiss's own loader refuses it before any check could run
    twice = '\n[[workers]]\nid = "w0"\nendpoint = "tcp://vllm-0:5557"\nreplay_endpoint = "tcp://vllm-0:5558"\n'
    with pytest.raises(ConfigError, match="duplicate id 'w0'"):
        parse_config(text + twice)


def test_tier1_routing_by_worker_or_not_by_trace_id_is_detected():
    good = load(REPLICAS_YAML)
    eid = tier1_exporter_id(good)

    by_attribute = copy.deepcopy(good)
    by_attribute["exporters"][eid].update(routing_key="attributes", routing_attributes=[WORKER_ATTRIBUTE])
    with pytest.raises(AssertionError, match="traceID"):
        check_tier1_balances_by_trace_id(by_attribute)

    by_service = copy.deepcopy(good)
    by_service["exporters"][eid]["routing_key"] = "service"
    with pytest.raises(AssertionError, match="traceID"):
        check_tier1_balances_by_trace_id(by_service)

    # the old design: a routing connector by worker in front of per-shard exporters
    sharded = copy.deepcopy(good)
    (ingest,) = pipelines_with(sharded, "receivers", "otlp")
    sharded["connectors"]["routing/workers"] = {"table": [{
        "context": "span", "condition": f'attributes["{WORKER_ATTRIBUTE}"] == "w0"', "pipelines": ["traces/shard-a"]}]}
    sharded["service"]["pipelines"][ingest]["exporters"] = ["routing/workers"]
    sharded["service"]["pipelines"]["traces/shard-a"] = {"receivers": ["routing/workers"], "exporters": [eid]}
    with pytest.raises(AssertionError, match="loadbalancing"):
        check_tier1_balances_by_trace_id(sharded)


def test_a_port_mismatch_and_a_loopback_replica_are_detected():
    good, kv = load(REPLICAS_YAML), replica()
    wrong_port = copy.deepcopy(good)
    hostnames = wrong_port["exporters"][tier1_exporter_id(good)]["resolver"]["static"]["hostnames"]
    hostnames[-1] = hostnames[-1].rsplit(":", 1)[0] + ":5317"
    with pytest.raises(AssertionError, match="5317"):
        check_exporter_reaches_replicas(wrong_port, kv)
    loopback = parse_config(REPLICA_TOML.read_text().replace(f'grpc = "{kv.otlp.grpc}"', 'grpc = "127.0.0.1:4317"'))
    with pytest.raises(AssertionError, match="loopback"):
        check_exporter_reaches_replicas(good, loopback)


def test_missing_or_top_level_retries_are_detected():
    good = load(REPLICAS_YAML)
    exporter = good["exporters"][tier1_exporter_id(good)]
    single = load("single.yaml")["exporters"]["otlp/kvmiss"]

    no_retry = copy.deepcopy(exporter)
    no_retry["protocol"]["otlp"]["retry_on_failure"]["enabled"] = False
    with pytest.raises(AssertionError, match="retry"):
        check_retries_per_replica(no_retry, single)

    impatient = copy.deepcopy(exporter)
    impatient["protocol"]["otlp"]["retry_on_failure"]["max_elapsed_time"] = "30s"
    with pytest.raises(AssertionError, match="sooner"):
        check_retries_per_replica(impatient, single)

    top_level = copy.deepcopy(exporter)
    top_level["retry_on_failure"] = top_level["protocol"]["otlp"]["retry_on_failure"]
    with pytest.raises(AssertionError, match="duplicates"):
        check_retries_per_replica(top_level, single)


def test_replicas_journal_what_they_accept():
    """The Collector forgets what a replica acknowledged: only the replica's own write-ahead
    journal keeps it across a crash, so the replica config turns it on."""
    config = load_config(str(REPLICA_TOML))
    assert config.export.journal and config.export.journal.startswith("/var/lib/")
