"""What the service's request bodies may be (shared.service_contract), checked in one place: a table per body
(field -> what it must be, the one line that refuses anything else) and one function that reads a body by its
table, as JupyterHub's API handlers check theirs (`_check_model`). A body that is not what its table says: 400,
nothing done. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple, Union

from tornado import web

from ...shared.cap_request import read_cap_request
from ...shared.contract import PARK_STATES
from ...shared.service_contract import CONTEXT_ALLOWANCE, LEASE_RENEW, MAX_BYTES
from ...shared.sizes import CapSpec, PolicyError, shown
from .room import ParkReport

# ASCII letters, digits, - and _ only, matched whole: "$" alone lets a final newline through ("x\n" was granted and
# then answered 404), and \w lets every script's letters in; an id must be one its owner can fetch back.
KERNEL_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_NAME = 255
MAX_KERNELS = 4096
MAX_PIDS = 1024
MAX_DEVICES = 64  # devices one need names
MAX_IDLE = 10 * 365 * 86400.0  # seconds: ten years idle is the most a report may say

Check = Callable[[Any], bool]


# --- what a value may be ----------------------------------------------------------------------------------


def _text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_NAME


def _kernel_id(value: Any) -> bool:
    return _text(value) and KERNEL_ID.fullmatch(value) is not None


def _whole(low: int, below: int) -> Check:
    """A whole number (never a bool) from `low`, below `below`."""
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value < below


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(most: float, nullable: bool = False) -> Check:
    return lambda value: (nullable and value is None) or (_number(value) and 0 <= value <= most)


def _list(most: int, each: Check = lambda _: True) -> Check:
    return lambda value: isinstance(value, list) and len(value) <= most and all(each(item) for item in value)


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _uuids(value: Any) -> bool:
    return value is None or _list(64, _text)(value)


def _need(value: Any) -> bool:
    """Device uuid -> bytes, for at most MAX_DEVICES devices."""
    return (
        isinstance(value, dict)
        and len(value) <= MAX_DEVICES
        and all(_text(uuid) for uuid in value)
        and all(_whole(0, MAX_BYTES)(n) for n in value.values())
    )


# --- the tables -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field: what its value must be (`ok`), and the line that refuses another (`must`, formatted with the
    entry's `kernel` id and the `value` as shown). An absent field is None to `ok` unless it is `optional`,
    then it is `default`, unchecked. `each`: the model every item of the list is (checked after the list), with
    `twice` refusing a kernel named twice. `model`: the model a non-null value is."""

    ok: Check
    must: str
    optional: bool = False
    default: Any = None
    each: Optional["Model"] = None
    twice: Optional[str] = None
    model: Optional["Model"] = None


@dataclass(frozen=True)
class Model:
    """A JSON object's fields, in the order they are checked; `must`: the line refusing anything but such an
    object (or, with `exact`, one without every field that is not optional); `name_unknown`: say which fields are
    unknown instead."""

    fields: Mapping[str, Field]
    must: str
    exact: bool = False
    name_unknown: bool = False


def _string_must(key: str, pattern: bool = False) -> str:
    return f'"{key}" must be a string{" of letters, digits, - and _" if pattern else ""}, not {{value}}'


KERNEL_PARK = Model(
    {
        "kernel_id": Field(_kernel_id, _string_must("kernel_id", True)),
        "state": Field(lambda value: value in PARK_STATES, f"the park state of kernel {{kernel}} must be one of "
                       f"{', '.join(PARK_STATES)}"),
        "idle_for": Field(_seconds(MAX_IDLE, nullable=True), '"idle_for" of kernel {kernel} must be null or seconds, '
                          "not {value}", optional=True),
        "parkable": Field(_bool, '"parkable" of kernel {kernel} must be true or false',
                          optional=True, default=False),
        # A server's word: what a fast park leaves is a CUDA context, never more than the allowance for one.
        "stays": Field(_whole(0, CONTEXT_ALLOWANCE + 1), f'"stays" of kernel {{kernel}} must be bytes from 0 to '
                       f"{CONTEXT_ALLOWANCE}, not {{value}}", optional=True, default=0),
        # A server's word too: believed only while the service shows the kernel parking (room.py's docstring).
        "releases_as_copied": Field(_bool, '"releases_as_copied" of kernel {kernel} must be true or false, not {value}',
                                    optional=True, default=False),
    },
    'each "park" entry must be {"kernel_id": str, "state": str, "idle_for": seconds | null, "parkable": bool, '
    '"stays": bytes (optional), "releases_as_copied": bool (optional)}',
)
PARK_LIST = Field(
    _list(MAX_KERNELS),
    f'"park" must be a list of at most {MAX_KERNELS} KERNEL_PARK objects',
    each=KERNEL_PARK,
    twice="kernel {kernel} is reported twice",
)

