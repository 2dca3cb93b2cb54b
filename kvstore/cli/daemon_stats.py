"""``kvstore stats``: a daemon's ``/v1/stats`` as tables.

The predictor's quality is printed per horizon beside its two baselines.
"""

from __future__ import annotations

from typing import Any

from kvstore.cli.tables import duration, human_bytes, score, table


def format_stats(data: dict[str, Any]) -> str:
    """A human-readable table of a ``/v1/stats`` answer."""
    daemon = data.get("daemon", {})
    store = data.get("store", {})
    lines = [
        f"kvstore daemon  pid {daemon.get('pid')}  up {duration(daemon.get('uptime_s', 0))}"
        f"  requests {daemon.get('requests_served', 0)}"
        f"  leases {daemon.get('leases_outstanding', 0)}"
        f" ({daemon.get('leased_blocks', 0)} blocks)",
        "listening: " + ", ".join(daemon.get("listening", [])),
    ]
    prefault = daemon.get("dram_prefault")
    if prefault:
        state = "done" if prefault.get("done") else "in progress"
        populated = human_bytes(prefault.get("populated_bytes", 0))
        lines.append(f"DRAM arena prefault: {populated} populated ({state})")
    lines.append("")
    columns = [
        ("tier", None),
        ("blocks", "blocks"),
        ("used", "used_bytes"),
        ("capacity", "capacity_bytes"),
        ("hits", "hits"),
        ("read", "bytes_read"),
        ("written", "bytes_written"),
        ("demoted", "demotions"),
        ("evicted", "evictions"),
        ("promoted", "promotions"),
        ("corrupt", "corrupt_blocks"),
        ("errors", "errors"),
        ("kept", "writebacks_failed"),
    ]
    rows = [[name for name, _ in columns]]
    for tier, counters in store.get("tiers", {}).items():
        row = [tier]
        for _, field in columns[1:]:
            value = counters.get(field, 0)
            row.append(human_bytes(value) if field and "bytes" in field else str(value))
        rows.append(row)
    lines += table(rows)
    asked = store.get("lookup_tokens", 0)
    hit = store.get("lookup_hit_tokens", 0)
    rate = f"{100 * hit / asked:.1f}%" if asked else "-"
    lines += [
        "",
        f"lookups {store.get('lookups', 0)}  tokens {asked}  cached {hit} ({rate})",
        f"gets {store.get('gets', 0)}  chunk misses {store.get('get_misses', 0)}"
        f"  puts {store.get('puts', 0)}  chunks stored {store.get('chunks_stored', 0)}"
        f"  dropped {store.get('puts_dropped', 0)}",
    ]
    predictor = data.get("predictor")
    if predictor:
        lines += ["", *format_predictor(predictor)]
    return "\n".join(lines)


def format_predictor(predictor: dict[str, Any]) -> list[str]:
    """The predictor's part of ``kvstore stats``: counters, then quality per horizon
    with the two baselines beside the model (``-`` where a score is not defined yet)."""
    if not predictor.get("enabled"):
        return ["predictor disabled"]
    model = predictor.get("model", {})
    prefetches = predictor.get("prefetches", {})
    placements = predictor.get("placements", {})
    learnt = (
        f"model {model.get('source')}"  # loading: the daemon listens before it loads it
        if model.get("features") is None
        else f"model from {model.get('source')} ({model.get('features')} features)"
    )
    lines = [
        f"predictor  {learnt}"
        f"  events {predictor.get('events_processed', 0)}"
        f" (dropped {predictor.get('events_dropped', 0)})"
        f"  idle sessions {predictor.get('idle_sessions', 0)}",
        f"prefetches issued {prefetches.get('issued', 0)}  used {prefetches.get('used', 0)}"
        f"  wasted {prefetches.get('wasted', 0)}  idle placements "
        + (", ".join(f"{tier} {n}" for tier, n in sorted(placements.items())) or "-")
        + f"  demoted {predictor.get('demoted_chunks', 0)} chunks",
    ]
    quality = predictor.get("quality", {})
    if not quality:
        return lines
    rows = [["horizon", "labels", "returned", "AUC", "Brier", "log loss"]]
    for horizon, entry in quality.items():
        rows.append(
            [
                f"{horizon} s",
                str(entry.get("n", 0)),
                score(entry.get("positive_rate")),
                *(_scores(entry, metric) for metric in ("auc", "brier", "log_loss")),
            ]
        )
    lines += ["", "quality: predictor / base rate / last gap short", *table(rows)]
    return lines


def _scores(entry: dict[str, Any], metric: str) -> str:
    return "/".join(
        score(entry.get(model, {}).get(metric)) for model in ("predictor", "base_rate", "last_gap")
    )
