"""The package's import graph, read from the source (nothing is imported): no import cycle anywhere;
imports go only down the design's picture (LAYERS below), and into another concern only through its
package's `__init__`; `gpu_quota_ext.kernel` imports from the server side only `gpu_quota_ext.shared`; the
shared core imports only the standard library and itself; the package keeps at most a dozen top-level
modules; handlers and the provisioner take nothing from the manager but its methods.

Module-level and function-level imports both count (a function-level import is a cycle waiting for its
first call); imports under `if TYPE_CHECKING:` do not (they never run). Importing a module runs the packages
above it first, so an import of `hub.service.spec` counts as one of `hub` and `hub.service` too.
"""

from __future__ import annotations

import ast
import pkgutil
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import gpu_quota_ext

PACKAGE = "gpu_quota_ext"
KERNEL = PACKAGE + ".kernel"
SHARED = PACKAGE + ".shared"

# The design's picture as layers, bottom first: a concern imports only its own modules and concerns of
# lower layers. kernel/ stands beside the server's layers (it imports only shared/).
LAYERS = (
    ("shared",),
    ("settings", "threads"),
    ("settings_traits",),
    ("devices", "policy"),
    ("ledger",),
    ("usage", "hard_limit", "parking", "launch_env"),
    ("status", "hub"),
    ("manager",),
    ("provisioner", "handlers"),
    ("app",),
    ("cli",),
    ("__init__",),
)
SIDE = {"kernel": ("shared",)}
# shared/ is a set of contracts (sizes, env variable names, the REST and host-service wire): each of its
# modules is a surface of its own, as kernel/ imports them. The package's __init__ holds the entry points
# of both sides (the server extension's app, the kernel's magic).
OPEN_SURFACES = ("shared", "kernel")
MOST_TOP_LEVEL_MODULES = 12


def modules() -> Dict[str, Path]:
    """Every module of the package: name -> source file."""
    found = {PACKAGE: Path(gpu_quota_ext.__file__)}
    for info in pkgutil.walk_packages(gpu_quota_ext.__path__, PACKAGE + "."):
        spec = info.module_finder.find_spec(info.name.rpartition(".")[2])
        found[info.name] = Path(spec.origin)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(name: str, path: Path) -> List[Tuple[str, int]]:
    """(absolute module name, line) for every import statement that runs, wherever it is in the module.
    `from X import Y` counts as X.Y when X.Y is a module (the caller decides), else X."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: List[Tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((base, node.lineno))
            found.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def package_graph() -> Tuple[Dict[str, Set[str]], Dict[str, List[Tuple[str, int]]]]:
    """Intra-package edges (module -> modules it imports) and every import of every module."""
    sources = modules()
    graph: Dict[str, Set[str]] = {}
    everything: Dict[str, List[Tuple[str, int]]] = {}
    for name, path in sources.items():
        imports = imported_names(name, path)
        everything[name] = imports
        # `from . import state` names a module; `from .policy import GiB` names policy, not policy.GiB.
        named = {target for target, _ in imports if target in sources and target != name}
        graph[name] = named | {parent for target in named for parent in packages_run_first(name, target)}
    return graph, everything


def packages_run_first(importer: str, target: str) -> Set[str]:
    """The packages Python runs before `target` when `importer` imports it: every package above the target
    (their __init__ runs first, and may import more), except the root and the importer's own packages, which
    ran before the importer did."""
    parts = target.split(".")
    above = {".".join(parts[:end]) for end in range(2, len(parts))}
    own = {".".join(importer.split(".")[:end]) for end in range(1, importer.count(".") + 1)}
    return above - own


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                strongconnect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return [_cycle_through(graph, set(component)) for component in components]


def _cycle_through(graph: Dict[str, Set[str]], component: Set[str]) -> List[str]:
    """A path start -> ... -> start inside one strongly connected component (for the message)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for other in sorted(graph[node] & component):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                frontier.append(other)
    raise AssertionError("not a cycle")  # pragma: no cover


def test_the_package_has_no_import_cycle():
    graph, _ = package_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def concern_of(module: str) -> str:
    """gpu_quota_ext.parking.parker -> "parking"; gpu_quota_ext.app -> "app"; the package itself -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layering_problems(graph: Dict[str, Set[str]]) -> List[str]:
    """Every import that runs up the layers, or into another concern past its package's __init__."""
    layer = {name: position for position, names in enumerate(LAYERS) for name in names}
    problems = []
    for module, targets in sorted(graph.items()):
        own = concern_of(module)
        for target in sorted(targets):
            other = concern_of(target)
            if other == own:
                continue
            if own == "__init__" or target == PACKAGE:
                # The root package runs before any of its modules (Python imports parents first): taking
                # `__version__` from it adds no dependency.
                continue
            if own in SIDE:
                allowed = other in SIDE[own]
            else:
                allowed = other in layer and own in layer and layer[other] < layer[own]
            if not allowed:
                problems.append(f"{module} imports {target}: {own} may not import {other}")
            elif target.count(".") > 1 and other not in OPEN_SURFACES:
                problems.append(f"{module} imports {target}: import {PACKAGE}.{other} (its __init__), not its module")
    return problems


def test_imports_go_down_the_picture_and_through_each_packages_surface():
    graph, _ = package_graph()
    unknown = sorted({concern_of(m) for m in graph} - {n for names in LAYERS for n in names} - set(SIDE))
    assert not unknown, f"concerns missing from LAYERS (say where they sit in the picture): {unknown}"
    problems = layering_problems(graph)
    assert not problems, "\n".join(problems)


