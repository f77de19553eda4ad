"""A Sphinx extension: the reference tables of the docs, generated from the code's single sources at build time.

What the code says is read here, never copied into a page: the settings table (gpu_quota_ext.settings.SETTINGS),
the REST routes the server extension really serves (its own handler list), the REST contract's and the host
service contract's names (gpu_quota_ext.shared.contract, the host service's contract), the Prometheus families
the collectors build, the traits of the host service, and the environment variables the launch hook writes.
Where a page describes code items in words (a route, a field), the directive checks that the words cover exactly
the code's items: a route or field added, renamed or dropped is a build warning, and the docs build fails on any.

The first half (plain rows from the code) is pure and has no docutils in it, so tests can call it; the second
half turns rows into docutils tables. Modules are imported by their paths after the package's move into one
folder per concern, falling back to the paths before it.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective, SphinxRole

log = logging.getLogger(__name__)

# Where each source lives.
MODULES = {
    "settings": "gpu_quota_ext.settings",
    "contract": "gpu_quota_ext.shared.contract",
    "service": "gpu_quota_ext.shared.service_contract",
    "env_vars": "gpu_quota_ext.shared.env_vars",
    "app": "gpu_quota_ext.app",
    "collector": "gpu_quota_ext.status.collector",
    "service_metrics": "gpu_quota_ext.hub.service.metrics",
    "service_app": "gpu_quota_ext.hub.service.app",
}
HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete")


# --- what the code says (pure) -----------------------------------------------------------------------------

def module(key: str) -> ModuleType:
    return importlib.import_module(MODULES[key])


def written(value: Any) -> str:
    """A default as a config file writes it: strings quoted, the rest as Python writes them."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def setting_rows(settings: Dict[str, Any], part: Optional[str] = None) -> List[Tuple[str, str, str, str]]:
    """(name, environment variable or "", default as written, help) for every row of the settings table,
    or for the rows of one part (policy, watchdog, hard_cap, park, plugins), in the table's order."""
    return [
        (name, row.env or "", written(row.default), one_line(row.help))
        for name, row in settings.items()
        if part is None or row.part == part
    ]


def route_rows(app_class: Any) -> List[Tuple[str, str]]:
    """(METHOD, path) for every route an ExtensionApp serves, from its own handler list: the methods are those
    the handler class implements (not tornado's defaults); `(?P<kernel_id>...)` is shown as `<kernel_id>`."""
    from tornado.web import RequestHandler

    app = app_class()
    app.initialize_handlers()
    rows = []
    for spec in app.handlers:
        pattern, handler = spec[0], spec[1]
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"<\1>", pattern)
        for method in HTTP_METHODS:
            if getattr(handler, method) is not getattr(RequestHandler, method):
                rows.append((method.upper(), path))
    return rows


def trailing_comments(source: str) -> Dict[int, str]:
    """Line number -> the comment at the end of that line."""
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    return comments


def _source(mod: ModuleType) -> Tuple[ast.Module, Dict[int, str], List[str]]:
    with open(mod.__file__, encoding="utf-8") as file:
        text = file.read()
    return ast.parse(text), trailing_comments(text), text.splitlines()


def _comment_on(lineno: int, comments: Dict[int, str], lines: List[str]) -> str:
    """The comment at the end of a statement's line, else the comment lines right above it (a section rule
    such as `# --- parking ---` is not about the statement)."""
    if comments.get(lineno) and not lines[lineno - 1].lstrip().startswith("#"):
        return comments[lineno]
    above: List[str] = []
    line = lineno - 1
    while line >= 1 and lines[line - 1].lstrip().startswith("#") and not comments[line].startswith("---"):
        above.insert(0, comments[line])
        line -= 1
    return " ".join(above)


