"""Figures render; markdown tables."""

from __future__ import annotations

from pathlib import Path

from leto_lightning.sim.plots import fig10_hof, fig16_spares_hof
from leto_lightning.sim.tables import markdown_table


def test_fig10_writes_a_png(tmp_path: Path) -> None:
    data = fig10_hof(tmp_path)
    assert (tmp_path / "fig10_hof.png").stat().st_size > 10_000
    assert data["leto"]["1.0"] > data["gemini+"]["1.0"]


def test_markdown_table() -> None:
    assert markdown_table(("a", "b"), [(1, 2)]).splitlines() == ["| a | b |", "|---|---|",
                                                                 "| 1 | 2 |"]


# What sim/ may import (only sim/, the recipe schema and errors; no torch): tests/test_layering.py.


def test_fig16_spares_writes_a_png(tmp_path: Path) -> None:
    data = fig16_spares_hof(tmp_path)
    assert (tmp_path / "fig16_spares_hof.png").stat().st_size > 10_000
    for comm in ("stock", "scalable"):
        leto, spares = data[f"{comm}/leto"], data[f"{comm}/leto+spares"]
        assert spares["1.0"] == leto["1.0"] and spares["0.0"] > leto["0.0"]  # type: ignore[index]
