"""Compiles the scheduler's hot modules with Cython (their type declarations are the .pxd files beside them), and the
shared-memory rings' C side with cffi (ascend_emu/shm_ring_build.py).

The modules stay plain Python: without a C compiler the build of an extension fails softly (``optional=True``) and
the package runs them from source, only slower. Once every one of them is built, the digest of the sources they were
built from goes next to them (``ascend_emu/_compiled.json``); ``ascend_emu/_build.py`` imports the compiled modules
only while that digest matches the sources. Everything else about the package is in pyproject.toml.
"""
import importlib.util
import json
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# _build.py is stdlib-only: loaded on its own, since the package's dependencies may not be installed yet
_spec = importlib.util.spec_from_file_location("_ascend_emu_build", HERE / "ascend_emu" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)


class BuildExt(build_ext):
    """build_ext that records the sources' digest once every compiled module built (and drops a stale record)."""

    def build_extension(self, ext):
        super().build_extension(ext)       # raises when it fails (an optional extension's failure is caught above)
        self._built.add(ext.name)

    def run(self):
        self._built = set()
        super().run()
        record = Path(self.get_ext_fullpath("ascend_emu.engine")).parent / _build.RECORD
        if self._built >= {f"ascend_emu.{m}" for m in _build.COMPILED}:
            record.write_text(json.dumps({"digest": _build.source_digest(HERE / "ascend_emu")}) + "\n")
        elif record.exists():
            record.unlink()


try:
    from Cython.Build import cythonize
except ImportError:          # a build without Cython: the package runs from source
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension(f"ascend_emu.{m}", [f"ascend_emu/{m}.py"], optional=True) for m in _build.COMPILED],
        compiler_directives={"language_level": 3, "annotation_typing": False},
        quiet=True)

# the shared-memory message rings' C11 atomics (ascend_emu.shm_ring), through cffi; without a compiler the rings
# run their pure-Python fallback
_ring_spec = importlib.util.spec_from_file_location("_ascend_emu_ring", HERE / "ascend_emu" / "shm_ring_build.py")
_ring = importlib.util.module_from_spec(_ring_spec)
_ring_spec.loader.exec_module(_ring)
try:
    _ring_ext = _ring.ffibuilder().distutils_extension(str(HERE / "build" / "cffi"), verbose=False)
except ImportError:          # no cffi at build time
    pass
else:
    _ring_ext.optional = True
    _ring_ext.sources = [str(Path(src).relative_to(HERE)) for src in _ring_ext.sources]
    ext_modules.append(_ring_ext)

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt}, options={"build_ext": {"parallel": 2}})
