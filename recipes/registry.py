"""Recipes by name (``recipe.name`` in the config): a built-in one, or ``module:attribute`` of your own.

``recipe.name=my_package.my_recipe:RECIPE`` imports ``my_package.my_recipe``
(from the Python path, e.g. ``PYTHONPATH=.``) and takes its ``RECIPE``, an
instance of ``toolkit.recipe.Recipe`` (``docs/writing-a-recipe.md``).
"""
from __future__ import annotations

import importlib

RECIPES = ("gpt2", "llama", "insightface", "wide_deep")


def get(name: str):
    """The ``toolkit.recipe.Recipe`` of recipe ``name``."""
    if name in RECIPES:
        return importlib.import_module(f"recipes.{name}.recipe").RECIPE
    if ":" not in name:
        raise ValueError(f"recipe {name!r} is unknown; valid: {', '.join(RECIPES)}, or module:attribute of a "
                         "Recipe of your own (e.g. my_recipes.blobs:RECIPE)")
    module, _, attr = name.partition(":")
    try:
        recipe = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"recipe {name!r}: cannot import {attr} from {module} ({exc}); is its package on the "
                         "Python path (PYTHONPATH)?") from exc
    from toolkit.recipe import Recipe

    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe {name!r} is a {type(recipe).__name__}, not a toolkit.recipe.Recipe instance")
    return recipe
