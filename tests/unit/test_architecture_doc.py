"""docs/architecture.md tells the tree as it is: its table has a row for every top-level module and folder of
the package and for nothing else, every file its picture and its table name exists where they put it, and the
layers it writes out are the ones tests/unit/test_imports.py checks."""

import re
from pathlib import Path

import gpu_quota_ext

from .test_imports import LAYERS, SIDE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(gpu_quota_ext.__file__).parent
DOC = ROOT / "docs" / "architecture.md"

FOLDER_WITH_MODULES = re.compile(r"\b([a-z_]+(?:/[a-z_]+)*/)\s+\(([a-z_.]+(?:, [a-z_.]+)*)\)")


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def picture(text: str) -> str:
    return text.split("```", 2)[1]


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
    drawing = picture(text)
    for folder, modules in FOLDER_WITH_MODULES.findall(drawing):
        named += [folder + module for module in modules.split(", ")]
    named += re.findall(r"\b[a-z_]+(?:/[a-z_]+)*/|\b[a-z_]+\.py\b", FOLDER_WITH_MODULES.sub(r"\1", drawing))
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


def test_the_table_has_a_row_for_every_top_level_module_and_folder_and_no_other():
    rows = [first for first, _ in table_rows(DOC.read_text(encoding="utf-8"))]
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == top_level()


def test_every_file_the_picture_and_the_table_name_is_there():
    assert missing_paths(DOC.read_text(encoding="utf-8")) == []


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
