"""Put this folder first on PYTHONPATH and the process sees no PyTorch, as on a data-only install
(`pip install -e .` without torch): `import torch` raises ModuleNotFoundError and
importlib.util.find_spec("torch") is None (so transformers, too, finds none), for torch and the
packages that need it."""

import sys

HIDDEN = {"torch", "torchao", "torchvision", "torchaudio", "accelerate", "peft", "trl", "flash_attn", "triton", "safetensors"}


class _Hide:
    """Wraps one of sys.meta_path's finders: it finds nothing of HIDDEN, the rest as before."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]
