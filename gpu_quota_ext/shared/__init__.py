"""What the server and the kernel both use: sizes, environment variable names, the REST contract.

Standard library only (a test keeps it so): kernels import it, and a kernel's environment may have
nothing but the standard library and IPython. It is the only part of the server side that
`gpu_quota_ext.kernel` imports.
"""
