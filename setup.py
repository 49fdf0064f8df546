"""Build hook: generate the gRPC stubs from proto/ before the Python files are collected.

Everything else about the package lives in pyproject.toml.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _load_protogen():
    path = Path(__file__).resolve().parent / "symphony" / "protogen.py"
    spec = importlib.util.spec_from_file_location("_symphony_protogen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def run(self):
        # Written into the source tree so that editable installs see them too.
        _load_protogen().generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
