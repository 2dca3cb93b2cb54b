"""The Grafana dashboard and the Prometheus alert rules in ``deploy/`` ask only for
series a real daemon exports.

A panel or an alert on a series nobody exports fails silently: the panel shows "no
data" and the alert never fires, so a renamed metric would leave both behind with no
error anywhere. Every PromQL expression of both files is therefore read for the
series names it selects, and each is looked up among the samples of a real daemon's
``/metrics`` after traffic that makes every family appear. Samples, not families:
PromQL selects ``kvstore_tier_hits_total`` and ``..._seconds_bucket``, never the
family name the exposition's ``# TYPE`` line gives. A series under ``rate`` or
``increase`` must be a counter's or a histogram's (a gauge's rate means nothing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import REPO, kv
from support.daemon import Daemon
from support.http_kv import get_bytes, lookup, make_chain, put, register
from support.predictor_events import OWN_CLOCK, post, processed, returning_sessions, stats

DASHBOARD = REPO / "deploy" / "grafana" / "kvstore.json"
ALERTS = REPO / "deploy" / "prometheus" / "kvstore-alerts.yml"
PROMETHEUS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
ALERT_NAMES = [
    "KVStoreTierFull",
    "KVStorePutsDropped",
    "KVStoreTierDown",
    "KVStoreCorruptBlocks",
    "KVStorePredictorAUCBelowBaseline",
    "KVStorePredictorBrierAboveBaseline",
    "KVStorePredictorEventsDropped",
]
ROWS = [
    "Tiers",
    "Breakers and degraded tiers",
    "Requests",
    "Integrity and data movement",
    "Predictor",
]

# What is not a series name: strings, label matchers, ranges and subqueries, the label
# lists of grouping and matching modifiers, and the bare keywords of PromQL.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"bool", "offset", "and", "or", "unless", "inf", "nan"}
# A name not inside a number (1e3), a duration (5m) or a Grafana variable ($instance).
_NAME = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")
_RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][\w:]*)")
_LABEL_VALUES = re.compile(r"label_values\(([A-Za-z_:][\w:]*),\s*\w+\)")


def _selectors_only(expr: str) -> str:
    for pattern in (_STRING, _MATCHERS, _RANGE, _LABEL_LIST):
        expr = pattern.sub(" ", expr)
    return expr


def metric_names(expr: str) -> set[str]:
    """The series names ``expr`` selects: identifiers that are not a call's name
    (functions, aggregations) nor a keyword."""
    expr = _selectors_only(expr)
    names: set[str] = set()
    for match in _NAME.finditer(expr):
        called = expr[match.end() :].lstrip().startswith("(")
        if not called and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def rated_names(expr: str) -> set[str]:
    """The series names ``expr`` takes a ``rate``, ``irate`` or ``increase`` of."""
    return set(_RATED.findall(_selectors_only(expr)))


def expressions() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query of the dashboard and every alert rule."""
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # Grafana's label_values(metric, label), not PromQL
            match = _LABEL_VALUES.fullmatch(variable["query"]["query"])
            assert match is not None, variable
            yield f"variable {variable['name']}", match.group(1)
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for rule in alert_rules():
        yield f"alert {rule['alert']}", rule["expr"]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_metric_names_reads_selectors_not_functions_labels_or_variables() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (route, le) "
        '(rate(a_bucket{route=~"$r"}[$__rate_interval])))'
        " / ignoring(tier) group_left () increase(b_total[5m] offset 1h) > bool 1e3"
        ' and on(instance) c{model="last_gap"} unless max_over_time(d[1h:5m])'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
    assert rated_names(expr) == {"a_bucket", "b_total"}


def test_the_dashboard_reads_one_prometheus_input_in_every_panel() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [entry["name"] for entry in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ROWS
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert len(panels) == 26
    for panel in panels:
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert panel["datasource"] == PROMETHEUS, panel["title"]
        assert all(target["datasource"] == PROMETHEUS for target in panel["targets"])


def test_the_alert_rules_parse_and_name_each_alert() -> None:
    rules = alert_rules()
    assert [rule["alert"] for rule in rules] == ALERT_NAMES
    for rule in rules:
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]


def test_every_series_the_dashboard_and_the_alerts_ask_for_is_exported(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Traffic on every route the dashboard graphs, and a predictor stream that labels
    every horizon with both outcomes, so that each score of each model is defined."""
    daemon = daemon_factory(daemon=OWN_CLOCK)
    ns = kv.namespace(salt="dashboards")
    chain = make_chain(ns, 4)
    events = returning_sessions()
    with daemon.client() as client:
        register(client, ns)
        assert put(client, chain) == 4
        assert lookup(client, ns, chain.keys)["num_chunks"] == 4
        assert get_bytes(client, ns, chain.keys)[1] == chain.blocks
        post(client, *events)
        stats(client, processed(len(events)))
        exposition = client.get("/metrics").text
    kinds = {
        sample.name: family.type
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }
    asked = 0
    for where, expr in expressions():
        names = metric_names(expr)
        assert names, where
        assert not names - kinds.keys(), (where, sorted(names - kinds.keys()))
        for name in rated_names(expr):
            assert kinds[name] in {"counter", "histogram"}, (where, name, kinds[name])
        asked += 1
    assert asked == 1 + 47 + len(ALERT_NAMES)  # the instance variable, the targets, the alerts
