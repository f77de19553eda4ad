# gpu-quota-ext: the file the launch hook names in PYTHONSTARTUP. IPython runs it in the user's
# namespace at kernel start, so it defines one private name, calls it and deletes it.
# The kernel's Python may be another environment than the server's: the package is loaded from next
# to this file when the kernel cannot import it itself. Standard library only.


def _gpu_quota_ext_startup():
    import importlib.util
    import os
    import sys

    if "gpu_quota_ext" not in sys.modules:
        here = os.path.dirname(os.path.abspath(os.environ.get("PYTHONSTARTUP", "") or __file__))
        package_dir = os.path.dirname(here)
        spec = importlib.util.spec_from_file_location(
            "gpu_quota_ext", os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir]
        )
        if spec is None or spec.loader is None:
            print("[gpu-quota-ext] cannot load the package from %s; no cap applied" % package_dir, file=sys.__stderr__)
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_quota_ext"] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # never break the kernel
            sys.modules.pop("gpu_quota_ext", None)
            print("[gpu-quota-ext] cannot load the package: %r; no cap applied" % (error,), file=sys.__stderr__)
            return
    try:
        from gpu_quota_ext.kernel import bootstrap

        bootstrap.run(globals())
    except Exception as error:  # never a traceback at kernel start; the user's own startup still runs
        print("[gpu-quota-ext] bootstrap failed: %r; no cap applied in this kernel" % (error,), file=sys.__stderr__)
        user_startup = os.environ.pop("GPU_QUOTA_USER_PYTHONSTARTUP", None)
        if user_startup:
            os.environ["PYTHONSTARTUP"] = user_startup
            try:
                with open(user_startup) as source:
                    exec(compile(source.read(), user_startup, "exec"), globals())
            except Exception as user_error:
                print("[gpu-quota-ext] your PYTHONSTARTUP %s failed: %r" % (user_startup, user_error), file=sys.__stderr__)
        else:
            os.environ.pop("PYTHONSTARTUP", None)


try:
    _gpu_quota_ext_startup()
finally:
    del _gpu_quota_ext_startup
