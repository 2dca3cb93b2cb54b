"""ExtentAllocator: page rounding, best fit, merging, and invariants under churn."""

from __future__ import annotations

import random

import pytest

from kvstore.tiers.extents import PAGE_BYTES, ExtentAllocator, round_up

P = PAGE_BYTES


def check_invariants(allocator: ExtentAllocator, live: dict[int, int]) -> None:
    """``live`` maps offset -> extent size as the caller saw it allocated."""
    spans = sorted(live.items())
    for (offset, size), (next_offset, _) in zip(spans, spans[1:], strict=False):
        assert offset + size <= next_offset, "live extents overlap"
    for offset, size in spans:
        assert offset % allocator.page == 0
        assert size % allocator.page == 0
        assert offset >= 0 and offset + size <= allocator.capacity
    assert allocator.used_bytes == sum(live.values())
    free = sum(allocator._free_lengths.values())
    assert free + allocator.used_bytes == allocator.capacity
    # Free extents are sorted, disjoint from each other and from live extents, and
    # no two free extents touch (they would have been merged).
    free_spans = [(o, allocator._free_lengths[o]) for o in allocator._free_offsets]
    assert allocator._free_offsets == sorted(allocator._free_lengths)
    for (offset, size), (next_offset, _) in zip(free_spans, free_spans[1:], strict=False):
        assert offset + size < next_offset, "adjacent free extents were not merged"
    covered = sorted(spans + free_spans)
    position = 0
    for offset, size in covered:
        assert offset == position, "a byte range is neither free nor live"
        position = offset + size
    assert position == allocator.capacity
    assert allocator.largest_free == max((size for _, size in free_spans), default=0)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(0, 0), (1, P), (P - 1, P), (P, P), (P + 1, 2 * P), (10 * P, 10 * P)],
)
def test_round_up(nbytes: int, expected: int) -> None:
    assert round_up(nbytes) == expected
    assert round_up(nbytes, 512) == -(-nbytes // 512) * 512


def test_fresh_allocator() -> None:
    allocator = ExtentAllocator(10 * P)
    assert allocator.capacity == 10 * P
    assert allocator.used_bytes == 0
    assert allocator.largest_free == 10 * P


def test_capacity_is_rounded_down_to_whole_pages() -> None:
    allocator = ExtentAllocator(3 * P + 100)
    assert allocator.capacity == 3 * P
    assert allocator.allocate(3 * P) == 0
    assert allocator.allocate(1) is None


def test_capacity_below_one_page_holds_nothing() -> None:
    allocator = ExtentAllocator(P - 1)
    assert allocator.capacity == 0
    assert allocator.largest_free == 0
    assert allocator.allocate(1) is None
    assert ExtentAllocator(0).allocate(0) is None


@pytest.mark.parametrize(("nbytes", "pages"), [(0, 1), (1, 1), (P, 1), (P + 1, 2), (3 * P - 1, 3)])
def test_allocations_are_rounded_to_pages(nbytes: int, pages: int) -> None:
    allocator = ExtentAllocator(8 * P)
    assert allocator.allocate(nbytes) == 0
    assert allocator.used_bytes == pages * P
    assert allocator.allocate(1) == pages * P


def test_custom_page_size() -> None:
    allocator = ExtentAllocator(1000, page=64)
    assert allocator.capacity == 960
    assert allocator.allocate(65) == 0
    assert allocator.allocate(1) == 128
    assert allocator.used_bytes == 192


def test_allocations_are_contiguous_from_zero() -> None:
    allocator = ExtentAllocator(4 * P)
    assert [allocator.allocate(P) for _ in range(4)] == [0, P, 2 * P, 3 * P]
    assert allocator.used_bytes == 4 * P
    assert allocator.largest_free == 0


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    allocator = ExtentAllocator(4 * P)
    assert allocator.allocate(3 * P) == 0
    assert allocator.allocate(2 * P) is None
    assert allocator.used_bytes == 3 * P
    assert allocator.largest_free == P
    assert allocator.allocate(P) == 3 * P
    assert allocator.allocate(1) is None
    assert allocator.allocate(5 * P) is None


def test_fragmented_space_does_not_fit_a_larger_block() -> None:
    allocator = ExtentAllocator(4 * P)
    offsets = [allocator.allocate(P) for _ in range(4)]
    allocator.free(offsets[0])
    allocator.free(offsets[2])
    assert allocator.used_bytes == 2 * P
    assert allocator.largest_free == P
    assert allocator.allocate(2 * P) is None
    assert allocator.allocate(P) in (0, 2 * P)


def test_best_fit_picks_the_smallest_hole_that_fits() -> None:
    allocator = ExtentAllocator(20 * P)
    # Layout: [a:3][b:1][c:1][d:1][e:2][f:1][rest:11]; free a (3), c (1), e (2).
    a = allocator.allocate(3 * P)
    b = allocator.allocate(P)
    c = allocator.allocate(P)
    d = allocator.allocate(P)
    e = allocator.allocate(2 * P)
    f = allocator.allocate(P)
    assert (a, b, c, d, e, f) == (0, 3 * P, 4 * P, 5 * P, 6 * P, 8 * P)
    for offset in (a, c, e):
        allocator.free(offset)
    assert allocator.allocate(2 * P) == e  # the 2-page hole, not the 3-page one
    assert allocator.allocate(P) == c  # the exact 1-page hole
    assert allocator.allocate(P) == a  # splits the 3-page hole from its start
    assert allocator.allocate(2 * P) == a + P  # the rest of that hole
    assert allocator.allocate(4 * P) == 9 * P  # only the tail fits now


def test_best_fit_prefers_exact_hole_over_the_lower_larger_one() -> None:
    allocator = ExtentAllocator(10 * P)
    first = allocator.allocate(4 * P)
    allocator.allocate(P)
    exact = allocator.allocate(2 * P)
    allocator.allocate(P)
    allocator.free(first)
    allocator.free(exact)
    assert allocator.allocate(2 * P) == exact


def _three_in_a_row() -> tuple[ExtentAllocator, int, int, int]:
    # A guard extent after the three keeps the tail free space from joining in.
    allocator = ExtentAllocator(8 * P)
    left, middle, right = (allocator.allocate(P) for _ in range(3))
    allocator.allocate(P)
    assert (left, middle, right) == (0, P, 2 * P)
    return allocator, left, middle, right  # type: ignore[return-value]


def test_free_merges_with_left_neighbour() -> None:
    allocator, left, middle, _ = _three_in_a_row()
    allocator.free(left)
    allocator.free(middle)
    assert allocator._free_offsets == [0, 4 * P]
    assert allocator._free_lengths == {0: 2 * P, 4 * P: 4 * P}
    assert allocator.allocate(2 * P) == 0


def test_free_merges_with_right_neighbour() -> None:
    allocator, _, middle, right = _three_in_a_row()
    allocator.free(right)
    allocator.free(middle)
    assert allocator._free_offsets == [P, 4 * P]
    assert allocator._free_lengths == {P: 2 * P, 4 * P: 4 * P}
    assert allocator.allocate(2 * P) == P


def test_free_merges_with_both_neighbours() -> None:
    allocator, left, middle, right = _three_in_a_row()
    allocator.free(left)
    allocator.free(right)
    assert allocator.largest_free == 4 * P
    allocator.free(middle)
    assert allocator._free_offsets == [0, 4 * P]
    assert allocator._free_lengths == {0: 3 * P, 4 * P: 4 * P}
    assert allocator.allocate(3 * P) == 0


def test_free_merges_with_the_tail() -> None:
    allocator = ExtentAllocator(4 * P)
    first = allocator.allocate(P)
    second = allocator.allocate(P)
    allocator.free(second)
    assert allocator._free_offsets == [P]
    assert allocator.largest_free == 3 * P
    allocator.free(first)
    assert allocator.largest_free == allocator.capacity


@pytest.mark.parametrize("order", ["forward", "backward", "interleaved"])
def test_freeing_everything_leaves_one_extent_of_full_capacity(order: str) -> None:
    allocator = ExtentAllocator(64 * P)
    offsets = [allocator.allocate((i % 3 + 1) * P) for i in range(20)]
    assert None not in offsets
    if order == "backward":
        offsets.reverse()
    elif order == "interleaved":
        offsets = offsets[::2] + offsets[1::2]
    for offset in offsets:
        allocator.free(offset)  # type: ignore[arg-type]
    assert allocator.used_bytes == 0
    assert allocator.largest_free == allocator.capacity
    assert allocator._free_offsets == [0]


def test_double_free_and_unknown_offset_raise() -> None:
    allocator = ExtentAllocator(4 * P)
    offset = allocator.allocate(P)
    assert offset is not None
    allocator.free(offset)
    with pytest.raises(KeyError):
        allocator.free(offset)
    with pytest.raises(KeyError):
        allocator.free(3 * P)
    assert allocator.largest_free == allocator.capacity


@pytest.mark.parametrize("seed", range(5))
def test_random_churn_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    allocator = ExtentAllocator(257 * P + 123)
    live: dict[int, int] = {}
    refused = 0
    for step in range(1500):
        if live and (rng.random() < 0.45 or step % 97 == 0):
            offset = rng.choice(list(live))
            allocator.free(offset)
            del live[offset]
        else:
            nbytes = rng.choice([1, P // 2, P, P + 1, 3 * P, 5 * P - 7, 17 * P])
            before = allocator.used_bytes
            offset = allocator.allocate(nbytes)
            if offset is None:
                refused += 1
                assert allocator.used_bytes == before
                assert allocator.largest_free < round_up(nbytes)
                continue
            assert offset not in live
            live[offset] = round_up(nbytes)
        check_invariants(allocator, live)
    assert refused > 0  # the sequence actually ran the arena full
    for offset in list(live):
        allocator.free(offset)
        del live[offset]
    check_invariants(allocator, live)
    assert allocator.largest_free == allocator.capacity == 257 * P
