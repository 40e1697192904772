"""`when_imported(name, callback)`: run code right after a module is imported, once.

The bootstrap patches torch and horovod.torch this way, so a worker that never imports
them pays nothing, and one that does is patched before the script's next line runs.
"""

import importlib.abc
import sys


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` right after `name` has been imported, once."""

    def __init__(self, name, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec


def when_imported(name, callback):
    """Run callback(module) now if `name` is already imported, else right after its import."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PostImportHook(name, callback))
