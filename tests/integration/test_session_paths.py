"""The notebook path of each kernel, read through jupyter_server's session manager (list_sessions)."""

import json

import pytest

from .fake_gpu import fake_gpu_config, kernel_entry, status
from .kernels import shutdown_kernel, start_kernel


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn")


async def test_status_and_kernel_answers_show_the_sessions_notebook_path(jp_fetch, jp_root_dir):
    (jp_root_dir / "work").mkdir()
    body = {"path": "work/analysis.ipynb", "type": "notebook", "name": "analysis.ipynb", "kernel": {"name": "python3"}}
    session = json.loads((await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))).body)
    kernel_id = session["kernel"]["id"]
    bare = await start_kernel(jp_fetch)  # no session: no path
    try:
        state = await status(jp_fetch)
        assert kernel_entry(state, kernel_id)["path"] == "work/analysis.ipynb"
        assert kernel_entry(state, bare)["path"] is None
        one = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
        assert one["path"] == "work/analysis.ipynb"
        # The session is renamed (the notebook moved): the next answer follows it.
        await jp_fetch("api", "sessions", session["id"], method="PATCH", body=json.dumps({"path": "work/moved.ipynb"}))
        assert kernel_entry(await status(jp_fetch), kernel_id)["path"] == "work/moved.ipynb"
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")
        await shutdown_kernel(jp_fetch, bare)
