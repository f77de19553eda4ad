"""Run one cell in a kernel the server started and keep everything it sent on iopub: stdout, stderr,
errors (tracebacks) and comm messages, the way a notebook receives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class CellOutput:
    """Everything a cell sent on iopub, sorted the way a notebook shows it."""

    status: str
    stdout: str = ""
    stderr: str = ""
    errors: List[dict] = field(default_factory=list)  # error messages' content (ename, evalue, traceback)
    messages: List[dict] = field(default_factory=list)  # every iopub message, for comm checks
    pages: List[str] = field(default_factory=list)  # what the reply gives the pager (`%gpucap?`), as text

    def finish(self, reply: dict) -> "CellOutput":
        """The execute reply: its status, and the pager's text of its payload."""
        content = reply["content"]
        self.status = content["status"]
        self.pages = [p["data"].get("text/plain", "") for p in content.get("payload", ()) if p.get("source") == "page"]
        return self

    def comm(self, kind: str) -> List[dict]:
        return [m["content"] for m in self.messages if m["msg_type"] == kind]

    def add(self, msg: dict) -> None:
        """An iopub message of the cell (the output hook of execute_interactive)."""
        self.messages.append(msg)
        kind = msg["msg_type"]
        if kind == "stream":
            if msg["content"]["name"] == "stdout":
                self.stdout += msg["content"]["text"]
            else:
                self.stderr += msg["content"]["text"]
        elif kind == "error":
            self.errors.append(msg["content"])


async def run_cell(serverapp, kernel_id: str, code: str, timeout: float = 60) -> CellOutput:
    """Like kernels.execute, but keeps stderr, errors and comm messages instead of failing on them."""
    client = serverapp.kernel_manager.get_kernel(kernel_id).client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=timeout)
        out = CellOutput(status="")
        reply = await client.execute_interactive(code, output_hook=out.add, timeout=timeout)
        return out.finish(reply)
    finally:
        client.stop_channels()
