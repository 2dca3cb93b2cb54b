"""The replay's engine model on hand-built conversations: the closed loop, HBM admission
beside running requests, what making room costs, and the GPU's prefill queue."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.block import encode_block
from kvstore.keys import ChunkKey, Namespace, external_keys
from kvstore.kinds import TierKind
from kvstore.predictor.learning.model import ReturnModel
from kvstore.predictor.placement.baselines import LRUBaseline
from kvstore.predictor.placement.hooks import IdleSession
from kvstore.predictor.replay.config import ReplayConfig
from kvstore.predictor.replay.conversations import Call, Conversation, Stop, Subagents
from kvstore.predictor.replay.costs import (
    Sizing,
    stand_in_capacity,
    stand_in_layout,
)
from kvstore.predictor.replay.engine import Admission, EngineModel, PrefillQueue, StartReported
from kvstore.predictor.replay.parallel import replay
from kvstore.predictor.replay.policies import PolicyKind, PolicySpec, parse_policies
from kvstore.predictor.replay.replay_store import store_config
from kvstore.predictor.replay.results import PolicyResult
from kvstore.predictor.replay.simulator import _Run
from kvstore.predictor.replay.workload import (
    Lane,
    Script,
    Workload,
    compose_arrivals,
    compose_users,
    load_workload,
    nominal_seconds,
)
from kvstore.store.config import CostModel
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.lmdb_tier import LMDBTier
from kvstore.wire.events import Trigger

BLOCK = 512  # tokens a block, one block a chunk
KV = 131072  # bytes of KV a token (Llama-3.1-8B)
CHUNK_GB = BLOCK * KV / 1e9
PREFILL = 17_500.0


def call(
    conversation: str,
    blocks: int,
    *,
    think: float = 0.0,
    api: float = 1.0,
    human: bool = False,
    stop: Stop = Stop.TOOL_USE,
) -> Call:
    return Call(
        blocks=tuple(f"{conversation}/{i}" for i in range(blocks)),
        prompt_tokens=blocks * BLOCK,
        output_tokens=10,
        trigger=Trigger.USER if human else Trigger.TOOL,
        stop=stop,
        think_s=think,
        api_s=api,
    )


def one_user(*scripts: Script) -> Workload:
    return Workload("hand-built", BLOCK, (Lane("user", 0.0, scripts),))


def config(hbm_chunks: float, **changes: object) -> ReplayConfig:
    sizing = Sizing((hbm_chunks + 0.5) * CHUNK_GB, 1000 * CHUNK_GB, 10_000 * CHUNK_GB)
    return dataclasses.replace(ReplayConfig(sizing, horizons=(60.0,)), **changes)  # type: ignore[arg-type]


def run(workload: Workload, policy: str = "lru", **changes: object) -> PolicyResult:
    hbm = changes.pop("hbm_chunks", 100)
    (result,) = replay(workload, parse_policies(policy), config(hbm, **changes))  # type: ignore[arg-type]
    return result


def test_a_call_is_sent_think_s_after_the_response_before_it_as_served() -> None:
    steps = (call("a", 4, human=True), call("a", 6, think=10.0), call("a", 8, think=3.0))
    result = run(one_user(Script("a", "user", steps)))
    first, second, third = result.calls
    assert first.cost.arrival == 0.0
    assert first.end == pytest.approx(first.cost.first_token + 1.0)  # api_s after the token
    assert second.cost.arrival == pytest.approx(first.end + 10.0)
    assert third.cost.arrival == pytest.approx(second.end + 3.0)
    # Each call recomputes only what the one before did not leave cached.
    assert [c.recomputed_tokens for c in result.calls] == [4 * BLOCK, 2 * BLOCK, 2 * BLOCK]
    assert result.hit_tokens + result.recomputed_tokens == result.prompt_tokens == 18 * BLOCK


def test_a_slower_first_response_pushes_every_later_call_later_by_as_much() -> None:
    steps = (call("a", 20, human=True), call("a", 22, think=5.0))
    fast = run(one_user(Script("a", "user", steps)))
    halved = CostModel(recompute_tokens_per_s=PREFILL / 2)
    slow = run(one_user(Script("a", "user", steps)), costs=halved)
    delay = 20 * BLOCK / PREFILL  # the first call's prefill, once more
    assert slow.calls[0].end - fast.calls[0].end == pytest.approx(delay)
    assert slow.calls[1].cost.arrival - fast.calls[1].cost.arrival == pytest.approx(delay)


def test_a_request_waits_until_the_running_ones_leave_it_room_in_hbm() -> None:
    a = Script("a", "u1", (call("a", 6, human=True, api=30.0),))
    b = Script("b", "u2", (call("b", 6, human=True),))
    workload = Workload("two", BLOCK, (Lane("u1", 0.0, (a,)), Lane("u2", 1.0, (b,))))
    result = run(workload, hbm_chunks=10)  # 6 + 6 do not fit
    first, second = sorted(result.calls, key=lambda c: c.cost.arrival)
    assert second.cost.arrival == 1.0
    assert second.cost.admitted == pytest.approx(first.end)  # when a's prompt is unpinned
    assert second.cost.queue_s == pytest.approx(first.end - 1.0)
    assert second.cost.admission_wait_s == pytest.approx(first.end - 1.0)  # all for HBM
    assert second.cost.gpu_wait_s == pytest.approx(0.0)
    assert result.queue_seconds == pytest.approx(first.end - 1.0)
    assert result.admission_wait_seconds == pytest.approx(first.end - 1.0)
    # Without the wait: its own prefill, what placement decides.
    assert result.service_human_s == pytest.approx([c.cost.gpu_s for c in result.calls])
    assert second.cost.ttft_s == pytest.approx(second.cost.queue_s + second.cost.gpu_s)


def test_making_room_writes_idle_kv_back_on_the_requests_clock() -> None:
    a = Script("a", "u1", (call("a", 6, human=True),))
    b = Script("b", "u2", (call("b", 6, human=True),))
    workload = Workload("two", BLOCK, (Lane("u1", 0.0, (a,)), Lane("u2", 100.0, (b,))))
    result = run(workload, hbm_chunks=8)
    first, second = result.calls
    assert first.cost.writeback_s == 0.0  # HBM was empty
    # b needs 6 of 8 chunks: 4 of a's idle chunks go to DRAM, at DRAM's rate.
    dram = CostModel().bytes_per_s(TierKind.DRAM)
    assert second.cost.writeback_s == pytest.approx(4 * BLOCK * KV / dram)
    assert second.cost.queue_s == 0.0
    assert result.gpu_seconds == pytest.approx(12 * BLOCK / PREFILL + second.cost.writeback_s)
    assert result.bytes_moved["dram"]["written"] == pytest.approx(4 * BLOCK * KV)


def test_prefills_wait_for_the_gpu_one_after_another() -> None:
    queue = PrefillQueue()
    assert queue.start(0.0, 2.0) == 0.0
    assert queue.start(1.0, 2.0) == 2.0  # ready at 1 s, the GPU is busy until 2 s
    assert queue.start(10.0, 1.0) == 10.0
    two = PrefillQueue(gpus=2)
    assert [two.start(0.0, 2.0), two.start(0.0, 2.0), two.start(0.0, 2.0)] == [0.0, 0.0, 2.0]
    lanes = tuple(
        Lane(f"u{i}", 0.0, (Script(f"s{i}", f"u{i}", (call(f"s{i}", 35, human=True),)),))
        for i in range(2)
    )
    result = run(Workload("two at once", BLOCK, lanes))
    first, second = result.calls
    assert second.cost.prefill_start == pytest.approx(first.cost.first_token)
    assert second.cost.ttft_s == pytest.approx(2 * 35 * BLOCK / PREFILL)
    assert second.cost.gpu_wait_s == pytest.approx(35 * BLOCK / PREFILL)  # for the GPU
    assert second.cost.admission_wait_s == 0.0


def test_admission_bounds_the_batch_and_lets_an_oversized_prompt_run_alone() -> None:
    admission = Admission(hbm_chunks=10, max_running=2)
    assert admission.fits(10) and admission.fits(11) is not False  # alone, anything runs
    admission.take(4)
    assert admission.fits(6) and not admission.fits(7)
    admission.take(1)
    assert not admission.fits(1)  # the batch is full
    admission.give_back(4)
    admission.give_back(1)
    assert (admission.running, admission.pinned) == (0, 0)
    result = run(one_user(Script("a", "user", (call("a", 12, human=True),))), hbm_chunks=10)
    assert result.requests == 1 and result.calls[0].cost.queue_s == 0.0
    one = run(one_user(Script("a", "user", (call("a", 2),))), engine=EngineModel(max_running=1))
    assert one.requests == 1


def test_subagents_run_as_sessions_of_their_own_and_the_parent_waits_for_the_last() -> None:
    quick = Conversation("p/quick", BLOCK, (call("q", 2, api=1.0),))
    slow = Conversation("p/slow", BLOCK, (call("w", 2, api=5.0), call("w", 3, think=1.0)))
    group = Subagents((quick, slow), think_s=0.5)
    steps = (call("p", 4, human=True), group, call("p", 5, think=2.0))
    result = run(one_user(Script("p", "user", steps)))
    by_session: dict[str, list[float]] = {}
    for record in result.calls:
        by_session.setdefault(record.session, []).append(record.cost.arrival)
    parent = [c for c in result.calls if c.session == "p"]
    children = [c for c in result.calls if c.session != "p"]
    assert by_session["p/quick"] == [pytest.approx(parent[0].end + 0.5)]
    assert by_session["p/slow"][0] == pytest.approx(parent[0].end + 0.5)
    last_child = max(c.end for c in children)
    assert parent[1].cost.arrival == pytest.approx(last_child + 2.0)


def test_users_play_their_conversations_back_to_back_and_the_workload_is_seeded() -> None:
    conversations = [
        Conversation(f"c{i}", BLOCK, (call(f"c{i}", 2, human=True, api=float(i + 1)),))
        for i in range(6)
    ]
    workload = compose_users(conversations, users=2, seed=3)
    assert sorted(s.session for lane in workload.lanes for s in lane.scripts) == [
        f"c{i}" for i in range(6)
    ]
    assert workload == compose_users(conversations, users=2, seed=3)
    assert workload != compose_users(conversations, users=2, seed=4)
    result = run(workload)
    for lane in workload.lanes:
        sessions = [s.session for s in lane.scripts]
        records = [next(c for c in result.calls if c.session == name) for name in sessions]
        for before, after in zip(records, records[1:], strict=False):
            assert after.cost.arrival == pytest.approx(before.end)  # the next one at once
    arrivals = compose_arrivals(conversations, per_hour=60.0, seed=0)
    starts = [lane.start for lane in arrivals.lanes]
    assert starts == sorted(starts) and starts[0] == 0.0 and len(set(starts)) == 6
    assert nominal_seconds(conversations[2].steps) == 3.0


def test_a_closed_loop_replay_is_deterministic_and_every_token_is_accounted() -> None:
    conversations = [
        Conversation(
            f"c{i}",
            BLOCK,
            tuple(call(f"c{i}", 3 + 2 * t, human=t % 2 == 0, think=20.0 * t) for t in range(5)),
        )
        for i in range(8)
    ]
    workload = compose_users(conversations, users=3, seed=0)
    specs = parse_policies("lru,ttl:30,lognormal-tools,predictor,oracle")
    first = replay(workload, specs, config(12))
    second = replay(workload, specs, config(12), jobs=2)  # in worker processes: the same
    assert [result.name for result in second] == [spec.name for spec in specs]  # in order
    for one, other in zip(first, second, strict=True):
        assert one.gpu_seconds == other.gpu_seconds and one.calls == other.calls
        assert one.requests == 40
        assert one.hit_tokens + one.recomputed_tokens == one.prompt_tokens
        assert len(one.ttft_human_s) + len(one.ttft_tool_s) == 40


def test_the_predictor_gives_the_same_numbers_in_and_out_of_worker_processes(
    conversations: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch runs on one thread in both: with two here, sums rounded otherwise, a
    forecast on a threshold flipped, and Mooncake's trace came out 0.8% apart."""
    workload = load_workload([conversations], users=2)
    sized = ReplayConfig(Sizing(20.0, 10.0, 1000.0), chunk_blocks=16)
    threads: set[int] = set()
    predict = ReturnModel.predict

    def counting(model: ReturnModel, features: np.ndarray) -> np.ndarray:
        threads.add(torch.get_num_threads())
        return predict(model, features)

    monkeypatch.setattr(ReturnModel, "predict", counting)
    torch.set_num_threads(2)
    (here,) = replay(workload, parse_policies("predictor"), sized)
    assert threads == {1}
    assert torch.get_num_threads() == 2  # given back as it was
    there, _ = replay(workload, parse_policies("predictor,lru"), sized, jobs=2)
    assert here.gpu_seconds == there.gpu_seconds and here.calls == there.calls
    assert here.quality == there.quality


