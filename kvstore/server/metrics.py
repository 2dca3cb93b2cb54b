"""Prometheus metrics of one daemon, in a registry of its own.

Not the process-wide default registry: a test (or a process) can run several
apps side by side, and each scrapes only its own numbers.

Two sources:

* HTTP traffic and client reports are counted as they happen
  (``DaemonMetrics``): requests by route and status, latency by route,
  session events (and those refused, by reason), and the tokens clients
  loaded from cache versus recomputed.
* The store's own counters are read at scrape time (``StoreCollector``), from
  one ``TieredStore.stats()`` snapshot, so they are never out of step with
  ``/v1/stats`` and nothing has to mirror them::

      kvstore_tier_hits_total{tier}            chunks served by each tier
      kvstore_chunk_misses_total               chunks asked for and not found
      kvstore_tier_used_bytes{tier}            ... and capacity, blocks, bytes
      kvstore_tier_evictions_total{tier}       dropped for good from the last tier
      kvstore_tier_demotions_total{tier}       written back to the next tier down
      kvstore_tier_promotions_total{tier}      copied up from this tier
      kvstore_tier_corrupt_blocks_total{tier}  failed verification, purged
      kvstore_tier_writebacks_failed_total{tier}  kept: the copy down failed
      kvstore_tier_down{tier}                  1 while its breaker answers for it
      kvstore_leases_outstanding               shared-memory leases not yet released

A miss has no tier (it is a miss in all of them), so misses are one counter.

* The predictor's numbers are read at scrape time too (``PredictorCollector``,
  from ``PredictorService.snapshot``), so they match ``/v1/stats``::

      kvstore_predictor_auc{horizon,model}        prequential AUC, Brier score and log
      kvstore_predictor_brier{horizon,model}      loss per horizon (seconds) of the model
      kvstore_predictor_log_loss{horizon,model}   (model="predictor") and of the two
                                                  baselines ("base_rate", "last_gap")
      kvstore_predictor_labels_total{horizon}     labels scored so far
      kvstore_predictor_prefetches_total{outcome} issued, used, wasted
      kvstore_predictor_placements_total{tier}    idle sessions kept in each tier ("none":
                                                  no chain to place)
      kvstore_predictor_demoted_chunks_total      chunks moved down by idle placement
      kvstore_predictor_events_total{outcome}     processed, dropped (queue full), failed
      kvstore_predictor_idle_sessions             sessions idle now

  A score not defined yet (AUC before both labels were seen) is left out
  rather than exported as NaN.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.predictor.service import PredictorService
from kvstore.server.leases import LeaseTable
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import RequestFinished, SessionEvent

# Latency buckets from a cached lookup (sub-millisecond) to a large put (seconds).
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# (metric suffix, TierCounters field, help) of the per-tier counters.
_TIER_COUNTERS = (
    ("hits", "hits", "Chunks served by the tier."),
    ("bytes_read", "bytes_read", "Stored bytes read from the tier."),
    ("bytes_written", "bytes_written", "Stored bytes written to the tier."),
    ("evictions", "evictions", "Blocks dropped from the tier with no copy below."),
    ("demotions", "demotions", "Blocks written back from the tier to the next one down."),
    ("promotions", "promotions", "Blocks copied up from the tier to a faster one."),
    ("corrupt_blocks", "corrupt_blocks", "Blocks of the tier that failed verification."),
    ("errors", "errors", "Backend errors of the tier (each cost a miss)."),
    (
        "writebacks_failed",
        "writebacks_failed",
        "Victims kept in the tier because their write-back to a slower tier failed.",
    ),
    ("calls_refused", "calls_refused", "Calls answered without the backend: it was down."),
    ("breaker_trips", "breaker_trips", "Times a failure of the tier opened its breaker."),
    (
        "write_through_written",
        "write_through_written",
        "Blocks a put stored locally that were then copied to this shared tier.",
    ),
    (
        "write_through_dropped",
        "write_through_dropped",
        "Blocks not copied to this shared tier: its write-through queue was full.",
    ),
    (
        "write_through_failed",
        "write_through_failed",
        "Blocks this shared tier refused or failed to store on their write-through.",
    ),
)
_TIER_GAUGES = (
    ("used_bytes", "used_bytes", "Stored bytes the tier holds."),
    ("capacity_bytes", "capacity_bytes", "Configured capacity of the tier."),
    ("blocks", "blocks", "Blocks the tier holds."),
    ("down", "down", "1 while the tier's breaker is open (calls answered as misses)."),
    (
        "write_through_pending",
        "write_through_pending",
        "Blocks queued for their write-through copy to this shared tier, or on their way.",
    ),
)
# (metric name, StoreStats field, help) of the store-wide counters.
_STORE_COUNTERS = (
    ("kvstore_lookups", "lookups", "Lookups served."),
    ("kvstore_lookup_tokens", "lookup_tokens", "Tokens asked about in lookups."),
    ("kvstore_lookup_hit_tokens", "lookup_hit_tokens", "Tokens lookups found cached."),
    ("kvstore_gets", "gets", "Get requests served."),
    ("kvstore_chunk_misses", "get_misses", "Chunks asked for by a get and not found."),
    ("kvstore_puts", "puts", "Put requests served."),
    ("kvstore_chunks_stored", "chunks_stored", "Chunks newly stored by puts."),
    ("kvstore_puts_dropped", "puts_dropped", "Chunks a put could not place in any tier."),
    (
        "kvstore_namespaces_forgotten",
        "namespaces_forgotten",
        "Namespaces a full table forgot (least recently named first; clients re-register).",
    ),
)


class EventRejection(enum.Enum):
    """Why ``POST /v1/events`` refused an event (the ``reason`` label)."""

    INVALID = "invalid"  # not JSON, or not an event of the schema
    CLOCK_SKEW = "clock_skew"  # its time is too far from the daemon's clock


class StoreCollector(Collector):
    """Reads the store's counters and the lease table at scrape time."""

    def __init__(self, store: TieredStore, leases: LeaseTable) -> None:
        self._store = store
        self._leases = leases

    def collect(self) -> Iterable[Metric]:
        stats = self._store.stats()
        for suffix, attribute, text in _TIER_COUNTERS:
            counter = CounterMetricFamily(f"kvstore_tier_{suffix}", text, labels=["tier"])
            for kind, counters in sorted(stats.tiers.items()):
                counter.add_metric([kind.label], getattr(counters, attribute))
            yield counter
        for suffix, attribute, text in _TIER_GAUGES:
            gauge = GaugeMetricFamily(f"kvstore_tier_{suffix}", text, labels=["tier"])
            for kind, counters in sorted(stats.tiers.items()):
                gauge.add_metric([kind.label], getattr(counters, attribute))
            yield gauge
        for name, attribute, text in _STORE_COUNTERS:
            yield CounterMetricFamily(name, text, value=getattr(stats, attribute))
        yield GaugeMetricFamily(
            "kvstore_leases_outstanding",
            "Shared-memory leases granted and not yet released or expired.",
            value=len(self._leases),
        )
        yield GaugeMetricFamily(
            "kvstore_leased_blocks",
            "DRAM blocks pinned by outstanding leases.",
            value=self._leases.pinned_blocks,
        )