def test_the_package_keeps_at_most_a_dozen_top_level_modules():
    top = sorted(path.name for path in Path(gpu_quota_ext.__file__).parent.glob("*.py"))
    assert len(top) <= MOST_TOP_LEVEL_MODULES, top


def test_the_layering_check_finds_an_upward_and_a_deep_import():
    graph = {
        PACKAGE + ".ledger.local": {PACKAGE + ".manager"},  # up
        PACKAGE + ".manager": {PACKAGE + ".parking.parker", PACKAGE + ".parking"},  # deep, then fine
        PACKAGE + ".kernel.magic": {PACKAGE + ".policy"},  # kernel/ beyond shared/
    }
    problems = layering_problems(graph)
    assert len(problems) == 3
    assert "ledger may not import manager" in problems[1] or "ledger may not import manager" in problems[0]
    assert any("not its module" in problem for problem in problems)
    assert any("kernel may not import policy" in problem for problem in problems)


def test_kernel_code_imports_from_the_server_side_only_the_shared_core():
    _, imports = package_graph()
    outside = sorted({
        # `from ..policy import format_bytes` is one line: name the module, not each imported name.
        f"{module}:{line} imports {target}"
        for module, found in imports.items()
        if module == KERNEL or module.startswith(KERNEL + ".")
        for target, line in found
        if (target == PACKAGE or target.startswith(PACKAGE + "."))
        and not any(target == allowed or target.startswith(allowed + ".") for allowed in (KERNEL, SHARED))
        and (target.rpartition(".")[0], line) not in found
    })
    assert not outside, "kernel/ may import only gpu_quota_ext.kernel and gpu_quota_ext.shared:\n" + "\n".join(outside)


def test_the_shared_core_imports_only_the_standard_library_and_itself():
    _, imports = package_graph()
    shared = {m: found for m, found in imports.items() if m == SHARED or m.startswith(SHARED + ".")}
    assert SHARED + ".sizes" in shared and SHARED + ".contract" in shared and SHARED + ".env_vars" in shared
    foreign = [
        f"{module}:{line} imports {target}"
        for module, found in sorted(shared.items())
        for target, line in found
        if not (target == SHARED or target.startswith(SHARED + "."))
        and target.partition(".")[0] not in sys.stdlib_module_names
        and target != "__future__"
    ]
    assert not foreign, "the shared core must stay standard library only:\n" + "\n".join(foreign)


# --- the checks themselves can fail ------------------------------------------------------------------


def test_importing_a_module_runs_the_packages_above_it_first():
    # hub.service.spec imported from ledger runs hub/__init__ and hub/service/__init__ too: a cycle through a
    # package's __init__ is a cycle.
    assert packages_run_first(PACKAGE + ".ledger.remote", PACKAGE + ".hub.service.spec") == {
        PACKAGE + ".hub", PACKAGE + ".hub.service"
    }
    assert packages_run_first(PACKAGE + ".hub.service.app", PACKAGE + ".hub.service.spec") == set()
    assert packages_run_first(PACKAGE + ".app", PACKAGE + ".policy") == set()


def test_the_cycle_finder_reports_a_cycle_and_ignores_a_tree():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_function_level_imports_count_and_type_checking_ones_do_not(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from .typed_only import Thing\n"
        "def later():\n"
        "    from ..outer import helper\n"
        "    import json\n"
    )
    found = {target for target, _ in imported_names("pkg.sub.mod", source)}
    assert {"pkg.sub.sibling", "pkg.outer", "pkg.outer.helper", "json"} <= found
    assert not any("typed_only" in target for target in found)


def test_every_module_opens_with_what_it_is_for():
    # A docstring, or (startup.py: run in the user's namespace, where a docstring would become __doc__) a
    # comment: the first thing a reader sees names the module's one concern.
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "gpu_quota_ext"
    silent = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if not (ast.get_docstring(ast.parse(text)) or text.lstrip().startswith("#")):
            silent.append(str(path.relative_to(package)))
    assert silent == []


# --- handlers and the provisioner ask the manager, never its parts -----------------------------------


def manager_reaches(path: Path) -> List[Tuple[int, str]]:
    """(line, name) of every attribute the module takes from a manager (`manager.x`, `self.manager.x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "manager") or (
            isinstance(owner, ast.Attribute) and owner.attr == "manager"
        ):
            found.append((node.lineno, node.attr))
    return found


def reaches_past_the_manager(path: Path) -> List[str]:
    """What the module takes from the manager that is not one of its methods: a part (ledger, monitor, ...)."""
    from gpu_quota_ext.manager import GpuQuotaManager

    return [
        f"{path.name}:{line} manager.{name}"
        for line, name in manager_reaches(path)
        if not callable(getattr(GpuQuotaManager, name, None))
    ]


def test_handlers_and_the_provisioner_call_manager_methods_only():
    package = Path(gpu_quota_ext.__file__).parent
    for name in ("handlers.py", "provisioner.py"):
        assert len(manager_reaches(package / name)) >= 5, name  # the check sees their calls
        assert reaches_past_the_manager(package / name) == [], name


def test_a_reach_into_a_part_of_the_manager_is_found(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text("def get(self, manager):\n    manager.admit(1)\n    return self.manager.ledger.grants()\n")
    assert reaches_past_the_manager(module) == ["mod.py:3 manager.ledger"]
