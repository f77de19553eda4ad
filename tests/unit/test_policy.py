"""Policy parsing and rule resolution: pure, no server."""

import pytest
from hypothesis import given, strategies as st

from gpu_quota_ext.policy import (
    GiB,
    MiB,
    CapSpec,
    PolicyError,
    build_policy,
    format_bytes,
    parse_cap,
    resolve,
)

TOTAL = 80 * GiB


@pytest.mark.parametrize(
    "text, expected_bytes",
    [
        ("0.25", 20 * GiB),
        ("25%", 20 * GiB),
        (" 25 % ", 20 * GiB),
        ("1", TOTAL),
        ("1.0", TOTAL),
        ("100%", TOTAL),
        ("12GiB", 12 * GiB),
        ("12gib", 12 * GiB),
        ("12GB", 12 * 10**9),
        ("512MiB", 512 * MiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("1073741824", GiB),
        (0.5, 40 * GiB),
        (GiB, GiB),
        ("200GiB", TOTAL),  # a size above the device is the whole device
    ],
)
def test_parse_cap_accepts_the_documented_forms(text, expected_bytes):
    assert parse_cap(text).to_bytes(TOTAL) == expected_bytes


@pytest.mark.parametrize(
    "text, words",
    [
        ("abc", "not a cap"),
        ("1.5", "at most 1"),
        ("150%", "at most 1"),
        ("-1", "not a cap"),
        ("0", "above 0"),
        ("0%", "above 0"),
        ("2", "at least 1 MiB"),
        ("999TiB", "larger than any GPU"),
        ("12XB", "unknown unit"),
        ("", "not a cap"),
        ("nan", "not a cap"),
        (True, "not a cap"),
        (None, "not a cap"),
        (float("inf"), "above 0"),
    ],
)
def test_parse_cap_rejects_with_a_reason(text, words):
    with pytest.raises(PolicyError, match=words):
        parse_cap(text)


@given(st.text(max_size=30))
def test_any_string_is_a_cap_or_a_clear_error(text):
    try:
        spec = parse_cap(text)
    except PolicyError as error:
        assert str(error)  # a message, never empty
        return
    assert isinstance(spec, CapSpec)
    nbytes = spec.to_bytes(TOTAL)
    assert 0 <= nbytes <= TOTAL
    assert (spec.fraction is None) != (spec.nbytes is None)


@given(st.one_of(st.integers(), st.floats(allow_nan=True), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
def test_any_value_is_a_cap_or_a_clear_error(value):
    try:
        parse_cap(value)
    except PolicyError as error:
        assert str(error)


def test_format_bytes():
    assert format_bytes(10 * GiB) == "10.0 GiB"
    assert format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(None) == "-"


def test_rules_first_match_wins_and_fall_back_to_default():
    policy = build_policy(
        "0.25",
        "0.5",
        caps=[
            {"user": "alice", "cap": "0.5"},
            {"kernelspec": "big-*", "cap": "0.75", "max_cap": "1.0", "devices": 2},
            {"user": "alice", "kernelspec": "big-*", "cap": "0.1"},  # never reached: alice matches rule 0
        ],
    )
    alice = resolve(policy, "alice", "big-torch")
    assert (alice.cap.fraction, alice.max_cap.fraction, alice.devices) == (0.5, 0.5, 1)
    assert alice.source == "rule 0 (user=alice)"
    bob_big = resolve(policy, "bob", "big-torch")
    assert (bob_big.cap.fraction, bob_big.max_cap.fraction, bob_big.devices) == (0.75, 1.0, 2)
    bob = resolve(policy, "bob", "python3")
    assert (bob.cap.fraction, bob.source) == (0.25, "default")


def test_callable_rules():
    policy = build_policy("0.25", "1.0", caps=lambda user, spec: "12GiB" if user == "carol" else None)
    assert resolve(policy, "carol", "python3").cap.nbytes == 12 * GiB
    assert resolve(policy, "dave", "python3").source == "default"
    broken = build_policy("0.25", "1.0", caps=lambda user, spec: 1 / 0)
    with pytest.raises(PolicyError, match="callable failed"):
        resolve(broken, "dave", "python3")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"default_cap": "abc"}, r"c.GpuQuota.default_cap = 'abc'"),
        ({"max_cap": "2"}, r"c.GpuQuota.max_cap = '2'"),
        ({"default_cap": "0.6", "max_cap": "0.5"}, "above max_cap"),
        ({"overcommit": "lots"}, r"c.GpuQuota.overcommit = 'lots'"),
        ({"overcommit": -1}, r"c.GpuQuota.overcommit = -1"),
        ({"placement": "random"}, r"c.GpuQuota.placement = 'random'.*'spread'"),
        ({"on_full": "wait"}, r"c.GpuQuota.on_full = 'wait'"),
        ({"on_over_max": "yes"}, r"c.GpuQuota.on_over_max = 'yes'"),
        ({"caps": "alice"}, "must be a list of rules or a callable"),
        ({"caps": [{"user": "alice"}]}, r"caps\[0\] needs a 'cap'"),
        ({"caps": [{"user": "alice", "cap": "0.3", "colour": "red"}]}, "unknown keys"),
        ({"caps": [{"cap": "0.3", "devices": 0}]}, "devices"),
        ({"caps": [{"cap": "2.0"}]}, r"caps\[0\]"),
        ({"caps": [{"cap": "0.9"}]}, "above max_cap"),
    ],
)
def test_bad_settings_name_the_setting_and_value(kwargs, words):
    settings = {"default_cap": "0.25", "max_cap": "0.8", **kwargs}
    with pytest.raises(PolicyError, match=words):
        build_policy(**settings)


def test_defaults_and_overcommit_forms():
    policy = build_policy("0.25", "1.0")
    assert (policy.overcommit, policy.placement, policy.on_full, policy.on_over_max) == (None, "spread", "cpu-only", "clamp")
    assert build_policy("0.25", "1.0", overcommit="1.5").overcommit == 1.5
    assert build_policy("0.25", "1.0", overcommit="none").overcommit is None
    assert build_policy("0.25", "1.0", placement=" PACK ").placement == "pack"