class PredictorCollector(Collector):
    """Reads the predictor's scores and counters at scrape time."""

    def __init__(self, predictor: PredictorService) -> None:
        self._predictor = predictor

    def collect(self) -> Iterable[Metric]:
        snapshot = self._predictor.snapshot()
        scores = {
            metric: GaugeMetricFamily(
                f"kvstore_predictor_{metric}",
                f"Prequential {text} of the return forecasts, by horizon (s) and model.",
                labels=["horizon", "model"],
            )
            for metric, text in (("auc", "AUC"), ("brier", "Brier score"), ("log_loss", "log loss"))
        }
        labels = CounterMetricFamily(
            "kvstore_predictor_labels", "Return labels scored, by horizon (s).", labels=["horizon"]
        )
        for horizon, quality in snapshot["quality"].items():
            labels.add_metric([horizon], quality["n"])
            for model in ("predictor", "base_rate", "last_gap"):
                for metric, family in scores.items():
                    value = quality[model][metric]
                    if value is not None:
                        family.add_metric([horizon, model], value)
        yield from scores.values()
        yield labels
        prefetches = CounterMetricFamily(
            "kvstore_predictor_prefetches",
            "Chunks promoted ahead of a lookup, and whether they were read there.",
            labels=["outcome"],
        )
        for outcome in ("issued", "used", "wasted"):
            prefetches.add_metric([outcome], snapshot["prefetches"][outcome])
        yield prefetches
        placements = CounterMetricFamily(
            "kvstore_predictor_placements",
            "Idle sessions by the tier their chain was kept in.",
            labels=["tier"],
        )
        for tier, count in sorted(snapshot["placements"].items()):
            placements.add_metric([tier], count)
        yield placements
        yield CounterMetricFamily(
            "kvstore_predictor_demoted_chunks",
            "Chunks moved down by idle placement (not by capacity pressure).",
            value=snapshot["demoted_chunks"],
        )
        events = CounterMetricFamily(
            "kvstore_predictor_events",
            "Session events, by what became of them.",
            labels=["outcome"],
        )
        for outcome in ("processed", "dropped", "failed"):
            events.add_metric([outcome], snapshot[f"events_{outcome}"])
        yield events
        yield GaugeMetricFamily(
            "kvstore_predictor_idle_sessions", "Sessions idle now.", value=snapshot["idle_sessions"]
        )


class DaemonMetrics:
    """The registry of one app and the metrics counted as requests arrive."""

    def __init__(
        self, store: TieredStore, leases: LeaseTable, predictor: PredictorService | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstore_http_requests",
            "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvstore_http_request_duration_seconds",
            "Time from request to the end of the response, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.events = Counter(
            "kvstore_client_events",
            "Session events reported by clients, by event.",
            ["event"],
            registry=self.registry,
        )
        self.events_rejected = Counter(
            "kvstore_client_events_rejected",
            "Session events refused (400), by why: malformed, or timed off the daemon's clock.",
            ["reason"],
            registry=self.registry,
        )
        for reason in EventRejection:
            self.events_rejected.labels(reason=reason.value)
        self.client_tokens = Counter(
            "kvstore_client_tokens",
            "Prompt tokens clients loaded from the cache or recomputed, as they report.",
            ["source"],
            registry=self.registry,
        )
        # Export both label values from the first scrape, before any report.
        self.client_tokens.labels(source="cache")
        self.client_tokens.labels(source="recompute")
        self.registry.register(StoreCollector(store, leases))
        if predictor is not None:
            self.registry.register(PredictorCollector(predictor))

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def reject_event(self, reason: EventRejection) -> None:
        self.events_rejected.labels(reason=reason.value).inc()

    def observe_event(self, event: SessionEvent) -> None:
        self.events.labels(event=event.kind.value).inc()
        if isinstance(event, RequestFinished):
            self.client_tokens.labels(source="cache").inc(event.loaded_tokens)
            self.client_tokens.labels(source="recompute").inc(event.recomputed_tokens)
