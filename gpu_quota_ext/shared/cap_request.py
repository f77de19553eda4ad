"""A cap request's body, parsed and checked (pure): PUT kernels/<id> on a user server, and PUT
grants/<id> on the host quota service. The two differ only in how a device is named (a server's device
index, or a uuid on the host service's wire), so each passes its own check of "device"."""

from __future__ import annotations

from typing import Any, Callable, Tuple, Union

from .contract import CAP_REQUEST_FIELDS
from .sizes import CapSpec, PolicyError, parse_cap, shown

RESET = "reset"


def read_cap_request(
    body: object, device_is_valid: Callable[[Any], bool], device_must_be: str
) -> Union[str, Tuple[CapSpec, Any]]:
    """RESET, or (the cap asked for, the device or None). Anything else: PolicyError with the reason,
    which the handlers answer as a 400."""
    if not isinstance(body, dict):
        raise PolicyError('the body must be a JSON object like {"cap": "0.3"} or {"reset": true}')
    unknown = sorted(set(body) - set(CAP_REQUEST_FIELDS))
    if unknown:
        raise PolicyError(f"unknown fields {shown(unknown)}; known: {', '.join(CAP_REQUEST_FIELDS)}")
    if "reset" in body:
        if body["reset"] is True and set(body) == {"reset"}:
            return RESET
        raise PolicyError('"reset" must be true and alone')
    if "cap" not in body:
        raise PolicyError('missing "cap"')
    try:
        cap = parse_cap(body["cap"])
    except PolicyError as error:
        raise PolicyError(f"cap: {error}") from None
    device = body.get("device")
    if device is not None and not device_is_valid(device):
        raise PolicyError(f'"device" must be {device_must_be}')
    return cap, device