def contract_items(mod: ModuleType, name: str) -> List[Tuple[str, str]]:
    """(item, the contract's comment on it or "") for each string of the tuple `name` in a contract module."""
    values = getattr(mod, name)
    tree, comments, _ = _source(mod)
    said: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if isinstance(node.value, ast.Tuple):
                for element in node.value.elts:
                    if isinstance(element, ast.Constant) and element.lineno in comments:
                        said[element.value] = comments[element.lineno]
    return [(value, said.get(value, "")) for value in values]


def constant_rows(mod: ModuleType) -> List[Tuple[str, Any, str]]:
    """(constant, value, the comment on it or "") for each upper-case string constant."""
    tree, comments, lines = _source(mod)
    rows = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            value = getattr(mod, name, None)
            if name.isupper() and isinstance(value, str):
                rows.append((name, value, _comment_on(node.lineno, comments, lines)))
    return rows


def family_rows(families: Sequence[Any]) -> List[Tuple[str, str, str, str]]:
    """(name as a scrape shows it, type, labels, help) of prometheus_client metric families."""
    rows = []
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = getattr(family, "_labelnames", ())
        rows.append((name, family.type, ", ".join(labels), family.documentation))
    return rows


def server_metric_rows() -> List[Tuple[str, str, str, str]]:
    """Every family of the server's /metrics, built by the code that builds them at a scrape, from no kernels."""
    collector = module("collector")
    families = collector.monitor_families({}, {}, {}, True, False, 0.0, {})
    families.append(collector.hard_limit_family({}))
    families.extend(collector.park_families({}))
    return family_rows(families)


def service_metric_rows() -> List[Tuple[str, str, str, str]]:
    """Every family of the host service's /metrics, from an empty host."""
    empty_host = {"devices": [], "users": [], "kernels": [], "state": "ok"}
    return family_rows(module("service_metrics").HostCollector(lambda: empty_host).collect())


def trait_rows(cls: type) -> List[Tuple[str, str, str]]:
    """(name, default or "" when it is computed at start, help) of a Configurable's own config traits, in the
    order the class declares them."""
    own = cls.class_own_traits(config=True)
    computed = getattr(cls, "_trait_default_generators", {})
    rows = []
    for name in [n for n in vars(cls) if n in own]:
        trait = own[name]
        default = "" if name in computed else trait.default_value_repr()
        rows.append((name, default, one_line(trait.help)))
    return rows


def service_class() -> type:
    return module("service_app").GpuQuotaService


def module_rows(package_dir: Path) -> List[Tuple[str, str]]:
    """(path under the package, the first line of its docstring or of its opening comment) for every Python
    module of the package, read as text (nothing imported), folders before the files in them."""
    rows = []
    for path in sorted(package_dir.rglob("*.py"), key=lambda p: p.relative_to(package_dir).parts):
        text = path.read_text(encoding="utf-8")
        said = ast.get_docstring(ast.parse(text)) or text.lstrip().lstrip("#").strip()
        rows.append((str(path.relative_to(package_dir)), one_line(said.split("\n\n")[0].split(". ")[0])))
    return rows


# --- docutils: rows into tables ------------------------------------------------------------------------------

def _cell(content: Any) -> nodes.entry:
    entry = nodes.entry()
    if isinstance(content, nodes.Node):
        entry += content
    elif isinstance(content, list):
        entry.extend(content)
    else:
        entry += nodes.paragraph("", "", nodes.Text(str(content)))
    return entry


def _code(text: str) -> nodes.Node:
    return nodes.paragraph("", "", nodes.literal(text, text)) if text else nodes.paragraph("", "", nodes.Text("–"))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], widths: Sequence[int]) -> nodes.table:
    result = nodes.table(classes=["gpu-quota-reference", "colwidths-given"])
    group = nodes.tgroup(cols=len(header))
    result += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    head += nodes.row("", *(_cell(title) for title in header))
    body = nodes.tbody()
    for row in rows:
        body += nodes.row("", *(_cell(content) for content in row))
    group += head
    group += body
    return result


