"""docs/architecture.md tells the tree as it is: its table has a row for every top-level module and folder of
the package and for nothing else, every file its pictures, its table and its prose name exists where they put it,
every function its park request's picture names is defined in a module named on that line, and the layers it
writes out are the ones tests/unit/test_imports.py checks."""

import importlib
import re
from pathlib import Path
from typing import List, Optional

import gpu_quota_ext

from .test_imports import LAYERS, SIDE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(gpu_quota_ext.__file__).parent
DOC = ROOT / "docs" / "architecture.md"

FOLDER_WITH_MODULES = re.compile(r"\b([a-z_]+(?:/[a-z_]+)*/)\s+\(([a-z_.]+(?:, [a-z_.]+)*)\)")
# A file (a module, the C library's source, a schema) or a folder, as the pictures name them: relative to the package.
PATH = re.compile(r"(?<![\w/.])((?:[a-z_][a-z0-9_]*/)*[a-z_][a-z0-9_]*\.(?:py|c|yaml)|(?:[a-z_][a-z0-9_]*/)+)(?![\w/])")
# A call the park request's picture names: `name()` or `Class.method()`, always with empty parentheses.
CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(\)")
DATA_PATH = "A park request, from who asks to the driver call"


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def pictures(text: str) -> List[str]:
    """Every fenced drawing of the page (not the directives, whose fences open with `{`)."""
    blocks = text.split("```")[1::2]
    return [block for block in blocks if not block.startswith("{")]


def picture(text: str) -> str:
    return pictures(text)[0]


def table_rows(text: str) -> list:
    """[(first cell without backticks, [the other cells])] of the tree's table."""
    rows = []
    for line in section(text, "The tree").splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows.append((cells[0].strip("`"), cells[1:]))
    return rows


