"""The one compiled piece: the fused Adam chunk update (src/leto_lightning/updater/_fused_adam.c).

Everything else about the package is in pyproject.toml. ``optional=True``: without a C compiler
the package still installs, and chunk transactions run torch's own Adam math instead
(``leto_lightning.updater.fused_adam`` says which path is active and why).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "leto_lightning.updater._fused_adam",
    sources=["src/leto_lightning/updater/_fused_adam.c"],
    # -ffp-contract=off: the kernel's roundings must be exactly torch's (see the C file).
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
    libraries=["m"],
    optional=True,
)])
