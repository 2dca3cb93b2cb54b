"""``docs/configuration.md`` against the code: every setting each table of the file
takes is documented under that table, nothing documented is unknown to the code, and
each documented default is the code's. A new setting cannot go undocumented."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from support import REPO

from kvstore.config import parse_size
from kvstore.kinds import TIERS, TierKind
from kvstore.predictor.config import PredictorConfig
from kvstore.server.config import DaemonConfig
from kvstore.store.config import CostModel, StoreConfig
from kvstore.tiers.registry import TierConfig

DOC = REPO / "docs" / "configuration.md"
# What the file calls a field whose name in the code differs; and fields no file sets.
FILE_NAMES = {"capacity_bytes": "capacity", "map_size_bytes": "map_size"}
NOT_SETTINGS = {"tiers", "costs", "kind"}


def sections() -> dict[str, dict[str, str]]:
    """Each ``## `` section's table rows: setting -> its default cell."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = found.setdefault(line[3:].strip(), {})
        match = re.match(r"\| `([\w<>]+)` \| ([^|]*) \|", line)
        if match:
            current[match.group(1)] = match.group(2).strip()
    return found


def settings(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {
        FILE_NAMES.get(f.name, f.name): f
        for f in dataclasses.fields(cls)
        if f.name not in NOT_SETTINGS
    }


def cost_settings() -> set[str]:
    return {"recompute_tokens_per_s", "kv_bytes_per_token"} | {
        f"{kind.label}_bytes_per_s" for kind in TierKind
    }


TABLES = {
    "Top level (the store)": lambda: set(settings(StoreConfig)),
    "[tiers.&lt;kind&gt;]": lambda: set(settings(TierConfig)),
    "[costs]": cost_settings,
    "[daemon]": lambda: set(settings(DaemonConfig)),
    "[predictor]": lambda: set(settings(PredictorConfig)),
}


@pytest.mark.parametrize("table", list(TABLES))
def test_every_setting_of_a_table_is_documented_and_nothing_else(table: str) -> None:
    documented = set(sections()[table])
    assert documented == TABLES[table]()


def documented_value(cell: str) -> Any:
    """A default cell as a value: ``unset``, a switch, a string, a list, a size, a number."""
    text = cell.strip("`")
    if cell == "unset":
        return None
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"'):
        return text.strip('"')
    if text.startswith("["):
        return tuple(float(item) for item in text.strip("[]").split(",") if item.strip())
    if re.fullmatch(r"\d+\.\d+", text):
        return float(text)
    return parse_size(text)


@pytest.mark.parametrize("cls", [StoreConfig, TierConfig, DaemonConfig, PredictorConfig])
def test_each_plain_default_is_the_code_s(cls: type) -> None:
    """Defaults that are one literal (not a path, not per kind) read as the code's."""
    table = next(name for name, read in TABLES.items() if read() == set(settings(cls)))
    cells = sections()[table]
    for name, field in settings(cls).items():
        cell = cells[name]
        literal = re.fullmatch(r"`[^`<]*`|unset", cell)
        if field.default is dataclasses.MISSING or not literal:
            continue  # a factory, a path under data_dir, or a default per kind
        assert documented_value(cell) == field.default, name
    if cls is PredictorConfig:
        horizons = documented_value(cells["horizons_s"])
        assert horizons == PredictorConfig().horizons_s


def test_the_cost_and_capacity_defaults_are_the_tier_kinds() -> None:
    cells = sections()
    for kind, traits in TIERS.items():
        rate = cells["[costs]"][f"{kind.label}_bytes_per_s"]
        assert documented_value(rate) == traits.reload_bytes_per_s
        capacity = cells["[tiers.&lt;kind&gt;]"]["capacity"]
        if traits.default_capacity is not None:
            assert f"{kind.label} `{traits.default_capacity}`" in capacity
    assert documented_value(cells["[costs]"]["recompute_tokens_per_s"]) == (
        CostModel().recompute_tokens_per_s
    )


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    sources = [
        path.read_text(encoding="utf-8")
        for root in ("kvstore", "tiers", "predictor", "client")
        for path in (REPO / root).rglob("*.py")
    ]
    named = {
        variable
        for source in sources
        for variable in re.findall(r'"(KVSTORE_[A-Z_]+)"', source)
    }
    prefixes = {variable for variable in named if variable.endswith("_")}
    for variable in named - prefixes:
        assert f"`{variable}`" in text, variable
    for prefix in prefixes - {"KVSTORE_"}:
        assert f"`{prefix}<FIELD>`" in text, prefix
