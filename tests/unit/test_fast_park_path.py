"""Which way each kernel parks (gpu_quota_ext/parking/path.py): the fast path only for a torch kernel whose
memory the library holds, the checkpoint path for everything else, each time with a reason a user can read."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpu_quota_ext.parking.path import (
    CHECKPOINT,
    CONTEXT_ALLOWANCE,
    FOREIGN_TOLERANCE,
    PAGES,
    KernelFacts,
    arena_bytes,
    choose_path,
    host_need,
    keep_arena,
    kernel_facts,
    resume_deferred_reason,
)
from gpu_quota_ext.shared.sizes import GiB, MiB

# A torch kernel holding 20 GiB through the library, its context beside it.
TORCH_KERNEL = KernelFacts(
    fast_park="on",
    preloaded=True,
    torch_cuda=True,
    served_bytes=20 * GiB,
    process_bytes=20 * GiB + 520 * MiB,
)


def test_a_torch_kernel_with_the_library_parks_its_pages_and_says_what_stays():
    chosen = choose_path(TORCH_KERNEL)
    assert chosen.path == PAGES
    assert chosen.stays_on_device == 520 * MiB
    assert "20.0 GiB" in chosen.reason and "520.0 MiB" in chosen.reason


@pytest.mark.parametrize(
    "change, words",
    [
        ({"fast_park": "off"}, "fast_park is off"),
        ({"answered": False}, "did not say what it holds"),
        ({"preloaded": False}, "started without the fast park library"),
        ({"library_problem": "libcuda.so.1 cannot be loaded"}, "serves nothing in this kernel: libcuda.so.1"),
        ({"torch_cuda": False}, "no torch on the GPU"),
        ({"allocator_backend": "cudaMallocAsync"}, "cudaMallocAsync allocator"),
        ({"expandable_segments": True}, "expandable segments"),
        ({"gpu_processes": 2}, "2 processes of this kernel"),
        ({"devices": 2}, "on 2 devices"),
        ({"process_bytes": 20 * GiB + CONTEXT_ALLOWANCE + GiB}, "1.0 GiB on the device are held outside"),
        ({"served_bytes": 30 * GiB}, "says the fast park library maps 30.0 GiB, more than its processes hold"),
    ],
)
def test_every_other_kernel_takes_the_checkpoint_path_with_its_reason(change, words):
    chosen = choose_path(replace(TORCH_KERNEL, **change))
    assert chosen.path == CHECKPOINT
    assert words in chosen.reason
    assert chosen.stays_on_device == 0  # the driver moves the whole process


def test_a_little_held_outside_the_library_still_parks_fast_and_is_counted_as_staying():
    near = replace(TORCH_KERNEL, process_bytes=20 * GiB + CONTEXT_ALLOWANCE + 100 * MiB)
    chosen = choose_path(near)
    assert chosen.path == PAGES
    assert chosen.stays_on_device == CONTEXT_ALLOWANCE + 100 * MiB


def test_a_kernel_that_grew_a_little_since_the_sample_still_parks_fast():
    # torch may cache a little more between NVML's sample and the kernel's answer: within the tolerance, believed
    grown = replace(TORCH_KERNEL, served_bytes=20 * GiB + 520 * MiB + 200 * MiB)
    chosen = choose_path(grown)
    assert chosen.path == PAGES
    assert chosen.stays_on_device == 0


def test_the_default_kernel_is_not_fast():
    assert choose_path(KernelFacts()).path == CHECKPOINT


def test_the_arena_has_slack_and_is_kept_only_with_the_hosts_margin_beside_it():
    assert arena_bytes(20 * GiB) > 20 * GiB
    assert keep_arena(20 * GiB, host_available=40 * GiB, host_margin=2 * GiB)
    assert not keep_arena(20 * GiB, host_available=21 * GiB, host_margin=2 * GiB)


# What the kernel answers to {"action": "facts"} (kernel/fast_park.py) for a torch kernel holding 20 GiB.
ANSWER = {
    "preloaded": True,
    "library_problem": None,
    "torch_cuda": True,
    "allocator_backend": "native",
    "expandable_segments": False,
    "served_bytes": 20 * GiB,
    "arena_bytes": 0,
    "state": "running",
}


def test_the_facts_join_the_kernels_answer_and_the_samples():
    facts = kernel_facts("on", ANSWER, {0: 20 * GiB + 520 * MiB, 1: 0}, 1)
    assert facts == TORCH_KERNEL  # a device it holds nothing on is not one of its devices
    assert choose_path(kernel_facts("on", ANSWER, {0: 20 * GiB, 1: GiB}, 1)).reason.endswith(
        "maps one device's memory only"
    )
    assert "2 processes" in choose_path(kernel_facts("on", ANSWER, {0: 21 * GiB}, 2)).reason


@pytest.mark.parametrize(
    "answer, words",
    [
        (None, "did not say what it holds"),
        ({"error": "unknown action 'facts'"}, "did not say what it holds"),  # a kernel of an older version
        ({**ANSWER, "preloaded": False}, "started without the fast park library"),
        ({**ANSWER, "library_problem": "libcuda.so.1 cannot be loaded"}, "libcuda.so.1 cannot be loaded"),
        ({**ANSWER, "torch_cuda": False, "served_bytes": 0}, "no torch on the GPU"),
        ({**ANSWER, "allocator_backend": "cudaMallocAsync"}, "cudaMallocAsync"),
        ({**ANSWER, "served_bytes": "20 GiB"}, "held outside torch's allocator"),  # nonsense counts nothing
        ({**ANSWER, "served_bytes": 2**62}, "not believed"),  # a lie larger than what NVML sees it hold
    ],
)
def test_answers_that_do_not_show_a_torch_kernel_with_the_library_take_the_checkpoint_path(answer, words):
    chosen = choose_path(kernel_facts("on", answer, {0: 20 * GiB + 520 * MiB}, 1))
    assert chosen.path == CHECKPOINT
    assert words in chosen.reason


@pytest.mark.parametrize("beyond, path", [(0, PAGES), (1, CHECKPOINT)])
def test_a_report_above_what_nvml_sees_is_believed_up_to_the_tolerance_and_not_a_byte_more(beyond, path):
    # torch may cache a little more between NVML's sample and the kernel's answer: up to FOREIGN_TOLERANCE.
    held = 20 * GiB
    answer = {**ANSWER, "served_bytes": held + FOREIGN_TOLERANCE + beyond}
    chosen = choose_path(kernel_facts("on", answer, {0: held}, 1))
    assert chosen.path == path, chosen
    assert (chosen.reason is not None and "not believed" in chosen.reason) == (path == CHECKPOINT)


def test_with_fast_park_off_the_answer_is_not_read():
    facts = kernel_facts("off", ANSWER, {0: 20 * GiB}, 1)
    assert not facts.preloaded and choose_path(facts).reason == "fast_park is off"


def test_the_host_gives_a_new_arena_or_nothing_when_the_kernel_keeps_one_big_enough():
    assert host_need(20 * GiB, 0) == arena_bytes(20 * GiB)
    assert host_need(20 * GiB, arena_bytes(20 * GiB)) == 0
    assert host_need(20 * GiB, 20 * GiB) == 0
    assert host_need(20 * GiB, 10 * GiB) == arena_bytes(20 * GiB) - 10 * GiB  # the old one is freed first


def test_a_fast_resume_that_failed_says_nothing_was_lost():
    words = resume_deferred_reason(2, "cannot resume: CUDA_ERROR_OUT_OF_MEMORY (2)", 20 * GiB)
    assert "no room for its 20.0 GiB" in words and "nothing was lost" in words and "parked" in words
    assert "the fast resume failed" in resume_deferred_reason(700, "cuMemcpyHtoDAsync failed", GiB)
