"""The window-size choice against hand-built profiles whose answer is known in advance."""

import dataclasses

import pytest
import torch

from stronghold_hf.planner import (
    BlockProfile,
    LinkProfile,
    WindowChoice,
    _simulate_pass,
    add_recompute,
    choose_window,
    choose_window_for_cpu,
    measure_link,
)

MS = 1e-3
GBPS = 1e9
LINK = LinkProfile(h2d_bytes_per_s=10 * GBPS, d2h_bytes_per_s=10 * GBPS)
BIG = 100 * 2**30  # a budget that never binds


def _bytes_for(ms: float, bps: float = 10 * GBPS) -> int:
    """Block bytes whose copy takes ``ms`` on a link of ``bps``."""
    return int(round(ms * MS * bps))


def uniform(n, fwd_ms, bwd_ms, copy_ms):
    return [BlockProfile(f"h.{i}", fwd_ms * MS, bwd_ms * MS, _bytes_for(copy_ms)) for i in range(n)]


def test_simulation_by_hand():
    # Block 2's 5 ms copy is issued when block 1 starts (t=1) and lands at t=6; block 2 would
    # otherwise start at t=2, so compute waits 4 ms.
    assert _simulate_pass([1.0, 1.0, 1.0], [0.0, 0.0, 5.0], 1) == pytest.approx(4.0)
    assert _simulate_pass([1.0, 1.0, 1.0], [0.0, 0.0, 5.0], 3) == 0.0  # all resident
    # Copy-out: block 0's 3 s gradient copy must be back before block 2 (W=1) starts at t=2.
    assert _simulate_pass([1.0, 1.0, 1.0], [0.0] * 3, 1, copy_out=[3.0, 0.0, 0.0]) == pytest.approx(2.0)


def test_w1_hides_when_one_block_covers_its_copy():
    choice = choose_window(uniform(24, 4.0, 8.0, 2.0), LINK, device_bytes_free=BIG, slot_bytes=2**20)
    assert isinstance(choice, WindowChoice)
    assert (choice.window_size, choice.hidden) == (1, True)
    assert choice.reason.startswith("window_size=1:")
    assert "W=1 hides the copies" in choice.reason
    assert "4.0 ms" in choice.reason and "8.0 ms" in choice.reason and "10.0 GB/s" in choice.reason
    assert "\n" not in choice.reason
    assert choice.numbers["stall_forward_s"] == 0.0 and choice.numbers["stall_backward_s"] == 0.0


def _every_eighth_big():
    # 1 ms blocks; seven cheap copies (0.5 ms) then one 2.5 ms copy. The link keeps up on
    # average, but the big block needs 3 blocks of compute ahead of it: W=3.
    return [
        BlockProfile(f"h.{i}", 1.0 * MS, 2.0 * MS, _bytes_for(2.5 if i % 8 == 7 else 0.5)) for i in range(32)
    ]


def test_w3_needed_for_a_big_block():
    choice = choose_window(_every_eighth_big(), LINK, device_bytes_free=BIG, slot_bytes=2**20)
    assert (choice.window_size, choice.hidden) == (3, True)
    assert "window_size=3:" in choice.reason
    assert "fwd 3-block window 3.0 ms >= h2d 2.5 ms" in choice.reason
    assert choice.numbers["hiding_window_size"] == 3


