"""A system prompt every session shares, at the scale of the kv-cache-tester set (425
sessions): no session going idle takes it down while another chain in the tier extends it."""

from __future__ import annotations

from pathlib import Path

from support import kv
from support.sessions import Sessions, opened

from kvstore import TierKind
from kvstore.predictor.learning.model import DEFAULT_HORIZONS
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.placement.policy import PlacementConfig, PlacementPolicy

HBM = TierKind.HBM
SESSIONS = 425  # the conversations of kv-cache-tester
PREFIX = 8  # chunks of the shared system prompt and tools


def _forecast(session: str, at: float, likely: bool) -> ReturnForecast:
    chances = (0.6, 0.9, 0.95) if likely else (0.01, 0.03, 0.08)
    return ReturnForecast(session, at, DEFAULT_HORIZONS, chances)


def _chains_in_hbm_keep_their_prefix(run: Sessions, firsts: list) -> int:
    """Every session chain whose first own block is in HBM finds the prefix there too;
    how many such chains there are."""
    held = [kind is HBM for kind in run.store.locate(run.ns, firsts)]
    if any(held):
        assert run.store.locate(run.ns, run.shared_keys(PREFIX)) == [HBM] * PREFIX
    return sum(held)


def test_no_session_going_idle_demotes_the_prompt_every_session_shares(tmp_path: Path) -> None:
    policy = PlacementPolicy(PlacementConfig(check_min_s=10.0, check_fraction=0.0))
    run = opened(policy, kv.hbm(48), kv.dram(160), kv.ssd(tmp_path / "lmdb", 256 << 20))
    firsts = []  # each session's first block after the prefix
    extended = 0
    with run.store:
        for i in range(SESSIONS):
            now = 5.0 * i
            name = f"s{i}"
            # Every third session is likely back soon: it should keep its chain fast.
            state = run.request(name, 10_000 * (i + 1), 1 + i % 4, now, shared=PREFIX)
            firsts.append(state.chain[PREFIX])
            policy.on_idle(run.store, state, _forecast(name, now + 1, i % 3 == 0), now + 1)
            extended = max(extended, _chains_in_hbm_keep_their_prefix(run, firsts))
            if i >= 10 and i % 5 == 0:  # an earlier session returns, one chunk longer
                back = i - 10
                again = run.request(
                    f"s{back}", 10_000 * (back + 1), 2 + back % 4, now + 2, shared=PREFIX
                )
                policy.on_idle(run.store, again, _forecast(again.session, now + 3, False), now + 3)
                extended = max(extended, _chains_in_hbm_keep_their_prefix(run, firsts))
            policy.tick(run.store, now + 4)
            extended = max(extended, _chains_in_hbm_keep_their_prefix(run, firsts))
        # The scenario pressed HBM: idle chains were demoted, unlikely ones first, and the
        # session that touched the prefix last was as often unlikely as not.
        assert policy.demoted > SESSIONS
        assert run.store.stats().tier(HBM).blocks <= 48
        assert extended > 1
