"""Policy parsing and rule resolution: pure, no server."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_quota_ext.policy import build_policy, resolve, resolve_answer
from gpu_quota_ext.shared.sizes import CapSpec, GiB, MiB, PolicyError, TiB, format_bytes, parse_cap

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
    try:
        nbytes = spec.to_bytes(TOTAL)
    except PolicyError as error:  # a fraction that is less than 1 MiB of this device
        assert spec.fraction is not None and "at least 1 MiB" in str(error)
        return
    assert MiB <= nbytes <= TOTAL
    assert (spec.fraction is None) != (spec.nbytes is None)


@given(
    st.one_of(st.integers(), st.floats(allow_nan=True), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))
)
def test_any_value_is_a_cap_or_a_clear_error(value):
    try:
        spec = parse_cap(value)
    except PolicyError as error:
        assert str(error)  # a message, never empty
        return
    # Accepted: a number of bytes (1 MiB or more) or a fraction in (0, 1], exactly one of them.
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    assert (spec.fraction is None) != (spec.nbytes is None)
    assert spec.nbytes is None or spec.nbytes >= MiB
    assert spec.fraction is None or 0 < spec.fraction <= 1


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
    assert (policy.overcommit, policy.placement, policy.on_full, policy.on_over_max) == (
        None,
        "spread",
        "cpu-only",
        "clamp",
    )
    assert build_policy("0.25", "1.0", overcommit="1.5").overcommit == 1.5
    assert build_policy("0.25", "1.0", overcommit="none").overcommit is None
    assert build_policy("0.25", "1.0", placement=" PACK ").placement == "pack"


# --- issue 10: no cap below 1 MiB; a callable's answer obeys max_cap; short messages --------------


@pytest.mark.parametrize("value", ["0.00000000001", 1e-320, "0.000000001%", 5e-324])
def test_a_fraction_too_small_for_any_gpu_is_refused_when_parsed(value):
    with pytest.raises(PolicyError, match="less than 1 MiB of any GPU"):
        parse_cap(value)


def test_a_fraction_is_checked_on_each_device_where_it_becomes_bytes():
    spec = parse_cap("0.0000001")  # 1.7 KiB of 16 GiB, 6.9 MiB of 64 TiB: only the device can tell
    with pytest.raises(PolicyError, match=r"of device 3 \(16.0 GiB\) is 1.7 KiB: a cap must be at least 1 MiB"):
        spec.to_bytes(16 * GiB, "device 3")
    assert spec.to_bytes(64 * TiB) >= MiB
    assert parse_cap(MiB / (16 * GiB)).to_bytes(16 * GiB) == MiB


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"default_cap": "0.00000000001"}, r"c.GpuQuota.default_cap = '0.00000000001': .*1 MiB"),
        ({"caps": [{"user": "a", "cap": "0.00000000001"}]}, r"c.GpuQuota.caps = .*caps\[0\]: .*1 MiB"),
        ({"caps": [{"cap": "0.25", "max_cap": 1e-320}]}, r"caps\[0\]: .*1 MiB"),
    ],
)
def test_config_below_the_floor_stops_at_start(settings, words):
    with pytest.raises(PolicyError, match=words):
        build_policy(**{"default_cap": "0.25", "max_cap": "1.0", **settings})


def test_a_huge_value_is_echoed_short():
    # Issue 10, item 8: a 1 MB cap string gives a short message, not a 1 MB one.
    for value in ["x" * 1_000_000, "0." + "0" * 1_000_000 + "1", "1" * 1_000_000 + "GiB", ["a"] * 100_000]:
        with pytest.raises(PolicyError) as error:
            parse_cap(value)
        assert len(str(error.value)) < 250 and "..." in str(error.value)
    with pytest.raises(PolicyError) as error:
        build_policy("0.25", "1.0", caps=[{"cap": "9" * 1_000_000}])
    assert len(str(error.value)) < 400
    with pytest.raises(PolicyError) as error:
        build_policy("0.25", "1.0", caps=[{"cap": "0.2", "devices": "z" * 1_000_000}])
    assert len(str(error.value)) < 300
    long_but_valid = parse_cap("0.2" + "0" * 1_000_000)
    assert long_but_valid.fraction == 0.2 and len(str(long_but_valid)) <= 60


@pytest.mark.parametrize(
    "answer, cap, max_cap, source",
    [
        ("1.0", 0.5, 0.5, "caps callable (clamped to max_cap 0.5)"),
        ("0.3", 0.3, 0.5, "caps callable"),
        ({"cap": "1.0", "max_cap": "0.8"}, 0.8, 0.8, "caps callable (clamped to max_cap 0.8)"),
        ({"cap": "0.7", "max_cap": "0.8", "devices": 2}, 0.7, 0.8, "caps callable"),
        (None, 0.25, 0.5, "default"),
    ],
)
def test_a_callable_answer_is_a_rule_clamped_to_its_max_cap(answer, cap, max_cap, source):
    resolved = resolve_answer(build_policy("0.25", "0.5", caps=lambda user, spec: answer), answer)
    assert (resolved.cap.fraction, resolved.max_cap.fraction, resolved.source) == (cap, max_cap, source)
    policy = build_policy("0.25", "0.5", caps=lambda user, spec: answer)
    assert resolve(policy, "u", "python3") == resolved


@pytest.mark.parametrize("answer", ["abc", 1e-320, {"cap": "0.3", "colour": "red"}, {"user": "x"}, object()])
def test_a_callable_answer_that_is_not_a_cap_is_a_policy_error(answer):
    with pytest.raises(PolicyError, match="the caps callable's answer"):
        resolve_answer(build_policy("0.25", "0.5"), answer)
