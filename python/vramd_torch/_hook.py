"""Runs `install` right after `torch` is imported, without importing it ourselves."""

import importlib.abc
import sys
import threading

_done = threading.Event()


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of `torch` so that `install` runs once its module is executed."""

    def __init__(self, mode):
        self.mode = mode

    def find_spec(self, name, path, target=None):
        if name != "torch" or _done.is_set():
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, self.mode)
        return spec


class _Loader:
    """The loader of `torch`, unchanged except that `install` runs after the module executed."""

    def __init__(self, inner, mode):
        self._inner = inner
        self._mode = mode

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _after_import(self._mode)


def _after_import(mode):
    if _done.is_set():
        return
    _done.set()
    for f in list(sys.meta_path):
        if isinstance(f, _Finder):
            sys.meta_path.remove(f)
    try:
        import vramd_torch

        vramd_torch.install(mode=mode)
    except Exception as e:
        print(f"vramd: PyTorch runs without vramd's allocator: {e}", file=sys.stderr)


def install_on_import(mode):
    if "torch" in sys.modules:
        _after_import(mode)
    else:
        sys.meta_path.insert(0, _Finder(mode))
