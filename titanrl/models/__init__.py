from titanrl.models.args import RopeScaling, TransformerModelArgs
from titanrl.models.flavors import flavors, get_model_args
from titanrl.models.model import Transformer

__all__ = ["RopeScaling", "Transformer", "TransformerModelArgs", "flavors", "get_model_args"]