GRANT = Model(
    {
        "server": Field(_text, _string_must("server")),
        "kernel_id": Field(_kernel_id, _string_must("kernel_id", True)),
        "kernelspec": Field(_text, _string_must("kernelspec")),
        "allowed": Field(_uuids, '"allowed" must be null or a list of device uuids', optional=True),
    },
    'the body must be a JSON object {"server", "kernel_id", "kernelspec", "allowed"}',
    name_unknown=True,
)

LEASE = Model(
    {
        "server": Field(_text, _string_must("server")),
        "kernels": Field(
            _list(MAX_KERNELS),
            '"kernels" must be a list of {{"kernel_id": str, "pids": [int, ...]}}',
            each=Model(
                {
                    "kernel_id": Field(_kernel_id, _string_must("kernel_id", True)),
                    "pids": Field(_list(MAX_PIDS, _whole(2, 2**31)), '"pids" of kernel {kernel} must be a list of '
                                  "process ids", optional=True, default=[]),
                },
                'each kernel must be {"kernel_id": str, "pids": [int, ...]}',
            ),
        ),
        "park": Field(PARK_LIST.ok, PARK_LIST.must, optional=True, each=KERNEL_PARK, twice=PARK_LIST.twice),
        "wait": Field(_seconds(LEASE_RENEW), f'"wait" must be a number of seconds from 0 to {LEASE_RENEW}, not '
                      "{value}", optional=True),
    },
    'the body must be a JSON object {"server": str, "kernels": [{"kernel_id": str, "pids": [int]}], '
    '"park": [KERNEL_PARK] (optional), "wait": seconds (optional)}',
)

HOST_PARK = Model(
    {
        "bytes": Field(_whole(0, MAX_BYTES), '"bytes" of "host_park" must be a whole number of bytes, not {value}'),
        "kernel_id": Field(_kernel_id, _string_must("kernel_id", True)),
    },
    '"host_park" must be {"kernel_id": str, "bytes": int}',
    exact=True,
)

ROOM = Model(
    {
        "host_park": Field(lambda _: True, "", optional=True, model=HOST_PARK),
        "server": Field(_text, _string_must("server")),
        "park": Field(PARK_LIST.ok, PARK_LIST.must, optional=True, default=[], each=KERNEL_PARK,
                      twice=PARK_LIST.twice),
        "demands": Field(
            _list(MAX_KERNELS),
            f'"demands" must be a list of at most {MAX_KERNELS} {{{{"kernel_id", "need"}}}} objects',
            optional=True,
            default=[],
            each=Model(
                {
                    "kernel_id": Field(_kernel_id, _string_must("kernel_id", True)),
                    "need": Field(_need, '"need" of kernel {kernel} must map device uuids to bytes'),
                    # A server's word: believed only of a kernel its server reported parked by the fast path (room.py).
                    "may_wait": Field(_bool, '"may_wait" of kernel {kernel} must be true or false, not {value}',
                                      optional=True, default=False),
                },
                'each demand must be {"kernel_id": str, "need": {uuid: bytes}, "may_wait": bool (optional)}',
                exact=True,
            ),
            twice="kernel {kernel} demands twice",
        ),
    },
    'the body must be a JSON object {"server": str, "park": [KERNEL_PARK], '
    '"demands": [{"kernel_id": str, "need": {uuid: bytes}, "may_wait": bool (optional)}], '
    '"host_park": {"kernel_id": str, "bytes": int}}',
)


# --- the one reader ---------------------------------------------------------------------------------------


def _refuse(message: str) -> web.HTTPError:
    return web.HTTPError(400, message)


