"""examples/collector/: OpenTelemetry Collector configurations around kvmiss.

otelcol-contrib cannot be installed here (no Go toolchain, no Docker), so these tests do not
start a Collector. They parse the YAML and check the structural facts a Collector would
reject or that would silently break kvmiss: every component a pipeline names is defined and
used, connectors join pipelines of the right types, ports agree with the kvmiss TOMLs (which
load with kvmiss's own load_config), the worker routing table equals the replicas' disjoint
subscriptions, tail sampling keeps every miss and waits long enough, span metrics carry the
verdict with a cardinality cap.
"""

from __future__ import annotations

import re

import pytest
import yaml
from example_checks import EXAMPLES, LOOPBACK, host_port

from kvmiss.enricher.metrics import NOT_MISSES
from kvmiss.schemas.attribution import Label
from kvmiss.schemas.config import Config, load_config

COLLECTOR = EXAMPLES / "collector"
CONFIGS = ["single.yaml", "sharded.yaml"]
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
    return yaml.safe_load((COLLECTOR / name).read_text())


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


# --- sharded.yaml + kvmiss-replica-*.toml --------------------------------------------------------

REPLICAS = sorted(COLLECTOR.glob("kvmiss-replica-*.toml"))


def replica(letter: str) -> Config:
    return load_config(COLLECTOR / f"kvmiss-replica-{letter}.toml")


def shard_exporters(config: dict) -> dict[str, str]:
    """loadbalancing/shard-<x> exporter id -> shard letter x."""
    out = {}
    for eid in config["exporters"]:
        match = re.fullmatch(r"(?:loadbalancing|load_balancing)/shard-(\w+)", eid)
        if match:
            out[eid] = match[1]
    return out


def worker_ids(condition: str, scope: str) -> set[str]:
    prefix = r"resource\.attributes" if scope == "resource" else r"(?<![.\w])attributes"
    return set(re.findall(prefix + r'\["kvmiss\.route\.worker"\] == "([^"]+)"', condition))


def routes(config: dict) -> list[tuple[set[str], list[str], str]]:
    """(worker ids named, pipelines, condition) for each route of the worker routing table."""
    (router,) = [c for cid, c in config["connectors"].items() if kind(cid) == "routing"]
    return [(worker_ids(r["condition"], "span"), r["pipelines"], r["condition"]) for r in router["table"]]


def shards_reached(config: dict, pipeline_ids: list[str]) -> set[str]:
    by_exporter = shard_exporters(config)
    return {by_exporter[e] for p in pipeline_ids for e in pipelines(config)[p]["exporters"] if e in by_exporter}


def test_sharded_has_two_or_more_replica_configs_and_each_loads():
    assert len(REPLICAS) >= 2
    for path in REPLICAS:
        assert load_config(path).workers, f"{path.name} subscribes to no worker"


def test_sharded_shard_exporters_balance_on_the_worker_id_attribute():
    config = load("sharded.yaml")
    exporters = shard_exporters(config)
    assert exporters, "no loadbalancing/shard-* exporter"
    assert WORKER_ATTRIBUTE in Config().attributes.worker, "kvmiss reads the worker id from this attribute"
    for eid in exporters:
        spec = config["exporters"][eid]
        assert spec["routing_key"] == "attributes", f"{eid}: routing_key"
        assert spec["routing_attributes"] == [WORKER_ATTRIBUTE], f"{eid}: routing_attributes"
        assert spec["resolver"]["static"]["hostnames"], f"{eid}: static resolver without hostnames"
        assert "endpoint" not in spec["protocol"]["otlp"], f"{eid}: the resolver supplies endpoints"


def test_sharded_each_shard_exporter_has_a_replica_config():
    letters = set(shard_exporters(load("sharded.yaml")).values())
    assert letters == {p.stem.removeprefix("kvmiss-replica-") for p in REPLICAS}


def test_sharded_routing_table_names_each_worker_in_span_and_resource_form():
    for ids, _, condition in routes(load("sharded.yaml")):
        assert ids == worker_ids(condition, "resource"), condition


def test_sharded_every_routed_worker_reaches_the_replica_that_subscribes_to_it():
    config = load("sharded.yaml")
    explicit = [(ids, pl) for ids, pl, _ in routes(config) if ids]
    assert explicit, "the routing table names no worker"
    for ids, pipeline_ids in explicit:
        (shard,) = shards_reached(config, pipeline_ids)  # one route, one shard
        subscribed = {w.id for w in replica(shard).workers}
        assert ids == subscribed, f"route {sorted(ids)} reaches shard {shard}, which subscribes to {sorted(subscribed)}"


