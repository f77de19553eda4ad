"""The watchdog's decision and settings, without a server."""

import pytest

from gpu_quota_ext.settings import parse_slack
from gpu_quota_ext.shared.sizes import GiB, MiB, PolicyError
from gpu_quota_ext.usage.watchdog import (
    OverLimitEpisode,
    Watchdog,
    decide,
    worst_device,
)
from gpu_quota_ext.usage.watchdog_settings import (
    WatchdogSettings,
    build_watchdog_settings,
)


def settings(enforce="kill", slack="1GiB", grace=0, poll=1):
    return build_watchdog_settings(enforce, slack, grace, poll)


def test_defaults_are_warn_with_a_slack_that_covers_a_cuda_context():
    default = WatchdogSettings()
    assert default.enforce == "warn"
    assert default.limit(4 * GiB) == 5 * GiB
    assert default.limit(4 * GiB) - 4 * GiB > 641_728_512  # docs/measurements.md: one CUDA context, as NVML counts it


@pytest.mark.parametrize(
    "slack, cap, limit",
    [
        ("1GiB", 4 * GiB, 5 * GiB),
        ("0.5", 4 * GiB, 6 * GiB),
        ("10%", 10 * GiB, 11 * GiB),
        ("0", 4 * GiB, 4 * GiB),
        (0, GiB, GiB),
        (512 * MiB, GiB, GiB + 512 * MiB),
    ],
)
def test_limit_is_cap_plus_slack_in_bytes_or_as_a_fraction_of_the_cap(slack, cap, limit):
    assert settings(slack=slack).limit(cap) == limit


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("enforce", {"enforce": "explode"}),
        ("enforce", {"enforce": 1}),
        ("slack", {"slack": "lots"}),
        ("slack", {"slack": "-1GiB"}),
        ("grace", {"grace": -1}),
        ("grace", {"grace": "soon"}),
        ("grace", {"grace": float("nan")}),
        ("poll_interval", {"poll": 0}),
        ("poll_interval", {"poll": True}),
        ("poll_interval", {"poll": 3600}),
    ],
)
def test_bad_settings_name_the_setting_and_the_value(field, kwargs):
    with pytest.raises(PolicyError) as error:
        settings(**kwargs)
    assert str(error.value).startswith(f"c.GpuQuota.{field} = ")


def test_enforce_is_case_insensitive_and_slack_zero_is_allowed():
    assert settings(enforce=" Restart ").enforce == "restart"
    assert parse_slack("0").nbytes == 0


def test_under_the_limit_nothing_happens_and_the_episode_ends():
    s = settings()
    watch, action = decide(OverLimitEpisode(over_since=5.0, warned=True), over=False, now=10.0, settings=s)
    assert action is None and watch.over_since is None and not watch.warned


def test_acts_on_the_first_sample_over_with_no_grace():
    watch, action = decide(OverLimitEpisode(), over=True, now=10.0, settings=settings("interrupt"))
    assert action == "interrupt"
    assert watch.quiet_until == 10.0 + settings().cooldown


def test_grace_waits_until_the_kernel_has_been_over_that_long():
    s = settings("restart", grace=3)
    watch, action = decide(OverLimitEpisode(), True, 10.0, s)
    assert action is None and watch.over_since == 10.0
    watch, action = decide(watch, True, 12.9, s)
    assert action is None
    watch, action = decide(watch, True, 13.0, s)
    assert action == "restart"


def test_dipping_under_restarts_the_grace_period():
    s = settings("kill", grace=2)
    watch, _ = decide(OverLimitEpisode(), True, 0.0, s)
    watch, _ = decide(watch, False, 1.0, s)
    watch, action = decide(watch, True, 2.5, s)
    assert action is None and watch.over_since == 2.5


def test_warn_once_per_episode():
    s = settings("warn")
    watch, first = decide(OverLimitEpisode(), True, 0.0, s)
    watch, second = decide(watch, True, 1.0, s)
    watch, _ = decide(watch, False, 2.0, s)
    watch, third = decide(watch, True, 3.0, s)
    assert (first, second, third) == ("warn", None, "warn")


def test_strong_actions_repeat_only_after_the_cooldown():
    s = settings("interrupt", poll=1)
    watch, first = decide(OverLimitEpisode(), True, 0.0, s)
    watch, again = decide(watch, True, 1.0, s)
    assert first == "interrupt" and again is None
    watch, later = decide(watch, True, s.cooldown, s)
    assert later == "interrupt"


def test_off_never_acts():
    assert decide(OverLimitEpisode(), True, 100.0, settings("off"))[1] is None


def test_worst_device_and_ungranted_devices_count_as_cap_zero():
    s = settings(slack="1GiB")
    assert worst_device({0: 4 * GiB}, {0: 4 * GiB}, s) is None
    assert worst_device({0: 6 * GiB, 1: 9 * GiB}, {0: 4 * GiB, 1: 4 * GiB}, s) == (1, 9 * GiB, 4 * GiB, 5 * GiB)
    assert worst_device({1: 2 * GiB}, {0: 4 * GiB}, s) == (1, 2 * GiB, 0, GiB)


def test_watchdog_records_actions_per_kernel_and_forgets_gone_kernels():
    dog = Watchdog(settings("restart"))
    caps = {"k1": {0: 4 * GiB}, "k2": {0: 4 * GiB}}
    actions = dog.review({"k1": {0: 6 * GiB}, "k2": {0: GiB}, "stranger": {0: 50 * GiB}}, caps, now=1.0, wall=1000.0)
    assert [(a.kernel_id, a.action, a.used, a.cap, a.limit, a.outcome) for a in actions] == [
        ("k1", "restart", 6 * GiB, 4 * GiB, 5 * GiB, "pending")
    ]
    done = dog.finished(actions[0], "done")
    assert dog.last_action("k1") == done and list(dog.history) == [done]
    assert dog.last_action("k2") is None
    dog.forget("k1")
    assert dog.last_action("k1") is None and list(dog.history) == [done]


def test_usage_not_proven_to_be_the_kernels_gets_a_warning_at_most():
    for enforce in ("interrupt", "restart", "kill"):
        s = settings(enforce)
        watch, first = decide(OverLimitEpisode(), True, 0.0, s, proven=False)
        watch, second = decide(watch, True, 1.0, s, proven=False)
        assert (first, second) == ("warn", None)  # once per episode, like enforce="warn"
        watch, third = decide(watch, True, 2.0, s, proven=True)  # now its own tree is over too
        assert third == enforce
    assert decide(OverLimitEpisode(), True, 0.0, settings("off"), proven=False)[1] is None


def test_review_acts_on_the_process_tree_and_only_warns_on_the_rest():
    dog = Watchdog(settings("kill"))
    caps = {"k1": {0: 4 * GiB}, "k2": {0: 4 * GiB}}
    usage = {"k1": {0: 6 * GiB}, "k2": {0: 6 * GiB}}
    in_tree = {"k1": {0: 6 * GiB}, "k2": {0: GiB}}  # k2 is over only with processes found by environment
    actions = dog.review(usage, caps, now=1.0, wall=1000.0, in_tree=in_tree)
    assert [(a.kernel_id, a.action, a.attributed) for a in actions] == [
        ("k1", "kill", "tree"),
        ("k2", "warn", "environment"),
    ]
    assert "never interrupts, restarts or kills" in actions[1].describe()
    assert actions[1].to_json()["attributed"] == "environment"