def _churn(tier: LMDBTier, namespace: Namespace, slots: int, rounds: float) -> None:
    """Write ``rounds`` times ``slots`` stand-in blocks into ``tier``, deleting the oldest
    first whenever the next batch would pass its capacity, as eviction does."""
    payload = memoryview(bytes(namespace.layout.chunk_nbytes))
    held: list[ChunkKey] = []
    written, batch = 0, 256
    while written < rounds * slots:
        keys = external_keys(namespace, list(range(written, written + batch)))
        while held and tier.used_bytes() + batch * (len(payload) + 256) > tier.capacity_bytes():
            tier.delete_many(namespace.digest, held[:batch])
            del held[:batch]
        blocks = [(key, encode_block(namespace, key, None, payload)) for key in keys]
        tier.put_many(namespace.digest, blocks)
        held.extend(keys)
        written += batch


def test_the_ssd_tier_holds_its_slots_of_stand_ins_through_churn(tmp_path: Path) -> None:
    """Sixty thousand 1 KiB stand-ins fill LMDB's first map (sized for blocks of
    megabytes) before they fill the tier's capacity; the tier grows its map within its
    limit and holds them through one and a half turnovers (before it grew, the Mooncake
    replay's SSD tier failed its writes and deletes and served misses)."""
    slots = 60_000
    layout = stand_in_layout(1024)
    namespace = Namespace("replay", layout)
    capacity = stand_in_capacity(TierKind.SSD, slots, layout)
    tier = LMDBTier(tmp_path / "replay", capacity, sync=False)
    _churn(tier, namespace, slots, rounds=1.5)
    assert tier.used_bytes() <= capacity
    tier.close()


