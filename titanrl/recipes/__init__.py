"""The recipe registry: what `job.recipe` names."""

from titanrl.recipes.base import Recipe
from titanrl.recipes.dpo import DPORecipe
from titanrl.recipes.reward_model import RewardModelRecipe
from titanrl.recipes.rl import RLRecipe
from titanrl.recipes.sft import SFTRecipe

RECIPES: dict[str, type[Recipe]] = {cls.name: cls for cls in (RLRecipe, SFTRecipe, DPORecipe, RewardModelRecipe)}


def get_recipe(name: str) -> type[Recipe]:
    return RECIPES[name]  # job.recipe is a Literal of these names, checked at load


__all__ = ["RECIPES", "Recipe", "get_recipe"]
