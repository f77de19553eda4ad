"""The %gpucap grammar, without a kernel: examples from the issue, then hypothesis fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_quota_ext.kernel.command import Command, CommandError, help_text, parse_command
from gpu_quota_ext.shared.sizes import GiB


@pytest.mark.parametrize(
    "line, expected",
    [
        ("", Command("show")),
        ("   ", Command("show")),
        ("reset", Command("reset")),
        ("panel", Command("panel")),
        ("--help", Command("help")),
        ("-h", Command("help")),
        ("help", Command("help")),
        ("--cells on", Command("cells", cells=True)),
        ("--cells off", Command("cells", cells=False)),
    ],
)
def test_commands_without_a_cap(line, expected):
    assert parse_command(line, [0]) == expected


@pytest.mark.parametrize(
    "line, fraction, nbytes, ordinal",
    [
        ("0.3", 0.3, None, None),
        ("30%", 0.3, None, None),
        ("12GiB", None, 12 * GiB, None),
        ("12GB", None, 12 * 10**9, None),
        ("--device 1 8GiB", None, 8 * GiB, 1),
        ("8GiB --device 1", None, 8 * GiB, 1),
        ("-d 0 1", 1.0, None, 0),
    ],
)
def test_caps(line, fraction, nbytes, ordinal):
    command = parse_command(line, [0, 1])
    assert command.action == "set"
    assert command.cap.fraction == fraction and command.cap.nbytes == nbytes
    assert command.ordinal == ordinal


@pytest.mark.parametrize(
    "line, says",
    [
        ("abc", "is not a cap"),
        ("1.5", "at most 1"),
        ("-1", "is not a cap"),
        ("0", "above 0"),
        ("999TiB", "larger than any GPU"),
        ("--device 7 0.3", "no cuda:7"),
        ("--device -1 0.3", "from 0"),
        ("0.3 0.4", "unrecognized arguments"),
        ("--device 1", "needs a cap"),
        ("reset --device 0", "cannot be used with 'reset'"),
        ("help --device 0", "cannot be used with 'help'"),
        ("--cells maybe", "invalid choice"),
        ("--cells on 0.3", "stands alone"),
        ('"0.3', "cannot read"),
        ("--bogus", "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line(line, says):
    with pytest.raises(CommandError) as error:
        parse_command(line, [0])
    message = str(error.value)
    assert says in message
    assert "\n" not in message


def test_any_device_is_accepted_when_the_kernel_does_not_know_its_devices():
    assert parse_command("--device 5 0.3", None).ordinal == 5


def test_help_names_every_form():
    text = help_text()
    for form in ("%gpucap 0.3", "%gpucap --device 1 8GiB", "%gpucap reset", "%gpucap panel", "--cells", "%gpucap help"):
        assert form in text
    assert not text.startswith("::")


def test_the_magics_docstring_is_its_usage_and_description_in_both_the_stand_in_and_the_full_magic():
    from gpu_quota_ext.kernel.help import DESCRIPTION, DOCSTRING, USAGE
    from gpu_quota_ext.kernel.magic import GpuCap
    from gpu_quota_ext.kernel.stub import GpuCapStub

    assert GpuCapStub.magic.__doc__ == GpuCap.magic.__doc__ == DOCSTRING
    assert DOCSTRING.startswith(USAGE) and DESCRIPTION in help_text()


TOKENS = ["--device", "-d", "--cells", "--help", "-h", "help", "on", "off", "reset", "panel", "0", "1", "7", "-1",
          "0.3", "30%", "12GiB", "12GB", "1.5", "999TiB", "abc", '"', "'", "--", "-", "%", "nan", "inf", "1e3"]


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(st.sampled_from(TOKENS), max_size=5).map(" ".join), st.text(max_size=40)))
def test_fuzzed_lines_give_a_command_or_one_error_line(line):
    try:
        command = parse_command(line, [0, 1])
    except CommandError as error:
        assert str(error) and "\n" not in str(error)
        return
    assert command.action in ("show", "set", "reset", "panel", "help", "cells")
    if command.action == "set":
        assert command.cap is not None and command.ordinal in (None, 0, 1)
        assert 0 < (command.cap.fraction or 0) <= 1 or (command.cap.nbytes or 0) >= 1 << 20