class _HeardStarts(LRUBaseline):
    """LRU that notes when each session's start reached it (``on_resume``)."""

    def __init__(self) -> None:
        super().__init__()
        self.resumed: dict[str, float] = {}

    def on_resume(self, store: TieredStore, state: IdleSession, now: float) -> None:
        self.resumed[state.session] = now
        super().on_resume(store, state, now)


@pytest.mark.parametrize("started", list(StartReported))
def test_the_engine_reports_a_start_at_arrival_or_at_admission(
    started: StartReported, tmp_path: Path
) -> None:
    """Two sessions arrive together into a batch of one: the second waits for the first,
    and hears of its own start when it arrives, or only once it is admitted."""
    lanes = tuple(
        Lane(name, 0.0, (Script(name, name, (call(name, 2, human=True, api=5.0),), (0.0,)),))
        for name in ("a", "b")
    )
    workload = Workload("hand-built", BLOCK, lanes)
    replay_config = config(100, engine=EngineModel(max_running=1, started=started))
    policy = _HeardStarts()
    with TieredStore(store_config(replay_config, BLOCK, tmp_path), policy=policy) as store:
        result = _Run(workload, PolicySpec(PolicyKind.LRU), replay_config, store, policy).run(None)
    first, second = sorted(result.calls, key=lambda record: record.cost.admitted)
    assert second.cost.admitted == pytest.approx(first.end) and first.end > 5.0
    assert policy.resumed[first.session] == 0.0
    expected = 0.0 if started is StartReported.ARRIVAL else second.cost.admitted
    assert policy.resumed[second.session] == pytest.approx(expected)


