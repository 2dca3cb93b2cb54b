"""The users x HBM sweep: one replay per cell, the main run reused as its own cell, the
bound below every policy in every cell, each verdict what its ratio says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.predictor.replay.sweep import TIE, Cell


def cell(predictor: float, best: float, bound: float | None = None) -> Cell:
    seconds = {"lru": best, "ttl:60": best * 1.5, "predictor": predictor}
    return Cell(8, 100.0, seconds, {}, bound, "lru")


def test_a_cell_compares_the_predictor_with_its_own_best_baseline() -> None:
    assert cell(90.0, 100.0, bound=60.0).saves == pytest.approx(0.10)
    assert cell(90.0, 100.0, bound=60.0).headroom == pytest.approx(0.40)
    assert cell(90.0, 100.0).verdict == "wins"
    assert cell(100.0 - 100 * TIE / 2, 100.0).verdict == "ties"
    assert cell(101.0, 100.0).verdict == "ties"
    assert cell(110.0, 100.0).verdict == "loses"
    assert cell(90.0, 100.0).headroom is None
    above = Cell(8, 100.0, {"lru": 100.0, "predictor": 90.0}, {}, None, "lru", 60.0)
    assert above.saves_above_floor == pytest.approx(0.25)  # 10 of the 40 above the floor
    no_predictor = Cell(8, 100.0, {"lru": 1.0}, {}, None, "lru")
    assert no_predictor.saves is None and no_predictor.verdict is None


def test_the_sweep_replays_every_cell_and_reuses_the_main_run(
    conversations: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", str(conversations), "--users", "2", "--policy", "lru,predictor,bound"]
    argv += ["--hbm-gb", "20", "--dram-gb", "10", "--ssd-gb", "1000", "--jobs", "1"]
    argv += ["--sweep-users", "1,2", "--sweep-hbm", "10,20", "--json", "--no-progress"]
    argv += ["--plot", str(tmp_path / "plots")]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    cells = report["sweep"]
    assert [(c["users"], c["hbm_gb"]) for c in cells] == [(1, 10), (1, 20), (2, 10), (2, 20)]
    main_cell = cells[3]
    for name in ("lru", "predictor"):
        assert main_cell["gpu_seconds"][name] == report["policies"][name]["gpu_seconds"]
    assert main_cell["bound_gpu_seconds"] == report["policies"]["bound"]["gpu_seconds"]
    for c in cells:
        assert set(c["gpu_seconds"]) == {"lru", "predictor"}
        assert c["best_baseline"] == "lru"
        assert c["bound_gpu_seconds"] <= min(c["gpu_seconds"].values()) + 1e-9
        floor, lru = c["floor_gpu_seconds"], c["gpu_seconds"]["lru"]
        assert 0 < floor <= c["bound_gpu_seconds"]
        above = (lru - c["gpu_seconds"]["predictor"]) / (lru - floor)
        assert c["predictor_saves_above_floor"] == pytest.approx(above)
        saves = 1 - c["gpu_seconds"]["predictor"] / c["gpu_seconds"]["lru"]
        assert c["predictor_saves_vs_best_baseline"] == pytest.approx(saves)
        expected = "wins" if saves >= TIE else "loses" if saves <= -TIE else "ties"
        assert c["verdict"] == expected
    # One user plays the four conversations one after another, two play them at once:
    # the same prompts either way, not the same contention.
    assert len({c["gpu_seconds"]["lru"] for c in cells}) > 1
    assert (tmp_path / "plots" / "sweep.png").stat().st_size > 0


def test_the_sweep_over_users_is_for_conversations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 8, "hash_ids": [1]}\n')
    argv = ["replay", str(trace), "--policy", "lru", "--hbm-gb", "1", "--dram-gb", "1"]
    argv += ["--ssd-gb", "1", "--sweep-users", "2,4", "--no-progress"]
    assert main(argv) == 2
    assert "--sweep-users is for conversations" in capsys.readouterr().err
    argv[-3:] = ["--sweep-hbm", "1,x", "--no-progress"]
    assert main(argv) == 2
    assert "comma-separated numbers" in capsys.readouterr().err


def test_the_cells_share_the_workers_and_give_the_same_numbers(
    conversations: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One policy a cell: the cells themselves run in the two workers, each reporting its
    progress under its own label, and every cell comes out as it does in one process."""
    argv = ["replay", str(conversations), "--users", "2", "--policy", "lru"]
    argv += ["--hbm-gb", "20", "--dram-gb", "10", "--ssd-gb", "1000"]
    argv += ["--sweep-users", "1,2", "--sweep-hbm", "10,20", "--json"]
    cells = {}
    for jobs in ("1", "2"):
        assert main([*argv, "--jobs", jobs]) == 0
        out, err = capsys.readouterr()
        cells[jobs] = json.loads(out)["sweep"]
        assert "lru (1 users, 10 GB) 100%" in err
        assert "lru (2 users, 20 GB)" not in err  # the main run, not replayed again
    assert cells["1"] == cells["2"]
