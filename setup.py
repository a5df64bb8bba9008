"""The one thing pyproject.toml cannot say: ``peft_ext_autoload.pth`` goes to the top of site-packages (beside the
packages), where Python's ``site`` runs it; everything else is in pyproject.toml."""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "peft_ext_autoload.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also puts :data:`PTH` at the root of the build (and so of the wheel)."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), os.path.join(self.build_lib, PTH): PTH}


setup(cmdclass={"build_py": BuildPyWithPth})
