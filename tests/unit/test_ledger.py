"""Grants, admission, placement and cap changes: pure, no server."""

import threading

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.ledger import AdmissionRefused, UnknownKernel
from gpu_quota_ext.ledger.local import LocalLedger
from gpu_quota_ext.policy import build_policy, resolve
from gpu_quota_ext.shared.sizes import GiB, PolicyError, parse_cap

TWO_GPUS = [Device(0, "GPU 0", "GPU-a", 80 * GiB, 0), Device(1, "GPU 1", "GPU-b", 80 * GiB, 1)]


def make(devices=TWO_GPUS, **settings):
    policy = build_policy(settings.pop("default_cap", "0.25"), settings.pop("max_cap", "0.5"), **settings)
    return LocalLedger(devices, policy), policy


def admit(ledger, policy, kernel_id, user="u", kernelspec="python3"):
    return ledger.grant(kernel_id, user, kernelspec, resolve(policy, user, kernelspec))


def test_spread_puts_each_new_kernel_on_the_least_granted_gpu():
    ledger, policy = make()
    placed = [admit(ledger, policy, f"k{i}").devices for i in range(4)]
    assert placed == [(0,), (1,), (0,), (1,)]
    assert [d["granted"] for d in ledger.device_grants()] == [40 * GiB, 40 * GiB]


def test_pack_fills_gpu0_up_to_its_budget_first():
    ledger, policy = make(overcommit=1.0, placement="pack")
    placed = [admit(ledger, policy, f"k{i}").devices for i in range(6)]
    assert placed == [(0,)] * 4 + [(1,)] * 2


def test_placement_none_caps_every_device_and_sets_no_placement():
    ledger, policy = make(placement="none")
    grant = admit(ledger, policy, "k")
    assert grant.devices == (0, 1) and not grant.placed
    assert grant.caps == {0: 20 * GiB, 1: 20 * GiB}


def test_a_restarted_kernel_keeps_its_grant_and_release_frees_budget():
    ledger, policy = make(overcommit=1.0)
    first = admit(ledger, policy, "k")
    ledger.change("k", parse_cap("0.4"))
    again = admit(ledger, policy, "k")  # what pre_launch does on restart
    assert again.devices == first.devices and again.caps[first.devices[0]] == int(0.4 * 80 * GiB)
    assert ledger.release("k") is not None
    assert ledger.release("k") is None  # idempotent
    assert ledger.get("k") is None
    assert [d["granted"] for d in ledger.device_grants()] == [0, 0]


@pytest.mark.parametrize("on_full", ["refuse", "cpu-only"])
def test_a_full_machine_refuses_or_hides_the_gpus(on_full):
    ledger, policy = make(overcommit=0.5, on_full=on_full)
    for i in range(4):
        assert admit(ledger, policy, f"k{i}").devices
    if on_full == "refuse":
        with pytest.raises(AdmissionRefused, match="no GPU has 0.25 of budget left"):
            admit(ledger, policy, "k-late")
        assert ledger.get("k-late") is None
    else:
        grant = admit(ledger, policy, "k-late")
        assert grant.devices == () and grant.placed and "budget" in grant.cpu_only_reason
    assert all(d["granted"] <= d["budget"] for d in ledger.device_grants())


