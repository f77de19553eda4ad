"""ProcTable's live reads: /proc by hand on Linux, psutil where there is no /proc; both tell the same."""

import os
import subprocess
import sys

import pytest

from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.usage import ProcTable

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="compares with /proc")


@pytest.fixture
def child():
    env = dict(os.environ, **{KERNEL_ID: "kernel-abc"})
    # Popen returns once the child has exec'd: its environment and parent are already in place.
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], env=env, stdin=subprocess.PIPE)
    yield process
    process.stdin.close()
    process.wait(timeout=30)


def test_proc_and_psutil_tell_the_same_facts(child, tmp_path):
    by_hand, by_psutil = ProcTable(), ProcTable(proc=str(tmp_path / "no-proc"))
    assert by_hand.has_proc and not by_psutil.has_proc
    for table in (by_hand, by_psutil):
        assert table.parent_of(child.pid) == os.getpid()
        assert table.kernel_in_environ(child.pid) == "kernel-abc"
        assert table.exists(child.pid)
        assert set(table.uids_of(child.pid)) == {os.getuid()}
    assert len(by_hand.uids_of(child.pid)) == 4  # the filesystem uid too, which psutil does not give
    assert by_psutil.namespace_aliases() == {}


def test_a_gone_process_gives_nothing(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    for table in (ProcTable(), ProcTable(proc=str(tmp_path / "no-proc"))):
        assert table.parent_of(process.pid) is None
        assert table.kernel_in_environ(process.pid) is None
        assert table.uids_of(process.pid) == ()
        assert not table.exists(process.pid)
