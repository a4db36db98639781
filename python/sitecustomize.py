"""Put on PYTHONPATH by `vramd run`: installs vramd's allocator into PyTorch as soon as the
program imports torch, before its first CUDA allocation. Programs that do not import torch are
left alone. Then runs the sitecustomize this one shadows, if there is one."""

import os
import sys


# The first words of this file: how a sitecustomize knows another copy of itself (a nested
# `vramd run`, or python/ also on PYTHONPATH, puts more than one on the path).
_MARK = "Put on PYTHONPATH by `vramd run`"


def _ours(origin):
    try:
        with open(origin, encoding="utf-8") as f:
            return _MARK in f.read(200)
    except (OSError, UnicodeDecodeError):
        return False


def _chain():
    """Runs the first sitecustomize on the path that is not a copy of this one."""
    import importlib.machinery
    import importlib.util

    path = list(sys.path)
    while True:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is None or spec.loader is None:
            return
        if not (spec.origin and _ours(spec.origin)):
            break
        here = os.path.dirname(os.path.abspath(spec.origin))
        path = [p for p in path if os.path.abspath(p or ".") != here]
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


# `vramd run` always names the mode. Without it this file was put on the path by hand, with no
# tenant to serve: PyTorch is left as it is.
_mode = os.environ.get("VRAMD_TORCH_MODE")
if _mode:
    try:
        from vramd_torch import _hook

        _hook.install_on_import(_mode)
    except Exception as e:  # never break the program's start
        print(f"vramd: cannot set up PyTorch integration: {e}", file=sys.stderr)
_chain()
