"""Fixtures for the protection tests (helpers live in rs_helpers.py)."""

from __future__ import annotations

import pytest

from leto_lightning.protection.engines import available_engines, get_engine

ENGINE_NAMES = available_engines()


@pytest.fixture(params=ENGINE_NAMES)
def engine(request):
    """Every engine that can run on this machine."""
    return get_engine(request.param)