def top_level() -> set:
    modules = {path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    folders = {path.name + "/" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    return modules | folders


def missing_paths(text: str) -> list:
    """Every file or folder the picture or the table names that is not there."""
    named = []
    for drawing in pictures(text):
        for folder, modules in FOLDER_WITH_MODULES.findall(drawing):
            named += [folder + module for module in modules.split(", ")]
        named += PATH.findall(FOLDER_WITH_MODULES.sub(r"\1", drawing))
    for first, cells in table_rows(text):
        folder = first if first.endswith("/") else ""
        for cell in cells[1:]:  # the pure decisions and the I/O columns name the row's own files
            plain = cell.replace("`", "")
            named += [folder + path for path in re.findall(r"`([a-z_/]+\.py)`", cell)]
            for inner, modules in FOLDER_WITH_MODULES.findall(plain):
                named += [folder + inner + module for module in modules.split(", ")]
    missing = []
    for path in dict.fromkeys(named):
        where = ROOT if path == "labextension/" else PACKAGE
        target = where / path.rstrip("/")
        if not (target.is_dir() or target.is_file() or target.with_suffix(".py").is_file()):
            missing.append(path)
    return missing


def prose(text: str) -> str:
    """The page without its pictures, its table and its generated part."""
    kept = [block for i, block in enumerate(text.split("```")) if i % 2 == 0]
    lines = "".join(kept).splitlines()
    return "\n".join(line for line in lines if not line.startswith("|"))


def prose_paths(text: str) -> list:
    """The files and folders the prose names in backticks, each once."""
    return list(dict.fromkeys(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py|(?:[a-z_]+/)+)`", prose(text))))


def missing_in_prose(text: str) -> list:
    """Every `path.py` (or `folder/`) the prose names that is not there: a path with a folder from the package or
    from the repository's root, a bare file name anywhere in the package."""
    modules = {path.name for path in PACKAGE.rglob("*.py")}
    missing = []
    for path in prose_paths(text):
        if "/" not in path.rstrip("/"):
            found = path in modules or (PACKAGE / path).is_dir() or (ROOT / path).is_dir()
        else:
            found = any((where / path).exists() for where in (PACKAGE, ROOT))
        if not found:
            missing.append(path)
    return missing


def unresolved_dotted(text: str) -> list:
    """Every `gpu_quota_ext.module.Name` the page writes out (a configuration's class, an import) that does not
    import: its longest module prefix, then the rest as attributes."""
    unresolved = []
    for dotted in dict.fromkeys(re.findall(r"\bgpu_quota_ext(?:\.\w+)+", text)):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: Optional[object] = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                found = getattr(found, attribute, None)
            if found is None:
                unresolved.append(dotted)
            break
    return unresolved


def data_path(text: str) -> str:
    """The park request's picture: the first drawing of its section."""
    return pictures(section(text, DATA_PATH))[0]


def defined(path: str, name: str) -> bool:
    """`name` (a function, or Class.method) is defined in the file at `path` (relative to the package): an attribute of
    the module, or, for the C library, a function it defines; or a driver symbol the module calls by its name."""
    file = PACKAGE / path
    source = file.read_text(encoding="utf-8")
    if file.suffix == ".c":
        return re.search(rf"^[\w ]*\**\b{re.escape(name)}\s*\(", source, re.MULTILINE) is not None
    parts = Path(path).with_suffix("").parts
    dotted = ".".join((PACKAGE.name,) + (parts[:-1] if parts[-1] == "__init__" else parts))
    found: Optional[object] = importlib.import_module(dotted)
    for attribute in name.split("."):
        found = getattr(found, attribute, None)
        if found is None:
            return f'"{name}"' in source  # a symbol of a library the module opens (ctypes), named in a string
    return True


def undefined_calls(drawing: str) -> list:
    """(line, name) of each call the drawing names that no module named on the same line defines."""
    undefined = []
    for line in drawing.splitlines():
        paths = [path for path in PATH.findall(line) if not path.endswith("/") and not path.endswith(".yaml")]
        for name in CALL.findall(line):
            if not any(defined(path, name) for path in paths):
                undefined.append((line.strip()[:60], name))
    return undefined


def test_the_table_has_a_row_for_every_top_level_module_and_folder_and_no_other():
    rows = [first for first, _ in table_rows(DOC.read_text(encoding="utf-8"))]
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == top_level()


def test_every_file_the_picture_and_the_table_name_is_there():
    assert missing_paths(DOC.read_text(encoding="utf-8")) == []


def test_every_file_and_folder_the_prose_names_is_there():
    text = DOC.read_text(encoding="utf-8")
    assert len(prose_paths(text)) >= 10
    assert missing_in_prose(text) == []


def test_every_dotted_name_the_page_writes_out_imports():
    text = DOC.read_text(encoding="utf-8")
    assert "gpu_quota_ext.devices.fake_nvml.FakeNvml" in text
    assert unresolved_dotted(text) == []
    assert unresolved_dotted("`gpu_quota_ext.devices.fake_nvml.FakeNvm`") == ["gpu_quota_ext.devices.fake_nvml.FakeNvm"]


def test_every_call_in_the_park_request_s_picture_is_defined_where_its_line_says():
    drawing = data_path(DOC.read_text(encoding="utf-8"))
    assert len(CALL.findall(drawing)) >= 60  # the picture names its calls: this check has something to check
    assert undefined_calls(drawing) == []


def test_the_layers_written_out_are_the_ones_the_import_check_keeps():
    text = DOC.read_text(encoding="utf-8")
    rules = " ".join(section(text, "The rules the tree keeps (tests/unit/test_imports.py checks them)").split())
    written = re.search(r"The layers, bottom first: (.*?)\. `kernel/` stands beside them and imports only", rules)
    assert written, rules[:300]
    layers = [tuple(name.strip(" `") for name in layer.split(",")) for layer in written.group(1).split(";")]
    assert layers == [layer for layer in LAYERS if layer != ("__init__",)]
    assert SIDE == {"kernel": ("shared",)}


def test_a_wrong_tree_would_be_found():
    # The checks above can fail: a row for a module that is not there, a folder's module that is not there.
    text = DOC.read_text(encoding="utf-8")
    wrong = text.replace("| `threads.py` |", "| `threading.py` |")
    wrong = wrong.replace("(decisions, mps, layer)", "(decisions, mps, daemon)")
    assert {first for first, _ in table_rows(wrong)} != top_level()
    assert missing_paths(wrong) == ["hard_limit/daemon"]


def test_a_wrong_park_request_picture_would_be_found():
    # A call renamed or moved, a module that is not there: each is found.
    text = DOC.read_text(encoding="utf-8")
    drawing = data_path(text)
    renamed = drawing.replace("Parker.park_for_host()", "Parker.park_for_hosts()")
    assert [name for _, name in undefined_calls(renamed)] == ["Parker.park_for_hosts"]
    moved = drawing.replace("parking/pages/pages.c gqx_arena_create()", "parking/pages/pages.c gqx_arena_new()")
    assert [name for _, name in undefined_calls(moved)] == ["gqx_arena_new"]
    assert missing_paths(text.replace("parking/pages_driver.py", "parking/fast_driver.py")) == [
        "parking/fast_driver.py"
    ]
    assert missing_in_prose(text + "\nSee `parking/fast_driver.py` and `fast_driver.py`.\n") == [
        "parking/fast_driver.py",
        "fast_driver.py",
    ]
