"""Stateful property test: whatever the store does, ``get`` returns exactly what was
``put`` under that key, or a miss. Never a wrong block."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import kv

from kvstore import ChunkKey, TieredStore

CHAINS = 5
MAX_CHUNKS = 6


def chain_tokens(chain: int, n_chunks: int):
    """Chain 0 is the trunk; chain c shares its first c chunks with the trunk."""
    trunk = kv.tokens(MAX_CHUNKS)
    own = kv.tokens(MAX_CHUNKS, start=1_000_000 * (chain + 1))
    shared = min(chain, n_chunks) * kv.LAYOUT.chunk_tokens
    full = n_chunks * kv.LAYOUT.chunk_tokens
    return torch.cat([torch.from_numpy(trunk[:shared]), torch.from_numpy(own[shared:full])])


def chain_data(chain: int, n_chunks: int) -> list[torch.Tensor]:
    trunk = kv.chunks(MAX_CHUNKS, seed=0)
    own = kv.chunks(MAX_CHUNKS, seed=chain + 1)
    return [trunk[i] if i < chain else own[i] for i in range(n_chunks)]


class StoreModel(RuleBasedStateMachine):
    """Tiers small enough that every rule moves blocks: HBM 2, DRAM 3, LMDB ~8 blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvstore-model-"))
        self.config = kv.config(
            kv.hbm(2), kv.dram(3), kv.ssd(self.directory / "lmdb", capacity=8 * 2176)
        )
        self.store = TieredStore(self.config)
        self.ns = kv.namespace()
        self.expected: dict[ChunkKey, torch.Tensor] = {}
        self.reads = 0

    def keys(self, chain: int, n_chunks: int = MAX_CHUNKS) -> list[ChunkKey]:
        return self.store.keys_for(self.ns, chain_tokens(chain, n_chunks))

    @rule(chain=st.integers(0, CHAINS - 1), n_chunks=st.integers(1, MAX_CHUNKS))
    def put(self, chain: int, n_chunks: int) -> None:
        data = chain_data(chain, n_chunks)
        self.store.put(self.ns, chain_tokens(chain, n_chunks), data)
        for key, tensor in zip(self.keys(chain, n_chunks), data, strict=True):
            self.expected[key] = tensor

    @rule(chain=st.integers(0, CHAINS - 1))
    def get(self, chain: int) -> None:
        keys = self.keys(chain)
        for key, chunk in zip(keys, self.store.get(self.ns, keys), strict=True):
            if chunk is not None:
                self.reads += 1
                assert key in self.expected, "a key never put was served"
                assert torch.equal(chunk.tensor(), self.expected[key]), "wrong block served"

    @rule(chain=st.integers(0, CHAINS - 1))
    def lookup_then_get(self, chain: int) -> None:
        prefix = self.store.lookup(self.ns, chain_tokens(chain, MAX_CHUNKS))
        assert set(prefix.keys) <= set(self.expected)
        # Single caller: what lookup reports cached, get serves, byte for byte.
        chunks = self.store.get(self.ns, list(prefix.keys))
        for key, chunk in zip(prefix.keys, chunks, strict=True):
            assert chunk is not None
            assert torch.equal(chunk.tensor(), self.expected[key])

    @rule(chain=st.integers(0, CHAINS - 1), start=st.integers(0, MAX_CHUNKS - 1))
    def demote(self, chain: int, start: int) -> None:
        self.store.demote(self.ns, self.keys(chain)[start:])

    @rule(chain=st.integers(0, CHAINS - 1))
    def promote(self, chain: int) -> None:
        self.store.promote(self.ns, self.keys(chain))

    @rule(chain=st.integers(0, CHAINS - 1), index=st.integers(0, MAX_CHUNKS - 1))
    def delete(self, chain: int, index: int) -> None:
        key = self.keys(chain)[index]
        self.store.delete(self.ns, [key])
        assert self.store.get(self.ns, [key]) == [None]

    @precondition(lambda self: bool(self.expected))
    @rule()
    def reopen(self) -> None:
        """HBM and DRAM are lost on restart; LMDB keeps what it held."""
        self.store.close()
        self.store = TieredStore(self.config)

    @invariant()
    def within_capacity(self) -> None:
        for kind, counters in self.store.stats().tiers.items():
            assert counters.used_bytes <= counters.capacity_bytes, kind

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)


StoreModel.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreModel = StoreModel.TestCase
