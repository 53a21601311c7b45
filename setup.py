# cffi's setuptools hook still needs setup(); everything else is in pyproject.toml.
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # build backends do not put it there
from build_ffi import lease_extension  # noqa: E402

setup(cffi_modules=["build_ffi.py:ffibuilder"], ext_modules=[lease_extension()])