def test_memory_cap_binding_reports_what_would_hide():
    slot = 2**20
    # Room for 3 slots: W <= 2, one short of the W=3 this profile needs.
    choice = choose_window(_every_eighth_big(), LINK, device_bytes_free=3 * slot + slot // 2, slot_bytes=slot)
    assert (choice.window_size, choice.hidden) == (2, False)
    assert "W=3 would" in choice.reason and "budget allows W<=2" in choice.reason
    assert choice.numbers["stall_forward_s"] > 0
    # The user cap binds the same way, and says so.
    capped = choose_window(_every_eighth_big(), LINK, device_bytes_free=BIG, slot_bytes=slot, max_window=2)
    assert (capped.window_size, capped.hidden) == (2, False)
    assert "max_window=2" in capped.reason


def test_nothing_hides_picks_largest_that_fits():
    # Every copy (3 ms) is longer than a block's forward (1 ms). W x 1 ms >= 3 ms holds for
    # W=3, but the serial stream falls 2 ms further behind at every block: link-bound.
    slot = 2**20
    choice = choose_window(uniform(32, 1.0, 2.0, 3.0), LINK, device_bytes_free=6 * slot, slot_bytes=slot)
    assert (choice.window_size, choice.hidden) == (5, False)
    assert "no W<=5 hides the copies" in choice.reason
    assert "the link is the bottleneck" in choice.reason
    assert "taking the largest W that fits" in choice.reason
    assert choice.numbers["stall_forward_s"] > 0


def test_per_block_inequality_alone_is_not_enough():
    # "W blocks of compute >= the next copy" holds at W=4 (4 ms >= 2 ms), yet each copy
    # takes twice a block's forward, so the serial stream falls behind; not hidden.
    choice = choose_window(uniform(16, 1.0, 4.0, 2.0), LINK, device_bytes_free=BIG, slot_bytes=2**20, max_window=4)
    assert not choice.hidden


def test_impossible_raises_with_numbers_and_fixes():
    slot = 100 * 2**20
    with pytest.raises(ValueError) as err:
        choose_window(uniform(4, 1.0, 2.0, 0.1), LINK, device_bytes_free=int(1.5 * slot), slot_bytes=slot)
    msg = str(err.value)
    assert "window_size=1" in msg and "100.0 MiB" in msg and "150.0 MiB free" in msg
    assert "gradient checkpointing" in msg and "bfloat16" in msg and "batch" in msg


def test_activations_come_out_of_the_budget():
    slot = 2**20
    blocks = uniform(10, 4.0, 8.0, 2.0)
    free = 20 * slot
    assert choose_window(blocks, LINK, device_bytes_free=free, slot_bytes=slot).numbers["max_window_size_budget"] == 19
    choice = choose_window(blocks, LINK, device_bytes_free=free, slot_bytes=slot, activation_bytes_per_block=slot)
    assert choice.numbers["max_window_size_budget"] == 9
    with pytest.raises(ValueError, match="activations"):
        choose_window(blocks, LINK, device_bytes_free=free, slot_bytes=slot, activation_bytes_per_block=2 * slot)


def test_d2h_direction_is_checked_on_its_own():
    # Fast h2d, and every fourth gradient takes 3 ms out: one 2 ms backward block is not
    # enough slack, two are.
    fast_in = LinkProfile(h2d_bytes_per_s=100 * GBPS, d2h_bytes_per_s=10 * GBPS)
    blocks = [BlockProfile(f"h.{i}", 2.0 * MS, 2.0 * MS, _bytes_for(3.0 if i % 4 == 0 else 0.5)) for i in range(16)]
    choice = choose_window(blocks, fast_in, device_bytes_free=BIG, slot_bytes=2**20)
    assert (choice.window_size, choice.hidden) == (2, True)
    assert "d2h 3.0 ms" in choice.reason
    symmetric = LinkProfile(h2d_bytes_per_s=100 * GBPS, d2h_bytes_per_s=100 * GBPS)
    assert choose_window(blocks, symmetric, device_bytes_free=BIG, slot_bytes=2**20).window_size == 1


def test_recompute_adds_forward_to_backward():
    b = BlockProfile("h.0", 4.0 * MS, 0.5 * MS, 10)
    assert b.with_recompute() == dataclasses.replace(b, backward_s=4.5 * MS)
    assert add_recompute([b, b]) == [b.with_recompute()] * 2
    # Backward alone (0.5 ms) cannot cover a 1 ms prefetch with W=1; with the recompute it can.
    blocks = uniform(12, 4.0, 0.5, 1.0)
    plain = choose_window(blocks, LINK, device_bytes_free=BIG, slot_bytes=2**20)
    ckpt = choose_window(blocks, LINK, device_bytes_free=BIG, slot_bytes=2**20, recompute=True)
    assert plain.window_size > 1
    assert (ckpt.window_size, ckpt.hidden) == (1, True)
    assert "incl. recompute" in ckpt.reason and ckpt.numbers["recompute_added"] is True


def test_window_never_exceeds_block_count():
    choice = choose_window(uniform(3, 1.0, 2.0, 50.0), LINK, device_bytes_free=BIG, slot_bytes=2**20)
    assert choice.window_size == 3 and choice.hidden  # everything resident: nothing moves
    assert "nothing moves" in choice.reason


def test_bad_inputs():
    with pytest.raises(ValueError):
        choose_window([], LINK, device_bytes_free=BIG, slot_bytes=1)
    with pytest.raises(ValueError):
        choose_window(uniform(2, 1, 1, 1), LINK, device_bytes_free=BIG, slot_bytes=0)
    with pytest.raises(ValueError):
        choose_window(uniform(2, 1, 1, 1), LINK, device_bytes_free=BIG, slot_bytes=1, max_window=0)
    with pytest.raises(ValueError):
        LinkProfile(0.0, 1.0)
    with pytest.raises(ValueError):
        BlockProfile("h.0", -1.0, 0.0, 0)


def test_cpu_choice():
    choice = choose_window_for_cpu(5)
    assert (choice.window_size, choice.hidden) == (2, False)
    assert "CPU-only" in choice.reason and "window_size=2" in choice.reason
    assert choose_window_for_cpu(1).window_size == 1
    with pytest.raises(ValueError):
        choose_window_for_cpu(0)


def test_measure_link_on_cpu_is_none():
    assert measure_link("cpu") is None
    if not torch.cuda.is_available():
        assert measure_link() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_link_on_cuda():
    link = measure_link("cuda", nbytes=16 * 2**20, repeats=3)
    assert link.h2d_bytes_per_s > 1e9 and link.d2h_bytes_per_s > 1e9
