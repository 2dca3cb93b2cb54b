"""``bench/cluster.py --quick`` end to end: a real 3-master cluster, two daemons sharing
it, and the JSON the issue's figures are read from. No timing thresholds: the figures
must be there and sane, and the Redis commands of each kind of call exactly what the
shared tier's design says."""

from __future__ import annotations

import json
import math

import cluster
import pytest


@pytest.mark.cluster
@pytest.mark.slow
def test_quick_run_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    cluster.main(["--quick", "--json"])
    report = json.loads(capsys.readouterr().out)
    config = report["config"]
    assert (config["mode"], config["daemons"], config["redis_masters"]) == ("quick", 2, 3)

    chain_bytes = config["chain_chunks"] * config["chunk_bytes"]
    throughput = {row["op"]: row for row in report["throughput"]}
    assert sorted(throughput) == ["get", "get_bytes", "put"]
    for row in throughput.values():
        assert row["bytes"] == config["daemons"] * chain_bytes
        assert 0 < row["ratio"] < math.inf and row["ratio"] == pytest.approx(
            row["gbps"] / row["raw_gbps"], rel=1e-2
        )
    assert throughput["put"]["put_returned_ms"] > 0

    visibility = report["cross_host"]
    assert sorted(visibility) == ["after_landing", "looked_before", "polling"]
    for figures in visibility.values():
        assert figures["samples"] == config["visibility_samples"]
        # B's full hit never comes before every block is in Redis.
        assert 0 < figures["landed"]["p50_ms"] <= figures["hit"]["p50_ms"]
    # B looks only once the copy landed: its one lookup finds the whole chain.
    assert visibility["after_landing"]["first_lookup_found_median"] == config["chain_chunks"]
    assert visibility["after_landing"]["lookups_median"] == 1

    lookups = report["lookup"]
    assert sorted(lookups) == sorted(
        [
            "local",
            "absent_first",
            "absent_again",
            "held_first",
            "held_again",
            "no_shared_tier",
            "raw_exists",
        ]
    )
    assert all(case["samples"] == config["lookup_samples"] for case in lookups.values())
    assert all(case["p50_ms"] > 0 for case in lookups.values())

    chunks = config["lookup_chunks"]
    commands = report["redis_commands"]
    exists = {name: counts["exists"] for name, counts in commands.items()}
    # One EXISTS per key the local index cannot place; none for a miss within the
    # negative cache's window; a Redis-only chain is asked about every time.
    assert exists["lookup_local"] == 0
    assert exists["lookup_absent_first"] == chunks
    assert exists["lookup_absent_again"] == 0
    assert exists["lookup_held_first"] == exists["lookup_held_again"] == chunks
    for name in ("get_shm_client_held", "get_bytes_client_held"):
        assert commands[name]["get"] == chunks and commands[name]["set"] == 0
        assert exists[name] >= chunks
