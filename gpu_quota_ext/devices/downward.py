"""The pod's annotations as the container sees them: a file the kubelet writes through the downward API, and the
record of what the hub asked for the pod's GPU, one of those annotations.

Pure: parses text (the caller reads the file). The hub's pod spec (gpu_quota_ext.hub.kube) mounts a
downwardAPI volume at POD_INFO_DIR whose item ANNOTATIONS_ITEM is `metadata.annotations`; the kubelet writes
one `key="value"` line per annotation, keys sorted, each value quoted the way Go's strconv.Quote quotes
(backslash escapes, \\xHH, \\uHHHH), and rewrites the file when the annotations change.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Dict, Mapping, Optional

POD_INFO_DIR = "/etc/gpu-quota-ext/pod"
ANNOTATIONS_ITEM = "annotations"
ANNOTATIONS_FILE = POD_INFO_DIR + "/" + ANNOTATIONS_ITEM
# What the hub asked for this pod's GPU (JSON: way, gpus, gpu_memory, gpu_cores, claim): the only place a
# container under NVIDIA's DRA driver learns its claim's MPS memory limit, which the driver gives the MPS
# control daemon and not the container.
RECORD_ANNOTATION = "gpu-quota-ext/pod-gpu"
MOST_RECORD_CHARS = 4096  # the hub writes a few hundred characters; more is not the hub's record

# key="value" with the escapes Go's strconv.Quote writes (and no bare quote): a subset of Python's string literals.
_LINE = re.compile(
    r'^([^=\s]+)="((?:[^"\\]|\\(?:[abfnrtv\\"]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{3}))*)"$'
)


def parse_annotations(text: str) -> Dict[str, str]:
    """The downward API's annotations file -> {key: value}. A line that is not `key="value"` is skipped."""
    found: Dict[str, str] = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        try:
            value = ast.literal_eval('"' + match.group(2) + '"')  # checked above: only Go's escapes
        except (ValueError, SyntaxError):  # e.g. a \U beyond Unicode
            continue
        if isinstance(value, str):
            found[match.group(1)] = value
    return found


def pod_record(annotations: Optional[Mapping[str, str]]) -> Optional[dict]:
    """The hub's record of this pod's GPU, or None (no such annotation, or not a record the hub writes)."""
    if not annotations or RECORD_ANNOTATION not in annotations:
        return None
    text = annotations[RECORD_ANNOTATION]
    if len(text) > MOST_RECORD_CHARS:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("way"), str) else None