@pytest.mark.parametrize("gpus", [1, 2])
def test_loads_from_dram_share_its_link_one_lane_a_gpu(gpus: int) -> None:
    """a and b (4 chunks each) are pushed to DRAM by c (8), then both come back at once:
    each makes room (4 of c's chunks written back on its own clock) and loads its 4.
    With one GPU they share DRAM's one link, so b's load waits behind a's."""
    scripts = {
        "a": Script("a", "a", (call("a", 4, human=True), call("a", 4, human=True)), (0.0, 200.0)),
        "b": Script("b", "b", (call("b", 4, human=True), call("b", 4, human=True)), (0.0, 200.0)),
        "c": Script("c", "c", (call("c", 8, human=True),), (100.0,)),
    }
    lanes = tuple(Lane(name, 0.0, (script,)) for name, script in scripts.items())
    result = run(
        Workload("hand-built", BLOCK, lanes), hbm_chunks=8, engine=EngineModel(gpus=gpus)
    )
    a, b = sorted((c for c in result.calls if c.cost.arrival == 200.0), key=lambda c: c.session)
    chunk = BLOCK * KV / CostModel().bytes_per_s(TierKind.DRAM)
    assert a.session == "a" and a.hit_tokens == b.hit_tokens == 4 * BLOCK
    assert a.cost.writeback_s == pytest.approx(4 * chunk)
    assert b.cost.writeback_s == pytest.approx(4 * chunk)
    assert a.cost.load_s == pytest.approx(4 * chunk)
    waited = 4 * chunk if gpus == 1 else 0.0  # a's copies end when b's could begin
    assert b.cost.load_s == pytest.approx(4 * chunk + waited)
    assert result.link_wait_seconds == pytest.approx(waited)
    assert result.hit_tokens_by_tier[TierKind.DRAM] == 8 * BLOCK
