"""Load a user's object named 'package.module:name' in the config (an algorithm, a reward
function, an environment), with an error that names the config key and the fix."""

import importlib


def load_object(spec: str, key: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} '{spec}' must be 'package.module:name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"{key} '{spec}' cannot be imported ({e}); use 'module:name' with the module on PYTHONPATH"
        ) from None
