"""Figures render; ``sim`` imports nothing from the rest of the package but the recipe schema."""

from __future__ import annotations

import ast
from pathlib import Path

import leto_lightning.sim as sim
from leto_lightning.sim.plots import fig10_hof
from leto_lightning.sim.tables import markdown_table


def test_fig10_writes_a_png(tmp_path: Path) -> None:
    data = fig10_hof(tmp_path)
    assert (tmp_path / "fig10_hof.png").stat().st_size > 10_000
    assert data["leto"]["1.0"] > data["gemini+"]["1.0"]


def test_markdown_table() -> None:
    assert markdown_table(("a", "b"), [(1, 2)]).splitlines() == ["| a | b |", "|---|---|",
                                                                 "| 1 | 2 |"]


def test_sim_imports_only_sim() -> None:
    for path in Path(sim.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("leto_lightning"):
                    assert name.startswith("leto_lightning.sim") or name == "leto_lightning.recipes", \
                        f"{path.name} imports {name}"
