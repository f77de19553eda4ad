"""Where kernels reach the server's API, for each way the server can listen."""

import pytest

from gpu_quota_ext.app import kernel_api_url


@pytest.mark.parametrize(
    "ip, expected",
    [
        ("", "http://127.0.0.1:8888/"),
        ("0.0.0.0", "http://127.0.0.1:8888/"),
        ("::", "http://127.0.0.1:8888/"),
        ("localhost", "http://127.0.0.1:8888/"),
        ("127.0.0.1", "http://127.0.0.1:8888/"),
        ("10.1.2.3", "http://10.1.2.3:8888/"),
        ("fd00::5", "http://[fd00::5]:8888/"),
        ("[fd00::5]", "http://[fd00::5]:8888/"),
    ],
)
def test_kernel_api_url(ip, expected):
    assert kernel_api_url(ip, 8888, "/", False) == expected


def test_tls_and_base_url():
    assert kernel_api_url("", 443, "/user/alice/", True) == "https://127.0.0.1:443/user/alice/"
