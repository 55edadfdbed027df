"""Functions that travel to the workers by import path, never as pickled code (apply_model).

A path is "package.module:function" or "package.module.function" (as worker_extension_cls);
after the colon a dotted name reaches into a class ("package.module:Class.static_method").
The caller turns a module-level function into its path (`function_path`); the worker imports it
(`import_function`). A lambda, a closure or a function of `__main__` has no path another
process can import, and is refused with the reason.
"""
import importlib
from collections.abc import Callable

from engine.errors import InvalidRequestError


def function_path(fn: Callable | str, param: str = "fn") -> str:
    """The import path of a module-level function (a string is taken as one already)."""
    if isinstance(fn, str):
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not module or not qualname:
        raise InvalidRequestError(f"{param} must be a module-level function or its import path "
                                  f"('package.module:function'), got {fn!r}", param)
    if "<" in qualname:  # <lambda>, <locals>
        raise InvalidRequestError(f"{param} {qualname!r} is a lambda or a closure: the workers import functions by "
                                  "name, never run pickled code; define it at module level", param)
    if module == "__main__":
        raise InvalidRequestError(f"{param} {qualname!r} lives in __main__, which the engine's processes cannot "
                                  "import: define it in a module of its own", param)
    path = f"{module}:{qualname}"
    try:
        found = import_function(path, param)
    except InvalidRequestError:
        found = None
    if found != fn:  # (a class method found again is a new bound method, equal to fn)
        raise InvalidRequestError(f"{param} {fn!r} is not reachable as {path!r} (a bound method or a "
                                  "decorated function): pass a module-level function", param)
    return path


def import_function(path: str, param: str = "fn") -> Callable:
    """The function an import path names; InvalidRequestError when it names none."""
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(f"{param} must be an import path ('package.module:function'), got {path!r}", param)
    module_name, colon, qualname = path.partition(":")
    if not colon:
        module_name, _, qualname = path.rpartition(".")
    if not module_name or not qualname:
        raise InvalidRequestError(f"{param} {path!r} is not an import path ('package.module:function')", param)
    try:
        obj = importlib.import_module(module_name)
        for name in qualname.split("."):
            obj = getattr(obj, name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InvalidRequestError(f"{param} {path!r} cannot be imported: {e}", param) from None
    if not callable(obj) or isinstance(obj, type):
        raise InvalidRequestError(f"{param} {path!r} is not a function", param)
    return obj
