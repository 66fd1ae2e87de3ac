"""examples/queries.md and examples/grafana/kvmiss-dashboard.json.

Neither Jaeger, Tempo nor Grafana runs here, so no query is executed. What is checked is
what goes stale silently: every PromQL metric name (and label name) must be one kvmiss
really exports — taken from a KvmissCollector scraped after a small real pipeline judged a
request — every label/owner value filtered on must be one kvmiss writes, and the dashboard
must be importable (valid JSON, schemaVersion >= 36, unique panel ids, a Prometheus
datasource variable used by every query, no overlapping panels) with its replay-window
assumptions equal to `kvmiss replay-size`'s defaults.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import yaml
from example_checks import (
    EXAMPLES,
    fenced_blocks,
    grafana_variables,
    promql_metric_names,
    sample_names,
    scrape_kvmiss_metrics,
    with_env_defaults,
)

from kvmiss.collectors.replay_window import VLLM_DEFAULT_BUFFER_STEPS
from kvmiss.enricher.cli import replay_size_cmd
from kvmiss.schemas.attribution import LABEL_OWNER, Label

QUERIES = EXAMPLES / "queries.md"
DASHBOARD = EXAMPLES / "grafana" / "kvmiss-dashboard.json"
LABELS = {label.value for label in Label}
OWNERS = {owner.value for owner in LABEL_OWNER.values()}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}


@pytest.fixture(scope="module")
def exposition() -> str:
    return scrape_kvmiss_metrics()


@pytest.fixture(scope="module")
def exported(exposition) -> set[str]:
    names = sample_names(exposition)
    assert "kvmiss_requests_total" in names and "kvmiss_stream_unrecoverable_gaps_total" in names
    return names


@pytest.fixture(scope="module")
def label_names(exposition) -> dict[str, set[str]]:
    """metric name -> its label names, from the scrape."""
    out: dict[str, set[str]] = {}
    for line in exposition.splitlines():
        match = re.match(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", line)
        if match and not line.startswith("#"):
            out.setdefault(match[1], set()).update(re.findall(r'(\w+)="', match[2]))
    return out


def spanmetrics_names() -> set[str]:
    """The Prometheus names of collector/replicas.yaml's spanmetrics connector output."""
    spanmetrics = yaml.safe_load(with_env_defaults((EXAMPLES / "collector" / "replicas.yaml").read_text()))["connectors"]["spanmetrics"]
    prefix = spanmetrics.get("namespace", "traces.span.metrics").replace(".", "_")
    unit = {"ms": "milliseconds", "s": "seconds"}[spanmetrics.get("histogram", {}).get("unit", "ms")]
    duration = f"{prefix}_duration_{unit}"
    return {f"{prefix}_calls_total", f"{duration}_bucket", f"{duration}_sum", f"{duration}_count"}


def check_label_usage(expr: str, label_names: dict[str, set[str]]) -> None:
    """Matchers and by/without lists on kvmiss metrics name labels those metrics have, and
    label/owner values are ones kvmiss writes."""
    metrics = {m for m in promql_metric_names(expr) if m.startswith("kvmiss_")}
    if not metrics:
        return
    allowed = set().union(*(label_names.get(m, set()) for m in metrics)) | {"le", "instance", "job"}
    for matchers in re.findall(r"\b[a-z_:][\w:]*\{([^}]*)\}", expr):
        for name, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
            assert name in allowed, f"label {name!r} is not on {sorted(metrics)}: {expr}"
            vocabulary = {"label": LABELS, "owner": OWNERS}.get(name)
            if vocabulary and "$" not in value:
                for part in value.split("|") if op in ("=~", "!~") else [value]:
                    if not re.search(r"[.*+?\[\]()]", part):
                        assert part in vocabulary, f"{name}={part!r} is never written by kvmiss: {expr}"
                    else:
                        assert any(re.fullmatch(part, v) for v in vocabulary), f"{part!r} matches no {name}"
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for name in filter(None, (n.strip() for n in group.split(","))):
            assert name in allowed, f"grouping label {name!r} is not on {sorted(metrics)}: {expr}"


# --- the PromQL name extractor itself -----------------------------------------------------------

def test_promql_name_extraction_skips_functions_labels_durations_and_variables():
    expr = ('histogram_quantile(0.95, sum by (le, worker) (rate(kvmiss_history_wait_seconds_bucket'
            '{worker=~"$worker"}[$__rate_interval]))) / on(worker) group_left max(kvmiss_unknown_budget) '
            '# kvmiss_not_a_query\n> bool 0.5 and $buffer_steps')
    assert promql_metric_names(expr) == {"kvmiss_history_wait_seconds_bucket", "kvmiss_unknown_budget"}
    assert grafana_variables(expr) == {"worker", "__rate_interval", "buffer_steps"}


# --- queries.md -------------------------------------------------------------------------------

def promql_queries() -> list[str]:
    queries = fenced_blocks(QUERIES.read_text(), "promql")
    assert len(queries) >= 10
    return queries


def test_queries_md_promql_uses_only_metrics_kvmiss_or_the_spanmetrics_example_exports(exported):
    spanmetrics = spanmetrics_names()
    for expr in promql_queries():
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported - spanmetrics
        assert not unknown, f"not exported by kvmiss (nor by replicas.yaml's spanmetrics): {sorted(unknown)} in {expr!r}"


def test_queries_md_promql_labels_and_values_exist(label_names):
    for expr in promql_queries():
        check_label_usage(expr, label_names)


