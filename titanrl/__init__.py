"""titanrl: PyTorch-native RL post-training for LLMs."""

from titanrl.components import console as _console

__version__ = "0.1.0"

_console.configure()  # console output through the "titanrl" logger (titanrl/components/console.py)
