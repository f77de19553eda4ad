"""Issue 10, item 13: a static inventory that lists one UUID twice stops a real server at start."""

import pytest

from .test_bad_config import start_server


@pytest.mark.slow
def test_duplicate_uuids_stop_the_server_with_one_line_naming_both_entries(tmp_path):
    devices = [{"total": "16GiB", "uuid": "GPU-aaaa"}, {"total": "16GiB", "uuid": "GPU-aaaa"}]
    config = {
        "GpuQuota": {"inventory_class": "gpu_quota_ext.devices.StaticInventory"},
        "StaticInventory": {"devices": devices},
    }
    returncode, stderr = start_server(tmp_path, [], None, config)
    assert returncode not in (None, 0), "the server kept running with two devices of one uuid"
    ours = [line for line in stderr.splitlines() if "gpu-quota-ext: invalid configuration" in line]
    assert len(ours) == 1, stderr
    assert "c.StaticInventory.devices[0] and c.StaticInventory.devices[1] have the same uuid 'GPU-aaaa'" in ours[0]
    assert "Traceback" not in stderr
