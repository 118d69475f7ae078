"""The one thing pyproject.toml cannot say: the optional C helper of a first load (cubinstore/_core/native.py).

optional=True: where no C compiler or Python headers are found the install goes on without it,
and the Python paths do the same work."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cubinstore._core._native", ["cubinstore/_core/_native.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
