"""The tests' own tiny kernel: each cell is an environment variable's name; it prints the value.

Its kernelspec starts it through /bin/sh, so the server sees a kernel that is not a Python kernel (like
R or Julia): it must get the environment and start normally, with no Python bootstrap.
"""

import os

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel


class TinyKernel(Kernel):
    implementation = "tiny"
    implementation_version = "1.0"
    language_info = {"name": "text", "mimetype": "text/plain", "file_extension": ".txt"}
    banner = "tiny kernel of the gpu-quota-ext tests"

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False, **kwargs):
        names = code.split()
        text = "\n".join(f"{name}={os.environ.get(name)}" for name in names) + "\n"
        self.send_response(self.iopub_socket, "stream", {"name": "stdout", "text": text})
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=TinyKernel)