def test_queries_md_promql_covers_labels_owners_tokens_budget_and_streams():
    used = set().union(*(promql_metric_names(q) for q in promql_queries()))
    for name in ("kvmiss_requests_total", "kvmiss_missed_tokens_total", "kvmiss_unknown_share",
                 "kvmiss_unknown_budget", "kvmiss_stream_gaps_total", "kvmiss_stream_unrecoverable_gaps_total",
                 "kvmiss_stream_quarantined", "kvmiss_stream_epoch_changes_total",
                 "kvmiss_stream_batches_applied_total", "kvmiss_stream_peak_batches_per_second"):
        assert name in used, f"queries.md has no query on {name}"


def test_queries_md_jaeger_tag_filters_are_json_on_real_labels_and_owners():
    text = QUERIES.read_text()
    filters = [json.loads(m) for m in re.findall(r"tags=(\{[^}]*\})", text)]
    assert {"kvmiss.label": "evicted"} in filters
    assert any("kvmiss.owner" in f for f in filters)
    for f in filters:
        assert f.get("kvmiss.label", "hit") in LABELS and f.get("kvmiss.owner", "none") in OWNERS
    assert "/api/traces?service=" in text


def test_queries_md_traceql_filters_on_real_labels_and_owners():
    blocks = fenced_blocks(QUERIES.read_text(), "traceql")
    text = "\n".join(blocks)
    assert '{ span.kvmiss.label = "evicted" }' in text
    assert re.search(r'span\.kvmiss\.owner = "\w+"', text), "no TraceQL query by owner"
    assert re.search(r'span\.kvmiss\.label =~ "unknown_', text), "no TraceQL query on the unknown budget"
    for block in blocks:
        code = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("//"))
        assert code.count("{") == code.count("}") and code.count("(") == code.count(")"), block
    for value in re.findall(r'span\.kvmiss\.label = "([^"]+)"', text):
        assert value in LABELS
    for value in re.findall(r'span\.kvmiss\.owner = "([^"]+)"', text):
        assert value in OWNERS


# --- the Grafana dashboard -------------------------------------------------------------------

@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in query_panels(dashboard) for t in p["targets"]]


def test_dashboard_is_valid_json_of_a_current_schema(dashboard):
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and dashboard["uid"]


def test_dashboard_panel_ids_are_unique(dashboard):
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), sorted(ids)


def test_dashboard_panels_fit_the_grid_without_overlapping(dashboard):
    cells = set()
    for panel in all_panels(dashboard):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area


def test_dashboard_uses_its_prometheus_datasource_variable_everywhere(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    (ds,) = [v for v in variables.values() if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    ref = f"${{{ds['name']}}}"
    for panel in query_panels(dashboard):
        assert panel["datasource"]["uid"] == ref, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == ref, panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == ref


def test_dashboard_queries_use_only_metrics_and_labels_kvmiss_exports(dashboard, exported, label_names):
    for expr in exprs(dashboard):
        names = promql_metric_names(expr)
        assert names, expr
        assert names <= exported, f"not exported by kvmiss: {sorted(names - exported)} in {expr!r}"
        check_label_usage(expr, label_names)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query).groups()
            assert metric in exported and label in label_names[metric]


def test_dashboard_variables_used_are_defined(dashboard):
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    for panel in query_panels(dashboard):
        texts = [t["expr"] for t in panel["targets"]] + [panel.get("description", "")]
        for text in texts:
            assert grafana_variables(text) <= defined, f"{panel['title']}: {grafana_variables(text) - defined}"


def test_dashboard_has_the_panels_the_issue_asks_for(dashboard):
    panels = query_panels(dashboard)

    def panel_using(*fragments):
        return [p for p in panels if all(any(f in t["expr"] for t in p["targets"]) for f in fragments)]

    for metric in ("kvmiss_requests_total", "kvmiss_missed_tokens_total"):
        for dimension in ("label", "owner"):
            assert panel_using(f"sum by ({dimension}) (rate({metric}"), f"{metric} rate by {dimension}"
    assert panel_using("kvmiss_unknown_share", "kvmiss_unknown_budget"), "unknown share vs budget in one panel"
    for metric in ("kvmiss_stream_gaps_total", "kvmiss_stream_unrecoverable_gaps_total", "kvmiss_stream_quarantined",
                   "kvmiss_stream_epoch_changes_total", "kvmiss_stream_batches_applied_total"):
        (panel,) = panel_using(metric)
        assert all("by (worker" in t["expr"] for t in panel["targets"]), f"{metric}: per worker"


def replay_size_defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay_size_cmd.add_arguments(parser)
    return parser.parse_args(["--peak-batches-per-s", "1", "--outage-s", "1"])


def test_dashboard_replay_headroom_states_assumptions_matching_kvmiss_replay_size(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    defaults = replay_size_defaults()
    assert float(variables["buffer_steps"]["query"]) == VLLM_DEFAULT_BUFFER_STEPS
    assert float(variables["catchup_s"]["query"]) == defaults.catchup_s
    assert float(variables["safety_factor"]["query"]) == defaults.safety_factor
    headroom = [p for p in query_panels(dashboard)
                if any("kvmiss_stream_peak_batches_per_second" in t["expr"] and "$buffer_steps" in t["expr"]
                       for t in p["targets"])]
    assert len(headroom) >= 2, "buffer duration and headroom-for-outage panels"
    for panel in headroom:
        description = panel["description"]
        assert "Assumes" in description and "buffer_steps" in description and "resets" in description
    (outage,) = [p for p in headroom if "$outage_s" in p["targets"][0]["expr"]]
    expr = outage["targets"][0]["expr"]
    assert all(v in expr for v in ("$catchup_s", "$safety_factor")), "same rule as kvmiss replay-size"


def test_queries_md_replay_buffer_default_is_vllms():
    replay = [q for q in promql_queries() if "kvmiss_stream_peak_batches_per_second" in q]
    assert replay and all(q.strip().startswith(f"{VLLM_DEFAULT_BUFFER_STEPS} /") for q in replay)
