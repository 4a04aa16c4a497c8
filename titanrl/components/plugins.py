"""Load a user's object named 'package.module:name' in the config (an algorithm, a reward
function, an environment), with an error that names the config key and the fix. A module that
fails while it is imported (a SyntaxError, or any exception its top level raises, SystemExit
included) is a user error too, named by the file and line where it failed."""

import importlib
import traceback


def load_object(spec: str, key: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} '{spec}' must be 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as e:
        raise ValueError(
            f"{key} '{spec}' cannot be imported ({e}); use 'module:name' with the module on PYTHONPATH"
        ) from None
    # The module's own code raised while it ran: anything but Ctrl-C is the user's code failing.
    except (Exception, SystemExit) as e:
        raise ValueError(
            f"{key} '{spec}': importing '{module_name}' failed at {failed_at(e)}: {type(e).__name__}: "
            f'{exception_text(e)}; fix the module (run `python -c "import {module_name}"` to see the '
            "whole traceback)"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ValueError(
            f"{key} '{spec}' cannot be imported ({e}); use 'module:name' with the module on PYTHONPATH"
        ) from None


def failed_at(error: BaseException) -> str:
    """'file:line' where `error` was raised: the offending line of a SyntaxError, else the
    deepest frame of its traceback outside the import machinery."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"


def exception_text(error: BaseException) -> str:
    """The exception's message on one line (a SyntaxError's without its location, named apart)."""
    text = error.msg if isinstance(error, SyntaxError) else str(error)
    return " ".join(str(text).split()) or "(no message)"
