"""The optional C extension (router/_keys.c, see router/native.py); the rest of the
package is described in pyproject.toml.

`optional=True`: where no C compiler or no OpenSSL headers are found, the install goes on
without it and the gateway uses its pure-Python path (same keys, more CPU per token)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("router._keys", ["router/_keys.c"], libraries=["crypto"],
                             extra_compile_args=["-O2"], optional=True)])
