"""The sidebar's TypeScript types (labextension/src/contract.ts) declare every field of the status answer
and of the usage history that shared.contract lists: a field added to the contract without the types fails
here."""

import re
from pathlib import Path

import pytest

from gpu_quota_ext.shared import contract
from gpu_quota_ext.shared.park_state import ParkState

CONTRACT_TS = Path(__file__).resolve().parents[2] / "labextension" / "src" / "contract.ts"

# TypeScript interface -> the contract's fields it must declare.
MIRRORS = {
    "IQuotaStatus": contract.STATUS_FIELDS,
    "IHostMemory": contract.HOST_MEMORY_FIELDS,
    "IDeviceStatus": contract.STATUS_DEVICE_FIELDS,
    "IDeviceShare": contract.DEVICE_SHARE_FIELDS,
    "IKernelStatus": contract.KERNEL_FIELDS,
    "IKernelDevice": contract.KERNEL_DEVICE_FIELDS,
    "IKernelPark": contract.PARK_FIELDS,
    "IKernelParkPath": contract.PARK_PATH_FIELDS,
    "IReason": contract.REASON_FIELDS,
    "IStatusReasons": contract.STATUS_REASONS,
    "IKernelReasons": contract.KERNEL_REASONS,
    "IHistoryAnswer": contract.HISTORY_FIELDS,
    "IKernelHistoryAnswer": contract.KERNEL_HISTORY_FIELDS,
    "IHistoryPoint": contract.HISTORY_POINT_FIELDS,
}


def declared_fields(source: str, interface: str) -> set:
    """The property names declared in `export interface NAME { ... }` (flat interfaces, as contract.ts has)."""
    match = re.search(r"export interface %s \{(.*?)\n\}" % re.escape(interface), source, re.S)
    assert match, f"{interface} is not declared in {CONTRACT_TS.name}"
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", match.group(1), flags=re.S)  # comments may name fields too
    return set(re.findall(r"^\s*(\w+)\??\s*:", body, re.M))


@pytest.mark.parametrize("interface", sorted(MIRRORS))
def test_the_typescript_status_types_declare_every_contract_field(interface):
    fields = declared_fields(CONTRACT_TS.read_text(), interface)
    missing = [name for name in MIRRORS[interface] if name not in fields]
    assert not missing, f"{interface} in {CONTRACT_TS.name} lacks {missing} (shared/contract.py lists them)"


def test_every_kernel_declares_its_park_object():
    # The contract names the kernel's "park" object in words (PARK_FIELDS, "each kernel's park").
    fields = declared_fields(CONTRACT_TS.read_text(), "IKernelStatus")
    assert "park" in fields
    assert re.search(r"^\s*park\??\s*:\s*IKernelPark\b", CONTRACT_TS.read_text(), re.M)


def string_constant(source: str, name: str) -> str:
    match = re.search(r"export const %s = '([^']*)';" % re.escape(name), source)
    assert match, f"{name} is not declared in {CONTRACT_TS.name}"
    return match.group(1)


def test_the_park_and_history_routes_are_the_contracts():
    source = CONTRACT_TS.read_text()
    assert string_constant(source, "PARK_SUFFIX") == contract.PARK_SUFFIX
    assert string_constant(source, "RESUME_SUFFIX") == contract.RESUME_SUFFIX
    assert string_constant(source, "HISTORY_SUFFIX") == contract.HISTORY_SUFFIX
    assert contract.HISTORY_PATH == contract.API_PREFIX + "/" + contract.HISTORY_SUFFIX  # the sidebar joins them
    assert string_constant(source, "HISTORY_SINCE") == contract.HISTORY_SINCE


def declared_park_states(source: str) -> list:
    """(NAME, word) of `export const ParkState = { NAME: 'word', ... } as const;`, in order."""
    match = re.search(r"export const ParkState = \{(.*?)\} as const;", source, re.S)
    assert match, f"ParkState is not declared in {CONTRACT_TS.name}"
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", match.group(1), flags=re.S)
    return re.findall(r"^\s*(\w+)\s*:\s*'([^']*)'\s*,?\s*$", body, re.M)


def test_the_park_states_are_one_enum_on_the_wire_in_python_and_in_typescript():
    source = CONTRACT_TS.read_text()
    assert declared_park_states(source) == [(state.name, state.value) for state in ParkState]
    assert contract.PARK_STATES == tuple(state.value for state in ParkState)
    # The sidebar's list of words is the enum's, not a second list that could drift from it.
    assert re.search(r"export const PARK_STATES: readonly ParkState\[\] = Object\.values\(ParkState\);", source)


def test_the_park_states_parser_sees_a_changed_word():
    source = "export const ParkState = {\n  BUSY: 'busy',\n  // OLD: 'old',\n  IDLE: 'idle2'\n} as const;\n"
    assert declared_park_states(source) == [("BUSY", "busy"), ("IDLE", "idle2")]


def test_the_parser_sees_a_missing_field():
    source = "export interface IX {\n  a: number;\n  // b: number;\n  c?: string | null;\n}\n"
    assert declared_fields(source, "IX") == {"a", "c"}
