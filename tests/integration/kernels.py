"""Helpers that drive real kernels the way the browser does: REST to start, the kernel protocol to run."""

from __future__ import annotations

import json


async def start_kernel(jp_fetch, name: str = "python3") -> str:
    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
    return json.loads(response.body)["id"]


async def shutdown_kernel(jp_fetch, kernel_id: str) -> None:
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def restart_kernel(jp_fetch, kernel_id: str) -> None:
    await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")


async def execute(serverapp, kernel_id: str, code: str, timeout: float = 60) -> str:
    """Run `code` in the kernel; return its stdout. A cell error fails the test with the traceback."""
    km = serverapp.kernel_manager.get_kernel(kernel_id)
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=timeout)
        chunks: list = []
        errors: list = []

        def on_output(msg) -> None:
            kind = msg["msg_type"]
            if kind == "stream" and msg["content"]["name"] == "stdout":
                chunks.append(msg["content"]["text"])
            elif kind == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        reply = await client.execute_interactive(code, output_hook=on_output, timeout=timeout)
        if reply["content"]["status"] != "ok" or errors:
            raise AssertionError(f"cell failed:\n{code}\n" + "\n".join(errors))
        return "".join(chunks)
    finally:
        client.stop_channels()


async def run_cell(serverapp, kernel_id: str, code: str, timeout: float = 60) -> dict:
    """Run `code` in the kernel as a notebook would; {"status", "stdout", "stderr", "error"} whatever happens (the
    error's traceback lines joined, "" when none)."""
    km = serverapp.kernel_manager.get_kernel(kernel_id)
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=timeout)
        streams: dict = {"stdout": [], "stderr": []}
        errors: list = []

        def on_output(msg) -> None:
            kind = msg["msg_type"]
            if kind == "stream":
                streams[msg["content"]["name"]].append(msg["content"]["text"])
            elif kind == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        reply = await client.execute_interactive(code, output_hook=on_output, timeout=timeout)
        return {
            "status": reply["content"]["status"],
            "stdout": "".join(streams["stdout"]),
            "stderr": "".join(streams["stderr"]),
            "error": "\n".join(errors),
        }
    finally:
        client.stop_channels()


async def start_child_process(serverapp, kernel_id: str) -> int:
    """Start a long-lived subprocess from inside the kernel (a DataLoader worker, say); return its PID."""
    out = await execute(
        serverapp,
        kernel_id,
        "import subprocess, sys\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(worker.pid)",
    )
    return int(out.strip())


def write_kernelspec(kernel_dir, name: str, spec: dict) -> str:
    """Install a kernelspec for the test's server (pytest-jupyter's data dir); return its name."""
    from pathlib import Path

    spec_dir = Path(kernel_dir) / name
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return name


async def kernel_env(serverapp, kernel_id: str, names) -> dict:
    """The named environment variables as the kernel's own process sees them."""
    out = await execute(
        serverapp,
        kernel_id,
        "import os, json; print(json.dumps({n: os.environ.get(n) for n in %r}))" % (list(names),),
    )
    return json.loads(out.strip().splitlines()[-1])


def static_devices_config(*totals: str, **gpu_quota) -> dict:
    """Server config: the extension on, a static inventory of these device sizes, GpuQuota traits."""
    return {
        "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
        "GpuQuota": {"inventory_class": "gpu_quota_ext.devices.StaticInventory", **gpu_quota},
        "StaticInventory": {"devices": [{"name": f"Test GPU {i}", "total": t} for i, t in enumerate(totals)]},
    }
