"""The hang rule (stalewise.protocol.liveness): each worker judged by its own rhythm."""

import doctest
import random

import pytest

from stalewise.protocol import liveness
from stalewise.protocol.liveness import FLOOR, MIN_SAMPLES, Silence


def beats(s: Silence, times) -> float:
    for t in times:
        s.beat(t)
    return s.last


def test_the_docstring_example_runs():
    assert doctest.testmod(liveness).failed == 0


def test_a_fast_worker_is_found_hung_at_the_floor_not_at_worker_timeout():
    s = Silence(upper=60.0)
    last = beats(s, [0.5 * i for i in range(40)])  # a beat every half second
    assert s.hung(last + FLOOR - 0.1) is None
    cause = s.hung(last + FLOOR + 0.1)
    assert cause is not None and "usual interval of 0.5 s" in cause


def test_a_slow_worker_is_given_time_in_proportion_to_its_steps():
    s = Silence(upper=None)
    last = beats(s, [20.0 * i for i in range(10)])
    assert s.hung(last + 3 * 20.0) is None  # three of its intervals: not yet
    assert s.hung(last + 4 * 20.0) is not None  # four: hung


def test_a_worker_not_set_up_within_start_timeout_is_late_after_it_not_at_it():
    assert liveness.late_start(since=5.0, now=65.0, limit=60.0) is None
    assert liveness.late_start(5.0, 65.5, 60.0) == "did not start within start_timeout=60 s"


def test_worker_timeout_bounds_the_wait_whatever_the_rhythm():
    s = Silence(upper=30.0)
    last = beats(s, [20.0 * i for i in range(10)])
    assert s.hung(last + 29.0) is None
    assert "worker_timeout=30 s" in s.hung(last + 31.0)


def test_no_judgement_before_the_rhythm_is_known():
    s = Silence(upper=None)
    last = beats(s, [0.1 * i for i in range(MIN_SAMPLES)])  # MIN_SAMPLES - 1 intervals
    assert s.phi(last + 100.0) == 0.0 and s.hung(last + 100.0) is None
    s.beat(last + 0.1)
    assert s.hung(last + 100.0) is not None


def test_a_jittery_worker_is_judged_by_its_spread():
    rng = random.Random(0)
    times, t = [], 0.0
    for _ in range(100):  # steps of 1-4 s, uniformly
        t += rng.uniform(1.0, 4.0)
        times.append(t)
    s = Silence(upper=None)
    last = beats(s, times)
    assert s.mean() == pytest.approx(2.75, abs=0.01)
    assert s.phi(last + 4.0) < 1  # its longest usual step
    assert s.hung(last + 10.0) is None  # past the floor, but phi 7.2 < 8: 3.6x its mean
    assert s.hung(last + 11.0) is not None  # 4x its mean: phi 9


def test_a_new_incarnation_keeps_the_rhythm_but_starts_its_silence_anew():
    s = Silence(upper=None)
    last = beats(s, [float(i) for i in range(20)])
    s.start(last + 50.0)  # restarted long after its last beat
    assert s.hung(last + 55.0) is None
    assert s.hung(last + 50.0 + FLOOR + 1) is not None


@pytest.mark.parametrize("bad", [[3.0, 2.0], [1.0, 1.0]])
def test_beats_that_do_not_move_forward_add_no_interval(bad):
    s = Silence(upper=None)
    beats(s, bad)
    assert len(s.intervals) == 0
