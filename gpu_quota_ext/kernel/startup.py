# gpu-quota-ext: the file the launch hook names in PYTHONSTARTUP. IPython runs it in the user's
# namespace at kernel start, so it defines one private name, calls it and deletes it.
# The kernel's Python may be another environment than the server's: the package is loaded from next
# to this file when the kernel cannot import it itself. Standard library only.
# Nothing is printed here: the kernel's stderr is the server's terminal, and no cell is running to show
# it in the notebook. A failure is said after the first cell and by `%gpucap` instead.


def _gpu_quota_ext_startup():
    import importlib.util
    import os
    import sys

    def tell_the_user(message):
        # The bootstrap could not run: a `%gpucap` that says why, and one line after the first cell.
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is None:
                return
            line = "gpu-quota: problem: " + message

            def gpucap(arguments=""):
                print(line, file=sys.stderr)

            gpucap._ipython_magic_no_var_expand = True  # IPython's @no_var_expand, as the real %gpucap

            def after_first_cell(result=None):
                shell.events.unregister("post_run_cell", after_first_cell)
                print(line, file=sys.stderr)

            shell.register_magic_function(gpucap, "line", "gpucap")
            shell.events.register("post_run_cell", after_first_cell)
        except Exception:  # broad: never a traceback at kernel start; %gpucap has no other way to say it
            pass

    if "gpu_quota_ext" not in sys.modules:
        here = os.path.dirname(os.path.abspath(os.environ.get("PYTHONSTARTUP", "") or __file__))
        package_dir = os.path.dirname(here)
        spec = importlib.util.spec_from_file_location(
            "gpu_quota_ext", os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir]
        )
        if spec is None or spec.loader is None:
            tell_the_user("cannot load gpu-quota-ext from %s; no GPU cap applied in this kernel" % package_dir)
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_quota_ext"] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # never break the kernel
            sys.modules.pop("gpu_quota_ext", None)
            tell_the_user("cannot load gpu-quota-ext: %r; no GPU cap applied in this kernel" % (error,))
            return
    try:
        from gpu_quota_ext.kernel import bootstrap

        bootstrap.run(globals())
    except Exception as error:  # never a traceback at kernel start; the user's own startup still runs
        problems = ["the gpu-quota-ext bootstrap failed: %r; no GPU cap applied in this kernel" % (error,)]
        user_startup = os.environ.pop("GPU_QUOTA_USER_PYTHONSTARTUP", None)
        if user_startup:
            os.environ["PYTHONSTARTUP"] = user_startup
            try:
                with open(user_startup) as source:
                    exec(compile(source.read(), user_startup, "exec"), globals())
            except Exception as user_error:  # broad: the user's own startup code may raise anything; said after a cell
                problems.append("your PYTHONSTARTUP %s failed: %r" % (user_startup, user_error))
        else:
            os.environ.pop("PYTHONSTARTUP", None)
        tell_the_user("; ".join(problems))


try:
    _gpu_quota_ext_startup()
finally:
    del _gpu_quota_ext_startup
