"""The driver's system-memory fallback detector (training/memory/fallback.py), fed recorded device readings."""
from headroom.training.memory.fallback import (
    BASELINE_STEPS, RECENT_STEPS, WARMUP_STEPS, FallbackDetector, Reading, spill_finding,
)

GIB = 2**30
CARD = 8 * GIB  # an 8 GiB card, the readings' total_bytes


def _readings(seconds: list[float | None], reserved: list[float]) -> list[Reading]:
    """Step i+1 took seconds[i] with reserved[i] GiB reserved (allocated 90% of it) on CARD."""
    return [Reading(step, s, int(r * GIB), int(r * 0.9 * GIB), CARD)
            for step, (s, r) in enumerate(zip(seconds, reserved), start=1)]


def _findings(readings: list[Reading]) -> list:
    detector = FallbackDetector()
    found = [(reading.step, finding) for reading in readings if (finding := detector.observe(reading)) is not None]
    assert detector.finding is (found[0][1] if found else None)
    return found


def test_a_healthy_run_near_its_budget_is_quiet():
    # 40 steps at 0.50 s +-10% jitter with 7.6 of 8 GiB reserved (95%: near full, but not slower).
    seconds = [None, 2.0, 0.9] + [0.5 * (1 + 0.1 * ((i * 7) % 3 - 1)) for i in range(37)]
    assert _findings(_readings(seconds, [7.6] * 40)) == []


def test_a_spill_past_physical_memory_is_found_at_its_step_once():
    reserved = [6.0, 7.0, 7.5, 7.9, 8.4, 8.6, 8.6, 8.6]  # step 5 reserves more than the card's 8 GiB
    [(step, finding)] = _findings(_readings([None] + [0.5] * 7, reserved))
    assert step == 5 and finding.kind == "spill" and finding.step == 5
    assert finding.evidence["reserved_bytes"] == int(8.4 * GIB) and finding.evidence["total_bytes"] == CARD
    # Plain words and both fixes.
    assert "spilling into system RAM" in finding.message and "8.40 GiB" in finding.message
    assert "vram_budget_gb" in finding.message and "Prefer No Sysmem Fallback" in finding.message
    assert finding.as_dict()["kind"] == "spill" and finding.as_dict()["message"] == finding.message


def test_a_sharp_slowdown_as_the_budget_fills_is_found():
    # Warm-up, a 0.5 s baseline at 6 GiB, then memory fills to 7.5 GiB (94%) and steps take 2.5 s (5x).
    seconds = [None, 3.0, 1.0] + [0.5] * 10 + [2.5] * 8
    reserved = [5.0] * 3 + [6.0] * 10 + [7.5] * 8
    [(step, finding)] = _findings(_readings(seconds, reserved))
    # The median of the last five turns slow when three of them are: the third slow step (step 16).
    assert step == 16 and finding.kind == "slowdown"
    assert finding.evidence["baseline_s_per_step"] == 0.5 and finding.evidence["recent_s_per_step"] == 2.5
    assert "slowed 5.0x" in finding.message and "94% full" in finding.message
    assert "Prefer No Sysmem Fallback" in finding.message


def test_a_slowdown_with_memory_to_spare_is_not_blamed_on_the_fallback():
    # The same slowdown at 5 of 8 GiB (62%): another program on the GPU, not the driver's fallback.
    seconds = [None, 3.0, 1.0] + [0.5] * 10 + [2.5] * 8
    assert _findings(_readings(seconds, [5.0] * 21)) == []


def test_single_slow_steps_do_not_count():
    # Near-full memory; a checkpoint written inside a step (10x) every fourth step, and slow steps at the very
    # start (warm-up), which is not the baseline.
    seconds = [None, 8.0, 6.0] + [5.0 if i % 4 == 3 else 0.5 for i in range(40)]
    assert _findings(_readings(seconds, [7.6] * 43)) == []
    # Untimed readings (the first step after each load) add nothing to the windows.
    untimed = [None if i % 3 == 0 else 0.5 for i in range(40)]
    assert _findings(_readings(untimed, [7.6] * 40)) == []


def test_the_windows_need_their_steps_before_a_slowdown_counts():
    # A run slow from just after warm-up has no fast baseline to be slower than: not a finding (spill finds it).
    needed = WARMUP_STEPS + BASELINE_STEPS + RECENT_STEPS
    seconds = [0.5] * (WARMUP_STEPS + BASELINE_STEPS) + [2.5] * (RECENT_STEPS - 1)
    assert len(seconds) == needed - 1 and _findings(_readings(seconds, [7.6] * len(seconds))) == []
    assert len(_findings(_readings(seconds + [2.5], [7.6] * needed))) == 1


def test_the_spill_check_on_its_own():
    assert spill_finding(8 * GIB, 7 * GIB, 8 * GIB) is None  # full is not past full
    assert spill_finding(9 * GIB, 7 * GIB, 0) is None  # no card total known
    finding = spill_finding(9 * GIB, 7 * GIB, 8 * GIB)
    assert finding.step is None and "now PyTorch holds 9.00 GiB" in finding.message
