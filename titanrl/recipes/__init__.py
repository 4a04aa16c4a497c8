"""The recipe registry: what `job.recipe` names. A built-in name ('rl', 'sft', 'dpo',
'reward_model'), or a user's `Recipe` subclass forked out of the tree (`titanrl cp`):
'package.module:Class', 'path/to/file.py:Class', or 'path/to/file.py' holding one subclass."""

import inspect
import os

from titanrl.components.plugins import load_file, load_object
from titanrl.recipes.base import Recipe
from titanrl.recipes.dpo import DPORecipe
from titanrl.recipes.reward_model import RewardModelRecipe
from titanrl.recipes.rl_recipe import RLRecipe
from titanrl.recipes.sft import SFTRecipe

RECIPES: dict[str, type[Recipe]] = {cls.name: cls for cls in (RLRecipe, SFTRecipe, DPORecipe, RewardModelRecipe)}


def get_recipe(spec: str, config_file: str = "") -> type[Recipe]:
    """The Recipe class `spec` (job.recipe) names; ValueError when it cannot be imported or is
    not a Recipe subclass. A relative file path is looked up in the current directory, then
    beside `config_file` (job.config_file)."""
    if spec in RECIPES:
        return RECIPES[spec]
    base_dir = os.path.dirname(os.path.abspath(config_file)) if config_file else ""
    if spec.endswith(".py"):
        return _only_recipe(spec, load_file(spec, "job.recipe", base_dir))
    cls = load_object(spec, "job.recipe", base_dir)
    if not (inspect.isclass(cls) and issubclass(cls, Recipe)):
        raise ValueError(
            f"job.recipe '{spec}' is {_describe(cls)}, not a subclass of titanrl.recipes.base.Recipe; "
            "name a Recipe subclass (`titanrl cp rl my_rl.py` copies the RL recipe to start from)"
        )
    return cls


def _only_recipe(spec: str, module) -> type[Recipe]:
    """The one Recipe subclass defined in `module` (a file given without ':Class')."""
    found = [
        c
        for c in vars(module).values()
        if inspect.isclass(c) and issubclass(c, Recipe) and c.__module__ == module.__name__
    ]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(
            f"job.recipe '{spec}' must define exactly one Recipe subclass to be named without ':Class', "
            f"it defines {names}; write '{spec}:Class'"
        )
    return found[0]


def _describe(obj) -> str:
    return (
        f"the {type(obj).__name__} '{getattr(obj, '__name__', obj)}'"
        if not inspect.isclass(obj)
        else f"class {obj.__name__}"
    )


__all__ = ["RECIPES", "Recipe", "get_recipe"]