def test_concurrent_grants_never_overcommit():
    ledger, policy = make(overcommit=1.0, on_full="cpu-only")
    barrier = threading.Barrier(40)

    def start(i):
        barrier.wait()
        admit(ledger, policy, f"k{i}")

    threads = [threading.Thread(target=start, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    on_gpu = [g for g in ledger.grants() if g.devices]
    assert len(on_gpu) == 8  # 2 devices x budget 80 GiB / 20 GiB caps
    assert all(d["granted"] <= d["budget"] for d in ledger.device_grants())


def test_change_within_max_is_granted():
    ledger, policy = make()
    admit(ledger, policy, "k")
    outcome = ledger.change("k", parse_cap("0.4"))
    assert outcome.status == "granted"
    assert outcome.grant.caps == {0: int(0.4 * 80 * GiB)}
    assert outcome.grant.source == "kernel request"
    assert ledger.get("k") == outcome.grant


def test_change_above_max_is_clamped_or_refused_as_configured():
    ledger, policy = make(on_over_max="clamp")
    admit(ledger, policy, "k")
    clamped = ledger.change("k", parse_cap("0.9"))
    assert clamped.status == "clamped" and clamped.grant.caps == {0: 40 * GiB}
    assert "max_cap" in clamped.message

    ledger, policy = make(on_over_max="refuse")
    before = admit(ledger, policy, "k")
    refused = ledger.change("k", parse_cap("0.9"))
    assert refused.status == "refused" and "max_cap" in refused.message
    assert ledger.get("k") == before


def test_change_is_bounded_by_the_device_budget():
    ledger, policy = make(devices=TWO_GPUS[:1], overcommit=1.0, max_cap="1.0")
    admit(ledger, policy, "a")
    admit(ledger, policy, "b")  # 40 GiB granted, 40 GiB left
    outcome = ledger.change("a", parse_cap("1.0"))
    assert outcome.status == "clamped" and outcome.grant.caps == {0: 60 * GiB}
    assert ledger.device_grants()[0]["granted"] == 80 * GiB
    assert ledger.change("b", parse_cap("0.5")).status == "refused"


def test_reset_returns_to_the_policy_cap():
    ledger, policy = make()
    admit(ledger, policy, "k")
    ledger.change("k", parse_cap("0.4"))
    outcome = ledger.reset("k")
    assert outcome.status == "granted"
    assert outcome.grant.caps == outcome.grant.policy_caps == {0: 20 * GiB}


@pytest.mark.parametrize(
    "on_over_max, status, cap_after", [("clamp", "clamped", 10 * GiB), ("refuse", "refused", 8 * GiB)]
)
def test_reset_cannot_take_budget_another_kernel_took_meanwhile(on_over_max, status, cap_after):
    ledger, policy = make(devices=TWO_GPUS[:1], overcommit=0.5, max_cap="0.5", on_over_max=on_over_max)
    admit(ledger, policy, "a")  # 20 GiB of a 40 GiB budget
    admit(ledger, policy, "b")  # 20 GiB: full
    ledger.change("a", parse_cap("8GiB"))  # a gives back 12 GiB
    assert ledger.change("b", parse_cap("0.375")).status == "granted"  # b takes 10 of them (30 GiB)
    outcome = ledger.reset("a")  # 20 GiB would need 12 more; 2 are left
    assert outcome.status == status
    assert ledger.get("a").caps == {0: cap_after}
    assert ledger.device_grants()[0]["granted"] <= ledger.device_grants()[0]["budget"]


def test_a_kernelspec_pinned_to_an_unmanaged_gpu_is_handled_as_full():
    ledger, policy = make(on_full="cpu-only")
    grant = ledger.grant("k", "u", "pinned", resolve(policy, "u", "pinned"), allowed=[])
    assert grant.devices == () and grant.placed and "does not manage" in grant.cpu_only_reason
    ledger, policy = make(on_full="refuse")
    with pytest.raises(AdmissionRefused, match="does not manage"):
        ledger.grant("k", "u", "pinned", resolve(policy, "u", "pinned"), allowed=[])


def test_change_errors():
    ledger, policy = make()
    with pytest.raises(UnknownKernel):
        ledger.change("nope", parse_cap("0.3"))
    admit(ledger, policy, "k")
    with pytest.raises(PolicyError, match="not one of this kernel's devices"):
        ledger.change("k", parse_cap("0.3"), device=1)
    ledger, policy = make(devices=[])
    admit(ledger, policy, "cpu")
    with pytest.raises(PolicyError, match="runs on CPU"):
        ledger.change("cpu", parse_cap("0.3"))


def test_rule_asking_for_two_devices_gets_a_cap_on_each():
    ledger, policy = make(caps=[{"kernelspec": "multi", "cap": "0.25", "devices": 2}])
    grant = admit(ledger, policy, "k", kernelspec="multi")
    assert grant.devices == (0, 1) and grant.caps == {0: 20 * GiB, 1: 20 * GiB}


def test_allowed_devices_narrow_placement():
    ledger, policy = make()
    grant = ledger.grant("k", "u", "python3", resolve(policy, "u", "python3"), allowed=[1])
    assert grant.devices == (1,)


def test_lowering_a_cap_is_always_granted_even_on_an_overfull_device():
    # An admin lowered overcommit and restarted nothing: the device holds more than its budget now.
    ledger, policy = make(devices=TWO_GPUS[:1], overcommit=1.0, max_cap="1.0")
    admit(ledger, policy, "a")
    ledger.change("a", parse_cap("1.0"))
    ledger._books[0].budget = 40 * GiB  # over budget by 40 GiB
    outcome = ledger.change("a", parse_cap("0.75"))
    assert outcome.status == "granted" and outcome.grant.caps == {0: 60 * GiB}


def test_a_clamped_reset_says_who_asked_and_what_was_left():
    # Issue 10, item 12: the admin's reset is recorded as theirs, and "left" is the budget that was left.
    ledger, policy = make(devices=TWO_GPUS[:1], overcommit=0.5, max_cap="0.5")
    admit(ledger, policy, "a")  # 20 GiB of a 40 GiB budget
    admit(ledger, policy, "b")  # full
    ledger.change("a", parse_cap("8GiB"))  # 12 GiB back
    ledger.change("b", parse_cap("0.375"))  # b takes 10 of them: 2 GiB left
    outcome = ledger.reset("a", source="user request")
    assert outcome.status == "clamped"
    assert outcome.message == "clamped to 10.0 GiB: only 2.0 GiB of device 0's budget was left"
    assert outcome.grant.source == "user request (reset, clamped to the budget)"
    # A reset that fits is the policy's cap again, whoever asked.
    ledger.change("b", parse_cap("8GiB"))
    assert ledger.reset("a", source="user request").grant.source == "policy"


def test_a_change_clamped_by_the_budget_names_the_cap_and_what_was_left():
    ledger, policy = make(devices=TWO_GPUS[:1], overcommit=1.0, max_cap="1.0")
    admit(ledger, policy, "a")
    admit(ledger, policy, "b")  # 40 GiB left
    outcome = ledger.change("a", parse_cap("1.0"), source="user request")
    assert outcome.message == "clamped to 60.0 GiB: only 40.0 GiB of device 0's budget was left"
    assert outcome.grant.source == "user request"


def test_a_fraction_below_one_mib_on_a_device_is_refused_where_it_becomes_bytes():
    # Issue 10, item 3: 1e-7 of 80 GiB is 8.4 KiB. Fine as a fraction, no use as a cap.
    ledger, policy = make(default_cap="0.0000001")
    with pytest.raises(PolicyError, match=r"device 0 \(80.0 GiB\) is 8.4 KiB: a cap must be at least 1 MiB"):
        admit(ledger, policy, "k")
    assert ledger.grants() == [] and ledger.device_grants()[0]["granted"] == 0
    ledger, policy = make()
    before = admit(ledger, policy, "k")
    with pytest.raises(PolicyError, match="at least 1 MiB"):
        ledger.change("k", parse_cap("0.0000001"))
    assert ledger.get("k") == before
    # 1 MiB exactly is a cap.
    assert ledger.change("k", parse_cap("1MiB")).grant.caps == {before.devices[0]: 1 << 20}


def test_a_cap_never_exceeds_max_cap_even_written_in_another_form():
    # 12 GiB against a max_cap of 0.1 x 80 GiB = 8 GiB: comparable only on the device.
    ledger, policy = make(default_cap="12GiB", max_cap="0.1")
    grant = admit(ledger, policy, "k")
    assert grant.caps == {0: int(0.1 * 80 * GiB)} and grant.max_caps == {0: int(0.1 * 80 * GiB)}


def test_local_ledger_implements_the_ledger_interface():
    from gpu_quota_ext.ledger import Ledger

    ledger, _ = make()
    assert isinstance(ledger, Ledger)
    # Every method of the interface has the same parameters in the local ledger.
    import inspect

    for name in (
        "grant", "change", "reset", "release", "get", "grants", "device_grants", "decided_by", "host_service", "close"
    ):
        expected = list(inspect.signature(getattr(Ledger, name)).parameters)
        assert list(inspect.signature(getattr(LocalLedger, name)).parameters) == expected, name
