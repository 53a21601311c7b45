# setup() for what pyproject.toml cannot say: the cffi module (cffi's setuptools hook)
# and the lease type's extension, both built by build_ffi.py with the same flags.
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # build backends do not put it there
from build_ffi import lease_extension  # noqa: E402

setup(cffi_modules=["build_ffi.py:ffibuilder"], ext_modules=[lease_extension()])