def _labelled(label: str, text: str) -> nodes.Node:
    return nodes.paragraph("", "", nodes.Text(f"{label}: "), *_code(text).children)


def _setting_link(name: str) -> nodes.Node:
    ref = addnodes.pending_xref("", refdomain="std", reftype="setting", reftarget=name, refexplicit=False)
    ref += nodes.literal(name, name)
    return nodes.paragraph("", "", ref)


class Described(SphinxDirective):
    """A directive whose content is a bullet list of `` `item`: words ``, one per item of the code; the words
    must cover exactly the code's items (what the code itself says about an item may stand in for them)."""

    has_content = True

    def described(self) -> Dict[str, List[nodes.Node]]:
        words: Dict[str, List[nodes.Node]] = {}
        for node in self.parse_content_to_nodes():
            if not isinstance(node, nodes.bullet_list):
                self.complain("its content must be one bullet list of `item`: words")
                continue
            for item in node.children:
                first = item.children[0] if item.children else None
                if not (isinstance(first, nodes.paragraph) and first.children and isinstance(first[0], nodes.literal)):
                    self.complain(f"a list item that does not start with `item`: {item.astext()[:60]!r}")
                    continue
                key = first[0].astext()
                first.remove(first[0])
                if first.children and isinstance(first[0], nodes.Text):
                    first.replace(first[0], nodes.Text(first[0].astext().lstrip(" :")))
                words[key] = list(item.children)
        return words

    def checked(self, items: Sequence[str], said: Dict[str, str]) -> Dict[str, List[nodes.Node]]:
        words = self.described()
        unknown = [key for key in words if key not in items]
        silent = [key for key in items if key not in words and not said.get(key)]
        if unknown:
            self.complain(f"describes what the code does not have: {', '.join(unknown)}")
        if silent:
            self.complain(f"leaves out what the code has: {', '.join(silent)}")
        return {key: words.get(key) or [nodes.paragraph("", "", nodes.Text(said.get(key, "")))] for key in items}

    def complain(self, message: str) -> None:
        log.warning(f"{self.name}: {message}", location=self.get_location(), type="gpu-quota", subtype="reference")


class SettingsTable(SphinxDirective):
    """``{gpu-quota-settings}`` [``:part: hard_cap``]: the settings table, every row or one part's. The whole
    table is the settings' one home (each row a target that {setting}`name` links to); a part's rows link there."""

    option_spec = {"part": directives.unchanged}

    def run(self) -> List[nodes.Node]:
        part = self.options.get("part")
        settings = module("settings").SETTINGS
        rows = setting_rows(settings, part)
        if part is not None and not rows:
            log.warning(f"gpu-quota-settings: no setting has part {part!r}", location=self.get_location())
        cells, targets = [], []
        for name, env, default, help_text in rows:
            if part is None:
                node_id = f"setting-{name}"
                target = nodes.target("", "", ids=[node_id])
                targets.append((name, node_id))
                first = nodes.paragraph("", "", target, nodes.literal(name, name))
            else:
                first = _setting_link(name)
            cells.append([[first, _labelled("variable", env), _labelled("default", default)], help_text])
        if targets:
            std = self.env.get_domain("std")
            for name, node_id in targets:
                std.note_object("setting", name, node_id, location=self.get_location())
        return [table(("c.GpuQuota. setting, its variable, its default", "meaning"), cells, (36, 64))]


class RoutesTable(Described):
    """``{gpu-quota-routes}``: the REST routes the server extension serves (its own handler list), each with the
    words the content gives for `` `METHOD path` ``."""

    def run(self) -> List[nodes.Node]:
        rows = route_rows(module("app").GpuQuota)
        keys = [f"{method} {path}" for method, path in rows]
        words = self.checked(keys, {})
        cells = [[_code(method), _code(path), words[key]] for (method, path), key in zip(rows, keys)]
        return [table(("method", "path (under the server's base URL)", "what it does"), cells, (11, 40, 49))]


