"""Recipes by name (``recipe.name`` in the config)."""
from __future__ import annotations

import importlib

RECIPES = ("gpt2", "insightface")


def get(name: str):
    """The ``toolkit.recipe.Recipe`` of recipe ``name``."""
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r} is unknown; valid: {', '.join(RECIPES)}")
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE
