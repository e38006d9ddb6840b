"""On synthetic series: starvation that comes and goes, rules a series
cannot fire, the variance bound gated only when calibrated, and calibrate refusing constants
that cannot fail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from moeaudit.calibrate import _refuse_unfalsifiable
from moeaudit.errors import InputError
from moeaudit.judge import envelope as env
from moeaudit.judge.decide import envelope_check
from moeaudit.policy import EnvelopeSettings


def _series(norms_by_step: list[list[float]], steps: list[int] | None = None) -> env.EnvelopeSeries:
    steps = steps or list(range(1, len(norms_by_step) + 1))
    return env.from_norms("logs", steps, {"0": norms_by_step}, "normalized", origin="synthetic")


def _healthy(n: int = 300, e: int = 4) -> list[list[float]]:
    return [[1.0 + 0.1 * ((t * (k + 3)) % 7) / 7 for k in range(e)] for t in range(n)]


def test_starvation_that_comes_and_goes_is_starvation() -> None:
    """Expert 0 has zero gradient on 90% of steps, in stretches of 9 broken by one good step —
    never more than starve_steps in a row — and is starved."""
    norms = _healthy()
    for t in range(len(norms)):
        if t % 10:
            norms[t][0] = 0.0
    found = env.starvation(list(range(1, 301)), norms, share=0.01, max_steps=100, fraction=0.5)
    assert [f["expert"] for f in found] == [0]
    assert found[0]["fraction"] == pytest.approx(0.9, abs=0.02)
    # the old rule (one unbroken stretch) would never fire: fraction 1.0
    assert env.starvation(list(range(1, 301)), norms, 0.01, 100, fraction=1.0) == []
    assert env.starvation(list(range(1, 301)), _healthy(), 0.01, 100) == []


def test_a_series_shorter_than_the_window_cannot_fire_and_is_inconclusive() -> None:
    series = _series(_healthy(50))
    settings = EnvelopeSettings(variant="normalized", starve_steps=100)
    report = env.evaluate(series, settings)
    assert report["unevaluable"] and report["unevaluable"][0]["check"] == "starvation"
    check = envelope_check(report, None)
    assert check["status"] == "INCONCLUSIVE" and "spans 50 step(s)" in check["reason"]


def test_the_variance_bound_is_gated_only_under_calibrated_constants() -> None:
    rising = _series([[1.0, 1.0, 1.0, 1.0 + t / 20] for t in range(300)])  # V grows: leaves any bound
    illustrative = EnvelopeSettings(variant="normalized", delta=0.05, epsilon=1e-5)
    report = env.evaluate(rising, illustrative)
    assert not report["variance_within_bound"] and not report["variance_gated"]
    assert report["compliant"]  # the gated rules alone: what the check and `moeaudit envelope` read
    check = envelope_check(report, None)
    assert check["status"] == "PASS" and "outside the illustrative variance bound" in check["reason"]
    calibrated = replace(illustrative, calibrated=True, sampling_interval=1)
    gated = env.evaluate(rising, calibrated)
    assert envelope_check(gated, None)["status"] == "FAIL"
    assert gated["variance_gated"] and not gated["compliant"] and not gated["variance_within_bound"]


def test_the_starvation_share_is_a_quantile_not_a_minimum() -> None:
    norms = _healthy()
    norms[7][2] = 0.0  # one zero norm in an otherwise healthy log
    share = env.healthy_share(_series(norms))
    assert share is not None and share > 0.5


@pytest.mark.parametrize(
    "change, why",
    [
        ({"starve_share": 0.0}, "starvation share is 0"),
        ({"calibrated": True, "delta": 0.01, "epsilon": 0.05, "sampling_interval": 1}, "at or above E − 1"),
        ({"starve_share": 1e-12}, "accepts a starved run"),
    ],
)
def test_calibrate_refuses_constants_that_cannot_fail(change: dict, why: str) -> None:
    series = _series(_healthy())
    settings = replace(EnvelopeSettings(variant="normalized", starve_share=0.3), **change)
    with pytest.raises(InputError, match=why):
        _refuse_unfalsifiable(series, settings, [], Path("run"))


def test_a_sound_level_check_rejects_both_synthetic_starved_runs() -> None:
    series = _series(_healthy())
    settings = EnvelopeSettings(variant="normalized", starve_share=0.3)
    assert _refuse_unfalsifiable(series, settings, [], Path("run"))[0] == []
    for bad in (env.known_bad(series), env.half_dead(series)):
        assert env.evaluate(bad, settings)["starvation"]


def test_resample_takes_block_means_and_drops_a_partial_last_block() -> None:
    series = _series([[float(t), 1.0] for t in range(1, 26)])  # steps 1..25
    blocks = env.resample(series, 10)
    assert blocks.steps == (10, 20, 25)  # (20, 30] holds 5 of 10 samples: half is kept
    assert blocks.norms is not None and blocks.norms["0"][0][0] == pytest.approx(5.5)
    short = env.resample(_series([[float(t), 1.0] for t in range(1, 24)]), 10)
    assert short.steps == (10, 20)  # 21..23 is a partial block: left out
    assert env.resample(series, 1) is series


def test_a_fit_with_no_coarser_sampling_to_try_says_only_why() -> None:
    """Two samples admit no block means: the error is the fit's own, not "also tried block
    means of no coarser sampling steps"; with a longer series the tried block sizes are named."""
    from moeaudit.calibrate import _fit_envelope
    from moeaudit.policy import Policy

    def error(n: int) -> str:
        with pytest.raises(InputError) as exc:
            series = _series(_healthy(n))
            _fit_envelope(series, Policy(), "normalized", [], Path("m"), since=0, stage="pretraining", model="x")
        return exc.value.what

    assert error(2) == "calibration needs at least three samples of the healthy run"
    assert error(30).endswith("(also tried block means of 2 steps)")
