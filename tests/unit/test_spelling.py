"""A name nobody knows is named with the known name most like it (issue 31 item 1): the words that
`jupyter gpu-quota check`, the server's warning, a caps rule and the hub's mapping all use."""

import pytest

from gpu_quota_ext.app import GpuQuota
from gpu_quota_ext.hub.caps import hub_caps
from gpu_quota_ext.policy import build_policy
from gpu_quota_ext.shared.sizes import PolicyError
from gpu_quota_ext.shared.spelling import closest, did_you_mean, unknown_settings

SETTINGS = GpuQuota.class_trait_names(config=True)


@pytest.mark.parametrize(
    "name, meant",
    [
        ("default_caps", "default_cap"),
        ("max_cab", "max_cap"),
        ("overcomit", "overcommit"),
        ("park_idle_afer", "park_idle_after"),
        ("enforcement", "enforce"),
        ("colour", None),  # nothing like it: no guess is better than a wrong one
    ],
)
def test_the_closest_setting_is_the_one_meant(name, meant):
    assert closest(name, SETTINGS) == meant


def test_one_unknown_name_gets_one_guess_and_several_each_their_own():
    known = ["default_cap", "max_cap", "placement"]
    assert did_you_mean(["default_caps"], known) == "; did you mean `default_cap`?"
    assert did_you_mean(["default_caps", "placment", "xyz"], known) == (
        "; did you mean `default_cap` for `default_caps`, `placement` for `placment`?"
    )
    assert did_you_mean(["xyz"], known) == ""


def test_a_config_section_names_each_unknown_setting_and_leaves_subsections_alone():
    section = {"default_cap": "0.3", "default_caps": "0.3", "Sub": {}, "max_cab": "0.5"}
    assert unknown_settings("GpuQuota", section, SETTINGS) == [
        "c.GpuQuota.default_caps is not a setting of GpuQuota; did you mean `default_cap`?",
        "c.GpuQuota.max_cab is not a setting of GpuQuota; did you mean `max_cap`?",
    ]
    assert unknown_settings("GpuQuota", {"default_cap": "0.3"}, SETTINGS) == []


def test_the_extension_finds_them_in_a_config_and_nowhere_else():
    from traitlets.config import Config

    config = Config()
    config.GpuQuota.default_caps = 0.3
    config.ServerApp.default_caps = 0.3  # another class's section: its own class judges it
    assert GpuQuota.unknown_settings(config) == [
        "c.GpuQuota.default_caps is not a setting of GpuQuota; did you mean `default_cap`?"
    ]
    assert GpuQuota.unknown_settings(Config()) == []


def test_a_caps_rule_with_a_misspelt_key_names_the_key_meant():
    with pytest.raises(PolicyError, match=r"caps\[0\] has unknown keys \['kernelspecs'\].*did you mean `kernelspec`\?"):
        build_policy("0.25", "1.0", caps=[{"kernelspecs": "big-*", "cap": "0.5"}])


@pytest.mark.parametrize(
    "mapping, words",
    [
        ({"default": {"default_caps": "0.3"}}, "default has unknown keys ['default_caps']"),
        ({"groups": {"staff": {"max_cpa": "0.5"}}}, "groups['staff'] has unknown keys ['max_cpa']"),
        ({"users": {"alice": {"placment": "pack"}}}, "users['alice'] has unknown keys ['placment']"),
    ],
)
def test_the_hubs_mapping_names_the_key_meant(mapping, words):
    with pytest.raises(PolicyError) as caught:
        hub_caps(**mapping)
    meant = {"default_caps": "default_cap", "max_cpa": "max_cap", "placment": "placement"}
    (key,) = [key for key in meant if key in words]
    assert words in str(caught.value) and str(caught.value).endswith(f"did you mean `{meant[key]}`?")


def test_a_misspelt_variable_is_named_with_the_one_meant_and_others_are_left_alone():
    from gpu_quota_ext.shared.spelling import unknown_variables

    meant = ["GPU_QUOTA_DEFAULT_CAP", "GPU_QUOTA_MAX_CAP", "GPU_QUOTA_ENFORCE"]
    environ = {
        "GPU_QUOTA_DEFAULT_CAPS": "0.3",  # misspelt
        "GPU_QUOTA_MAX_CAP": "0.5",  # read
        "GPU_QUOTA_KERNEL_ID": "k",  # read (by the kernel)
        "GPU_QUOTA_FIGURES": "/tmp/f",  # another tool's (the GPU tests'): like nothing of ours
        "DEFAULT_CAPS": "0.3",  # not ours at all
    }
    assert unknown_variables(environ, "GPU_QUOTA_", [*meant, "GPU_QUOTA_KERNEL_ID"], meant) == [
        "$GPU_QUOTA_DEFAULT_CAPS is set, but nothing reads it; did you mean `GPU_QUOTA_DEFAULT_CAP`?"
    ]
