"""The sidebar's TypeScript types (labextension/src/state.ts) declare every field of the status answer
that shared.contract lists: a field added to the contract without the types fails here."""

import re
from pathlib import Path

import pytest

from gpu_quota_ext.shared import contract

STATE_TS = Path(__file__).resolve().parents[2] / "labextension" / "src" / "state.ts"

# TypeScript interface -> the contract's fields it must declare.
MIRRORS = {
    "IQuotaStatus": contract.STATUS_FIELDS,
    "IDeviceStatus": contract.STATUS_DEVICE_FIELDS,
    "IKernelStatus": contract.KERNEL_FIELDS,
    "IKernelDevice": contract.KERNEL_DEVICE_FIELDS,
}


def declared_fields(source: str, interface: str) -> set:
    """The property names declared in `export interface NAME { ... }` (flat interfaces, as state.ts has)."""
    match = re.search(r"export interface %s \{(.*?)\n\}" % re.escape(interface), source, re.S)
    assert match, f"{interface} is not declared in {STATE_TS.name}"
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", match.group(1), flags=re.S)  # comments may name fields too
    return set(re.findall(r"^\s*(\w+)\??\s*:", body, re.M))


@pytest.mark.parametrize("interface", sorted(MIRRORS))
def test_the_typescript_status_types_declare_every_contract_field(interface):
    fields = declared_fields(STATE_TS.read_text(), interface)
    missing = [name for name in MIRRORS[interface] if name not in fields]
    assert not missing, f"{interface} in {STATE_TS.name} lacks {missing} (shared/contract.py lists them)"


def test_the_parser_sees_a_missing_field():
    source = "export interface IX {\n  a: number;\n  // b: number;\n  c?: string | null;\n}\n"
    assert declared_fields(source, "IX") == {"a", "c"}
