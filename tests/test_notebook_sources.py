"""The committed notebooks are the source of truth, so each is checked as a source file: valid
nbformat v4 with a kernelspec, one ``parameters`` cell ahead of every use of its names (papermill
injects overrides right after it), no stored outputs or execution counts (diffs stay reviewable),
and the parameters it declares are the ones docs/notebooks.md documents. Nothing is executed."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOC = ROOT / "docs" / "notebooks.md"
PARAM_NAME = re.compile(r"`([A-Z][A-Z0-9_]+)`")
VOLATILE_CELL_METADATA = ("execution",)  # JupyterLab's per-run timestamps

each = pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=nbformat.NO_CONVERT)


def where(path: Path, i: int) -> str:
    return f"{path.name} cell {i}"


def parameter_cells(book) -> list[int]:
    return [i for i, c in enumerate(book.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]


def declared(source: str) -> list[str]:
    """Names the parameters cell assigns at top level, in order."""
    names = []
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def used(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def documented() -> tuple[set[str], dict[str, set[str]]]:
    """(common parameters, notebook stem -> its own parameters) from the two tables of the
    docs/notebooks.md "Parameters" section."""
    section = DOC.read_text().split("\n## Parameters", 1)[1].split("\n## ", 1)[0]
    tables, rows = [], None
    for line in section.splitlines():
        if line.startswith("|"):
            if rows is None:
                rows = []
                tables.append(rows)
            rows.append([c.strip() for c in line.strip("|").split("|")])
        else:
            rows = None
    assert len(tables) == 2, f"{DOC}: the Parameters section needs two tables (common, per notebook), found {len(tables)}"
    common = {n for row in tables[0][2:] for n in PARAM_NAME.findall(row[0])}
    per_notebook = {row[0].strip("`"): set(PARAM_NAME.findall(row[1])) for row in tables[1][2:]}
    return common, per_notebook


def test_there_are_eight_notebooks():
    assert len(NOTEBOOKS) == 8, [p.name for p in NOTEBOOKS]


@each
def test_valid_nbformat_v4(path):
    book = read(path)
    assert book.nbformat == 4, f"{path.name}: nbformat {book.nbformat}, expected 4"
    try:
        nbformat.validate(book)
    except nbformat.ValidationError as e:
        pytest.fail(f"{path.name}: not a valid nbformat v4 notebook: {e.message}")


@each
def test_every_cell_has_an_id(path):
    """nbformat 4.5 cell ids, in the committed file itself: nbformat adds missing ones on every read
    with a warning that is to become an error (a cell added by hand or by script has none)."""
    missing = [i for i, c in enumerate(json.loads(path.read_text())["cells"]) if not c.get("id")]
    assert not missing, (f"{path.name}: cells {missing} have no id; run nbformat.validator.normalize on the "
                         "notebook (or save it from JupyterLab) before committing")


@each
def test_kernelspec(path):
    spec = read(path).metadata.get("kernelspec", {})
    assert spec.get("name") and spec.get("display_name"), f"{path.name}: metadata.kernelspec needs name and display_name, has {dict(spec)}"


@each
def test_one_parameters_cell_before_its_names_are_used(path):
    book = read(path)
    tagged = parameter_cells(book)
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters' (cells {tagged}), expected exactly one"
    p = tagged[0]
    assert book.cells[p].cell_type == "code", f"{where(path, p)}: the 'parameters' cell is {book.cells[p].cell_type}, not code"
    names = set(declared(book.cells[p].source))
    assert names, f"{where(path, p)}: the 'parameters' cell assigns no names"
    for i, cell in enumerate(book.cells[:p]):
        if cell.cell_type == "code":
            early = sorted(used(cell.source) & names)
            assert not early, f"{where(path, i)} uses {early} before the 'parameters' cell (cell {p}) sets them"


@each
def test_no_outputs_or_execution_counts(path):
    """Clear outputs before committing (JupyterLab: Edit > Clear Outputs of All Cells)."""
    for i, cell in enumerate(read(path).cells):
        if cell.cell_type == "code":
            if cell.get("outputs"):
                pytest.fail(f"{where(path, i)}: {len(cell.outputs)} stored outputs; clear outputs before committing")
            if cell.get("execution_count") is not None:
                pytest.fail(f"{where(path, i)}: execution_count {cell.execution_count}; clear outputs before committing")
        volatile = [k for k in VOLATILE_CELL_METADATA if k in cell.get("metadata", {})]
        assert not volatile, f"{where(path, i)}: run metadata {volatile} stored; clear it before committing"


@each
def test_parameters_match_docs(path):
    book = read(path)
    tagged = parameter_cells(book)
    assert tagged, f"{path.name}: no cell tagged 'parameters'"
    have = set(declared(book.cells[tagged[0]].source))
    common, per_notebook = documented()
    assert path.stem in per_notebook, f"{DOC.name}: the per-notebook parameters table has no row for `{path.stem}`"
    want = common | per_notebook[path.stem]
    assert have == want, (f"{where(path, tagged[0])} (parameters) vs {DOC.name}: declared but not documented "
                          f"{sorted(have - want)}, documented but not declared {sorted(want - have)}")