def check_model(body: object, model: Model) -> Dict[str, Any]:
    """The body's fields as its model says, in the model's order (absent optional ones: their defaults); the
    first that is not what the model says: 400 with its line."""
    if not isinstance(body, dict):
        raise _refuse(model.must)
    unknown = sorted(set(body) - set(model.fields))
    if unknown and model.name_unknown:
        raise _refuse(f"unknown fields {shown(unknown)}")
    required = {key for key, field in model.fields.items() if not field.optional}
    if unknown or (model.exact and not required <= set(body)):
        raise _refuse(model.must)
    values: Dict[str, Any] = {}
    for key, field in model.fields.items():
        if key not in body and field.optional:
            values[key] = field.default
            continue
        value = body.get(key)
        if field.model is not None:
            values[key] = None if value is None else check_model(value, field.model)
            continue
        if not field.ok(value):
            raise _refuse(field.must.format(kernel=values.get("kernel_id"), value=shown(value)))
        values[key] = value if field.each is None else _each(value, field)
    return values


def _each(items: Any, field: Field) -> List[Dict[str, Any]]:
    assert field.each is not None
    entries: List[Dict[str, Any]] = []
    for item in items:
        entry = check_model(item, field.each)
        if field.twice is not None and any(e["kernel_id"] == entry["kernel_id"] for e in entries):
            raise _refuse(field.twice.format(kernel=entry["kernel_id"]))
        entries.append(entry)
    return entries


# --- each body, as the handlers take it -----------------------------------------------------------------------


def parse_grant_request(body: object) -> Tuple[str, str, str, Optional[List[str]]]:
    """(server, kernel id, kernelspec, the device uuids the kernel may have or None)."""
    values = check_model(body, GRANT)
    return values["server"], values["kernel_id"], values["kernelspec"], values["allowed"]


def parse_change_request(body: object) -> Union[str, Tuple[CapSpec, Optional[str]]]:
    """ "reset" or (CapSpec, device uuid or None): the contract of the server's own cap route (shared/)."""
    try:
        return read_cap_request(body, lambda d: isinstance(d, str) and len(d) <= MAX_NAME, "a device uuid or null")
    except PolicyError as error:
        raise _refuse(str(error)) from None


def _reports(entries: List[Dict[str, Any]]) -> Dict[str, ParkReport]:
    return {
        e["kernel_id"]: ParkReport(
            e["state"],
            None if e["idle_for"] is None else float(e["idle_for"]),
            e["parkable"],
            e["stays"],
            e["releases_as_copied"],
        )
        for e in entries
    }


def parse_park_reports(entries: object) -> Dict[str, ParkReport]:
    """The "park" list of a lease or a room call: KERNEL_PARK entries, one per kernel."""
    return _reports(check_model({"park": entries}, Model({"park": PARK_LIST}, PARK_LIST.must))["park"])


def parse_lease_request(
    body: object,
) -> Tuple[str, Dict[str, Tuple[int, ...]], Optional[Dict[str, ParkReport]], Optional[float]]:
    """(server, kernel id -> PIDs, its kernels' park reports or None, seconds to wait or None)."""
    values = check_model(body, LEASE)
    kernels = {entry["kernel_id"]: tuple(entry["pids"]) for entry in values["kernels"]}
    park = None if values["park"] is None else _reports(values["park"])
    wait = None if values["wait"] is None else float(values["wait"])
    return values["server"], kernels, park, wait


def parse_room_request(
    body: object,
) -> Tuple[str, Dict[str, ParkReport], Dict[str, Dict[str, int]], Optional[Tuple[str, int]], FrozenSet[str]]:
    """(server, its kernels' park reports, kernel id -> uuid -> bytes needed, the park asking for host memory, the
    demands its server says are fast-path resumes: "may_wait")."""
    values = check_model(body, ROOM)
    host = values["host_park"]
    demands = {entry["kernel_id"]: dict(entry["need"]) for entry in values["demands"]}
    may_wait = frozenset(entry["kernel_id"] for entry in values["demands"] if entry["may_wait"])
    host_park = None if host is None else (host["kernel_id"], host["bytes"])
    return values["server"], _reports(values["park"]), demands, host_park, may_wait
