"""FNT_FAULT specs: what names a point and what is refused."""

import pytest

from fnt.faults import PHASES, Fault, parse_fault


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_parses_with_and_without_a_rank(phase):
    assert parse_fault(f"{phase}@12") == Fault(phase, 12, 0)
    assert parse_fault(f"{phase}@3:1") == Fault(phase, 3, 1)


@pytest.mark.parametrize(
    "spec", ["", "row", "row@", "row@x", "row@1:", "row@1:a", "nope@1", "4:shards"]
)
def test_a_spec_that_names_no_point_is_refused(spec):
    with pytest.raises(ValueError, match="FNT_FAULT"):
        parse_fault(spec)