class FieldsTable(Described):
    """``{gpu-quota-fields} NAME``: the fields of a tuple of the REST contract (``:contract: service`` for the
    host service's), each with the content's words or, where it has none, the contract's own comment."""

    required_arguments = 1
    option_spec = {"contract": directives.unchanged, "title": directives.unchanged}

    def run(self) -> List[nodes.Node]:
        mod = module(self.options.get("contract", "contract"))
        name = self.arguments[0]
        if not isinstance(getattr(mod, name, None), tuple):
            self.complain(f"{mod.__name__} has no tuple {name}")
            return []
        items = contract_items(mod, name)
        words = self.checked([item for item, _ in items], dict(items))
        cells = [[_code(item), words[item]] for item, _ in items]
        return [table((self.options.get("title", "field"), "meaning"), cells, (24, 76))]


class MetricsTable(SphinxDirective):
    """``{gpu-quota-metrics} server`` or ``service``: every Prometheus family the collectors build."""

    required_arguments = 1

    def run(self) -> List[nodes.Node]:
        which = self.arguments[0]
        rows = {"server": server_metric_rows, "service": service_metric_rows}[which]()
        cells = [[_code(name), kind, _code(labels), help_text] for name, kind, labels, help_text in rows]
        return [table(("metric", "type", "labels", "meaning"), cells, (36, 10, 22, 52))]


class TraitsTable(SphinxDirective):
    """``{gpu-quota-service-settings}``: the host service's own settings (``c.GpuQuotaService``), from its traits."""

    def run(self) -> List[nodes.Node]:
        cells = [
            [_code(name), _code(default) if default else "set at start (below)", help_text]
            for name, default, help_text in trait_rows(service_class())
        ]
        return [table(("setting (`c.GpuQuotaService.`)", "default", "meaning"), cells, (24, 24, 52))]


class EnvironmentTable(Described):
    """``{gpu-quota-kernel-environment}``: the environment variables of shared/env_vars.py, the names both sides
    read, each with the content's words or, where it has none, the module's own comment."""

    def run(self) -> List[nodes.Node]:
        said = {value: comment for _, value, comment in constant_rows(module("env_vars"))}
        words = self.checked(list(said), said)
        return [table(("variable", "what it carries"), [[_code(value), words[value]] for value in said], (36, 64))]


class ModulesTable(SphinxDirective):
    """``{gpu-quota-modules}``: every module of the package with what it opens by saying it is for."""

    def run(self) -> List[nodes.Node]:
        package_dir = Path(module("settings").__file__).resolve().parent
        rows = module_rows(package_dir)
        cells = [[_code(path), said] for path, said in rows]
        return [table(("module (under `gpu_quota_ext/`)", "its concern"), cells, (30, 70))]


class ContractRole(SphinxRole):
    """{contract}`STATUS_PATH` (the REST contract) or {contract}`service:LEASE_SECONDS` (the host service's): the
    constant's value, as code for a string, as a number otherwise. An unknown name is a build warning."""

    def run(self):
        key, _, name = self.text.rpartition(":")
        mod = module(key or "contract")
        if not hasattr(mod, name):
            log.warning(f"{{contract}}: {mod.__name__} has no {name}", location=self.get_location())
            return [nodes.literal(self.text, self.text)], []
        value = getattr(mod, name)
        if isinstance(value, str):
            return [nodes.literal(value, value)], []
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return [nodes.Text(shown)], []


def setup(app):
    app.add_crossref_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_directive("gpu-quota-settings", SettingsTable)
    app.add_directive("gpu-quota-routes", RoutesTable)
    app.add_directive("gpu-quota-fields", FieldsTable)
    app.add_directive("gpu-quota-metrics", MetricsTable)
    app.add_directive("gpu-quota-service-settings", TraitsTable)
    app.add_directive("gpu-quota-kernel-environment", EnvironmentTable)
    app.add_directive("gpu-quota-modules", ModulesTable)
    app.add_role("contract", ContractRole())
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
