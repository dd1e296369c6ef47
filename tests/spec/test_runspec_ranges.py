"""docs/runspec.md states every numeric field's range as the spec enforces it: the row's
range cell opens with the interval the field declares (spec/codec.py `num`), open ends
included. A bound changed in code and not in the reference fails here, so an operator
reading the table is never refused by a value it allows (nor the other way round)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spec import RunSpec
from tests.spec.bounds_walk import NumericField, numeric_fields

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runspec.md"
SECTION = re.compile(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", re.M | re.S)
INTERVAL = re.compile(r"([\[(])\s*(-?[0-9][0-9.,^⁰¹²³⁴⁵⁶⁷⁸⁹⁻−e+-]*)\s*,"
                      r"\s*(-?[0-9][0-9.,^⁰¹²³⁴⁵⁶⁷⁸⁹⁻−e+-]*)\s*(?:\([^)]*\)\s*)?([\])])")
SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻−", "0123456789--")
# Sections whose fields the table documents inside their parent's row (an inline object),
# with the words that row must name.
INLINE = {"train.layout": ("tp", "pp", "zero"),
          "train.cluster": ("memory_gb", "intra_node_gbps", "inter_node_gbps"),
          "sweep.space.lr": ("low", "high"), "distill.student": ("model",)}


def sections() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in SECTION.finditer(DOCS.read_text())}


def locate(path: str, known: dict[str, str]) -> tuple[str, str]:
    """(section, row name) of a dotted field: the longest documented section prefix."""
    parts = path.replace("[0]", "[]").split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i]), ".".join(parts[i:])
    return "RunSpec", path


def number(text: str) -> float:
    """A number as the table writes it: 10^12, 2^32, 2⁶³−1, 0.05, 1e-12, 65,536."""
    t = text.replace(",", "").replace("−", "-")
    if m := re.fullmatch(r"(\d+)([⁰¹²³⁴⁵⁶⁷⁸⁹]+)(-1)?", t):
        t = f"{m.group(1)}^{m.group(2).translate(SUPERSCRIPT)}{m.group(3) or ''}"
    if m := re.fullmatch(r"(\d+)\^(\d+)(-1)?", t):
        return float(int(m.group(1)) ** int(m.group(2)) - (1 if m.group(3) else 0))
    return float(t)


def row_cell(nf: NumericField, known: dict[str, str]) -> str | None:
    section, name = locate(nf.path, known)
    row = re.search(rf"^\| `{re.escape(name)}` \|.*\| ([^|]*) \|$", known[section], re.M)
    return row.group(1) if row else None


FIELDS = [nf for nf in numeric_fields(RunSpec)
          if not any(nf.path.startswith(p + ".") for p in INLINE)]


@pytest.mark.parametrize("nf", FIELDS, ids=lambda nf: nf.path)
def test_each_numeric_fields_row_states_the_range_the_spec_enforces(nf):
    cell = row_cell(nf, sections())
    assert cell is not None, f"docs/runspec.md has no row for {nf.path}"
    found = INTERVAL.search(cell)
    assert found, f"{nf.path}: its range cell states no interval: {cell[:80]!r}"
    (lo, hi), (lo_open, hi_open) = nf.range, nf.open
    assert (number(found.group(2)), number(found.group(3))) == (float(lo), float(hi)), \
        f"{nf.path}: docs say {found.group(0)}, the spec enforces {nf.range}"
    assert (found.group(1) == "(", found.group(4) == ")") == (lo_open, hi_open), \
        f"{nf.path}: docs say {found.group(0)}, the spec's open ends are {nf.open}"


@pytest.mark.parametrize("section, words", INLINE.items())
def test_a_section_documented_inline_is_named_in_its_parents_row(section, words):
    parent, name = section.rsplit(".", 1) if section.count(".") == 1 else \
        (section.split(".")[0], section.split(".")[1])
    row = re.search(rf"^\| `{name}` \|([^\n]*)$", sections()[parent], re.M)
    assert row, f"docs/runspec.md has no row for {parent}.{name}"
    for word in words:
        assert word in row.group(1), f"{parent}.{name}'s row does not name {word}"
