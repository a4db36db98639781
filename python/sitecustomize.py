"""Put on PYTHONPATH by `vramd run`: installs vramd's allocator into PyTorch as soon as the
program imports torch, before its first CUDA allocation. Programs that do not import torch are
left alone. Then runs the sitecustomize this one shadows, if there is one."""

import os
import sys


def _chain():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    from vramd_torch import _hook

    _hook.install_on_import(os.environ.get("VRAMD_TORCH_MODE", "pool"))
except Exception as e:  # never break the program's start
    print(f"vramd: cannot set up PyTorch integration: {e}", file=sys.stderr)
_chain()
