"""AUP: the worked example of diffusion spec §10 and the edge rules."""

import pytest

from unmask.errors import UnmaskError
from unmask.eval.aup import aup, aup_report, aup_weight

Y_MAX = 74.98  # D2F at rho = 1, GSM8K-CoT (d3LLM data_llada.yaml)


@pytest.mark.parametrize("points, expected", [
    ([(1.0, 74.02), (9.11, 73.09)], 637.65),   # d3LLM-LLaDA
    ([(1.0, 74.79), (2.77, 74.68)], 205.78),   # Fast-dLLM-LLaDA
    ([(1.0, 74.98), (2.88, 74.39)], 213.76),   # D2F
    ([(1.0, 72.55)], 72.55),                   # LLaDA
])
def test_worked_example(points, expected):
    assert aup(points, Y_MAX) == pytest.approx(expected, abs=0.01)
    assert aup(list(reversed(points)), Y_MAX) == pytest.approx(expected, abs=0.01)


def test_weights_of_worked_example():
    assert aup_weight(74.02, y_max=Y_MAX) == pytest.approx(0.96232, abs=1e-5)
    assert aup_weight(73.09, y_max=Y_MAX) == pytest.approx(0.92717, abs=1e-5)
    assert aup_weight(80.0, y_max=Y_MAX) == 1.0


def test_assertion_rule_raises_one_line_error():
    with pytest.raises(UnmaskError) as err:
        aup([(1.0, 80.0), (4.0, 74.0)], 80.0)
    assert "\n" not in str(err.value)


def test_low_middle_points_are_dropped_and_reported():
    kept = aup([(1.0, 80.0), (4.0, 79.0)], 80.0)
    with pytest.warns(UserWarning, match=r"aup: dropped 1 point\(s\) .*\(2, 70\)"):  # never silently (issue 15)
        assert aup([(1.0, 80.0), (2.0, 70.0), (4.0, 79.0)], 80.0) == pytest.approx(kept)
    report = aup_report([(1.0, 80.0), (2.0, 70.0), (4.0, 79.0)], 80.0)
    assert report.value == pytest.approx(kept) and report.dropped == [(2.0, 70.0)]


@pytest.mark.parametrize("points, y_max, match", [
    ([(1.0, 0.72), (2.0, 0.7)], 0.72, "looks like fractions"),  # issue 28 item 9: refused, not scored 6.38
    ([(1.0, 72.0), (2.0, 170.0)], 100.0, r"accuracy must be in percent, in \[0, 100\], got 170"),
    ([(1.0, -1.0)], 50.0, "accuracy must be in percent"),
    ([(1.0, 72.0), (2.0, 71.0)], 70.0, "y_max 70 is below the best accuracy of the points \\(72\\)"),
    ([(1.0, 72.0)], 0.72 * 1000, "y_max must be in percent"),
    ([(float("inf"), 72.0)], 80.0, "TPF must be a finite number > 0"),
    ([(1.0, float("nan"))], 80.0, "accuracy must be in percent"),
])
def test_inputs_outside_the_definition_are_refused(points, y_max, match):
    if match is None:
        assert aup(points, y_max) > 0
        return
    with pytest.raises(UnmaskError, match=match):
        aup(points, y_max)


def test_trapezoid_variant():
    assert aup([(1.0, 70.0), (3.0, 60.0)], 99.0, variant="trapezoid") == pytest.approx(130.0)
    assert aup([(1.0, 70.0)], 99.0, variant="trapezoid") == 0.0


@pytest.mark.parametrize("kwargs", [
    dict(points=[], y_max=1.0), dict(points=[(0.0, 1.0)], y_max=1.0),
    dict(points=[(1.0, 1.0)], y_max=0.0), dict(points=[(1.0, 1.0)], y_max=1.0, variant="x"),
])
def test_bad_input(kwargs):
    with pytest.raises(UnmaskError):
        aup(**kwargs)
