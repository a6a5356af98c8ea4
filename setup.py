"""Compiles the scheduler's hot modules with Cython (their type declarations are the .pxd files beside them).

The modules stay plain Python: without a C compiler the build of an extension fails softly (``optional=True``) and
the package runs them from source, only slower. ``ascend_emu/_build.py`` picks the compiled or the source modules at
import time. Everything else about the package is in pyproject.toml.
"""
import ast
import re
from pathlib import Path

from setuptools import Extension, setup

# one list of the compiled modules: ascend_emu/_build.py's (read, not imported: the package's dependencies may not
# be installed yet when this runs)
_src = Path(__file__).with_name("ascend_emu").joinpath("_build.py").read_text()
COMPILED = ast.literal_eval(re.search(r"^COMPILED = (\(.*?\))$", _src, re.M).group(1))

try:
    from Cython.Build import cythonize
except ImportError:          # a build without Cython: the package runs from source
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension(f"ascend_emu.{m}", [f"ascend_emu/{m}.py"], optional=True) for m in COMPILED],
        compiler_directives={"language_level": 3, "annotation_typing": False},
        quiet=True)

setup(ext_modules=ext_modules, options={"build_ext": {"parallel": 2}})
