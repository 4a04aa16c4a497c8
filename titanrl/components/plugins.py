"""Load a user's object named 'package.module:name' in the config (an algorithm, a reward
function, an environment, a recipe), or 'path/to/file.py:name' for a file that is not on
PYTHONPATH, with an error that names the config key and the fix. A module that fails while it
is imported (a SyntaxError, or any exception its top level raises, SystemExit included) is a
user error too, named by the file and line where it failed."""

import importlib
import importlib.util
import os
import sys
import traceback
from types import ModuleType


def load_object(spec: str, key: str, base_dir: str = ""):
    """The object `spec` names: 'package.module:name' or 'path/to/file.py:name' (`load_file`)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} '{spec}' must be 'package.module:name' or 'path/to/file.py:name'")
    if module_name.endswith(".py"):
        module = load_file(module_name, key, base_dir)
    else:
        module = import_module(module_name, key, spec)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        fix = (
            f"name one defined in {module.__file__}"
            if module_name.endswith(".py")
            else "use 'module:name' with the module on PYTHONPATH"
        )
        raise ValueError(f"{key} '{spec}' cannot be imported ({e}); {fix}") from None


def import_module(module_name: str, key: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
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


def find_file(path: str, key: str, base_dir: str = "") -> str:
    """The absolute path of `path`: as given (relative to the current directory), else relative
    to `base_dir` (the config file's folder), whichever exists first."""
    candidates = [path] if os.path.isabs(path) else [path, *([os.path.join(base_dir, path)] if base_dir else [])]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    where = " or ".join(f"'{os.path.abspath(c)}'" for c in candidates)
    raise ValueError(
        f"{key}: no file {where}; give the path of a .py file (absolute, or relative to the current directory)"
    )


def load_file(path: str, key: str, base_dir: str = "") -> ModuleType:
    """Import the Python file `path` as a module named by its file name (once per process: a
    second load of the same file returns the first module)."""
    path = find_file(path, key, base_dir)
    name = os.path.splitext(os.path.basename(path))[0]
    loaded = sys.modules.get(name)
    if loaded is not None:
        if os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
            return loaded
        raise ValueError(
            f"{key}: '{path}' would be imported as module '{name}', which is already another module "
            f"({getattr(loaded, '__file__', None) or 'built in'}); rename the file"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look the module up there
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ValueError(
            f"{key}: importing '{path}' failed at {failed_at(e)}: {type(e).__name__}: {exception_text(e)}; "
            f"fix the file (run `python {path}` to see the whole traceback)"
        ) from None
    return module


def failed_at(error: BaseException) -> str:
    """'file:line' where `error` was raised: the offending line of a SyntaxError, else the
    deepest frame of its traceback outside the import machinery and installed packages (the
    user's line: a `sys.exit` passes through wandb's exit hook once wandb is imported; a call
    into a library is named where the user's code made it), or the deepest frame if none is."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
    own = [f for f in frames if not any(part in f.filename for part in ("site-packages", "dist-packages"))]
    frame = (own or frames)[-1] if frames else None
    return f"{frame.filename}:{frame.lineno}" if frame is not None else "an unknown place"


def exception_text(error: BaseException) -> str:
    """The exception's message on one line (a SyntaxError's without its location, named apart)."""
    text = error.msg if isinstance(error, SyntaxError) else str(error)
    return " ".join(str(text).split()) or "(no message)"
