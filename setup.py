"""The optional C extensions (router/_keys.c, see router/native.py; router/index/_upkeep.c,
see router/index/memory.py); the rest of the package is described in pyproject.toml.

`optional=True`: where no C compiler or no OpenSSL headers are found, the install goes on
without them and the gateway uses its pure-Python paths (same keys and index, more CPU
per token and per block)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("router._keys", ["router/_keys.c"], libraries=["crypto"],
                             extra_compile_args=["-O2"], optional=True),
                   Extension("router.index._upkeep", ["router/index/_upkeep.c"],
                             extra_compile_args=["-O2"], optional=True)])
