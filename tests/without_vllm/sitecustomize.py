"""Python as if vLLM were not installed, for checking the suite's no-vLLM path on a machine that has it:
`PYTHONPATH=tests/without_vllm python -m pytest`. Every process that inherits PYTHONPATH (the subprocess runs of
scalerl.py and torchrun included) imports this first: `import vllm` raises ModuleNotFoundError and
importlib.util.find_spec("vllm") is None, as after `pip uninstall vllm`."""
import sys


class Hidden:
    """One of the interpreter's import finders, blind to the vllm package."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "vllm":
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, name)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
