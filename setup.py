"""Builds the native residency core into vramd.gpu._residency (cffi, API
mode).  Everything else about the package is in pyproject.toml."""
from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
