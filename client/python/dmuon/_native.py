"""Finds and loads the native extension `_dmuon` (pybind11 over the C++ client
and the kernels library).

Looked for, in order: inside this package (a wheel or an installed copy);
the directory named by $DMUON_EXTENSION_DIR; the Bazel output of the source
checkout this package sits in (bazel-bin/client/python/_dmuon.so).
"""

import importlib.machinery
import importlib.util
import os
import sys

_NAME = "dmuon._dmuon"
_FILE = "_dmuon.so"


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def checkout_root():
    """The source checkout this package sits in (client/python/dmuon), or None."""
    root = os.path.normpath(os.path.join(_package_dir(), "..", "..", ".."))
    if os.path.exists(os.path.join(root, "WORKSPACE")) and os.path.exists(
        os.path.join(root, "client", "client.h")
    ):
        return root
    return None


def candidates():
    found = [os.path.join(_package_dir(), _FILE)]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        found.append(os.path.join(_package_dir(), "_dmuon" + suffix))
    if os.environ.get("DMUON_EXTENSION_DIR"):
        found.append(os.path.join(os.environ["DMUON_EXTENSION_DIR"], _FILE))
    root = checkout_root()
    if root:
        found.append(os.path.join(root, "bazel-bin", "client", "python", _FILE))
    return found


def load():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    tried = candidates()
    for path in tried:
        if not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_NAME] = module
        return module
    hint = (
        "build it with `bazel build //client/python:_dmuon.so` (or `./dmuon build`) "
        "in the dmuon checkout, install the wheel from `./dmuon wheel`, or point "
        "$DMUON_EXTENSION_DIR at the directory holding _dmuon.so"
    )
    raise ImportError(
        "dmuon: the native extension _dmuon.so was not found (looked at: "
        + ", ".join(tried)
        + "); "
        + hint
    )


def require_torch(what):
    """Raises ModuleNotFoundError naming the extra that installs PyTorch when
    it is missing (`what` needs it; the rest of dmuon works without it)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # torch blocked or half-installed
        found = False
    if not found:
        raise ModuleNotFoundError(
            f"{what} needs PyTorch (>= 2.9), which is not installed: pip install "
            "'dmuon[torch]' (or PyTorch your way: pytorch.org). dmuon.orthogonalize, "
            "dmuon.Client and dmuon.LocalDaemon work without it.", name="torch")