def test_sharded_union_of_replica_workers_equals_the_routed_workers_without_overlap():
    config = load("sharded.yaml")
    routed = [ids for ids, _, _ in routes(config) if ids]
    subscribed = [{w.id for w in load_config(p).workers} for p in REPLICAS]
    assert set().union(*routed) == set().union(*subscribed)
    assert sum(map(len, routed)) == len(set().union(*routed)), "a worker id is in two routes"
    assert sum(map(len, subscribed)) == len(set().union(*subscribed)), "a worker is subscribed by two replicas"
    endpoints = [w.sub_endpoint() for p in REPLICAS for w in load_config(p).workers]
    assert len(endpoints) == len(set(endpoints)), "two replicas subscribe to the same event stream"


def test_sharded_unlisted_worker_ids_still_reach_kvmiss_and_unlabelled_spans_skip_it():
    config = load("sharded.yaml")
    catch_all = [pl for ids, pl, cond in routes(config) if not ids and "!= nil" in cond]
    assert catch_all and shards_reached(config, catch_all[0]), \
        "spans naming an unconfigured worker must reach a kvmiss (it labels them untracked)"
    (router,) = [c for cid, c in config["connectors"].items() if kind(cid) == "routing"]
    for pid in router["default_pipelines"]:
        assert not shards_reached(config, [pid])
        assert any(kind(e) in ("loadbalancing", "load_balancing") for e in pipelines(config)[pid]["exporters"])


def test_sharded_shard_ports_agree_with_the_replicas_otlp_listen_addresses():
    config = load("sharded.yaml")
    for eid, shard in shard_exporters(config).items():
        kv_host, kv_port = host_port(replica(shard).otlp.grpc)
        assert kv_host not in LOOPBACK, f"replica {shard} must be reachable from the gateway Collectors"
        for hostname in config["exporters"][eid]["resolver"]["static"]["hostnames"]:
            assert host_port(hostname)[1] == kv_port, f"{eid} -> {hostname}, replica {shard} listens on {kv_port}"


def test_sharded_replicas_export_to_the_enriched_receiver():
    config = load("sharded.yaml")
    enriched_port = host_port(receiver_endpoints(config)[("otlp/enriched", "grpc")])[1]
    for path in REPLICAS:
        endpoint = load_config(path).export.endpoint
        assert endpoint.startswith("grpc://") and host_port(endpoint)[1] == enriched_port, path.name


def test_sharded_replicas_hash_and_digest_alike():
    configs = [load_config(p) for p in REPLICAS]
    assert len({(c.engine.hash_algo, c.engine.hash_seed, c.engine.block_size, c.engine.extra_keys_format)
                for c in configs}) == 1, "replicas must hash blocks the same way"
    assert len({(c.privacy.digest_key_env, c.privacy.digest_key) for c in configs}) == 1, \
        "one digest key for all shards, so digests compare across them"


def test_sharded_trace_id_tier_feeds_the_samplers():
    config = load("sharded.yaml")
    lb = config["exporters"]["loadbalancing/traceid"]
    assert lb["routing_key"] == "traceID"
    sampler_port = host_port(receiver_endpoints(config)[("otlp/sampler", "grpc")])[1]
    assert all(host_port(h)[1] == sampler_port for h in lb["resolver"]["static"]["hostnames"])
    (sample,) = pipelines_with(config, "receivers", "otlp/sampler")
    assert "tail_sampling" in pipelines(config)[sample]["processors"]
    (enriched,) = pipelines_with(config, "receivers", "otlp/enriched")
    assert "loadbalancing/traceid" in pipelines(config)[enriched]["exporters"]
    # enrichment before sampling: no pipeline that feeds kvmiss samples
    for pid in pipelines_with(config, "receivers", "otlp") + [p for _, pl, _ in routes(config) for p in pl]:
        assert "tail_sampling" not in pipelines(config)[pid].get("processors", [])


def test_sharded_tail_sampling_keeps_every_miss_label_and_samples_hits():
    policies = load("sharded.yaml")["processors"]["tail_sampling"]["policies"]
    kept = [p for p in policies if p["type"] == "string_attribute" and p["string_attribute"]["key"] == "kvmiss.label"]
    assert len(kept) == 1 and not kept[0]["string_attribute"].get("invert_match", False)
    misses = {label.value for label in Label} - {label.value for label in NOT_MISSES}
    assert set(kept[0]["string_attribute"]["values"]) == misses
    sampled = [p for p in policies if p["type"] == "probabilistic"]
    assert sampled and all(0 < p["probabilistic"]["sampling_percentage"] < 100 for p in sampled)


def test_sharded_tail_sampling_waits_longer_than_kvmiss_holds_a_span():
    sampling = load("sharded.yaml")["processors"]["tail_sampling"]
    held = max(c.history.assemble_wait_s + c.history.wait_s for c in map(load_config, REPLICAS))
    wait = seconds(sampling["decision_wait"])
    assert wait > held, f"decision_wait {wait}s must exceed kvmiss's longest hold ({held}s)"
    assert sampling["num_traces"] >= wait * sampling["expected_new_traces_per_sec"]


def test_sharded_spanmetrics_carry_the_verdict_with_a_cardinality_cap():
    config = load("sharded.yaml")
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

