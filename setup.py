"""Build of the optional native dequantization kernels (everything else is in pyproject.toml).

`optional=True`: without a C compiler the package installs anyway and dequantizes with its torch
kernels (`llmdoctor.gguf.dequant_native.available()` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "llmdoctor.gguf._dequant_native",
            sources=["src/llmdoctor/gguf/_dequant_native.c", "src/llmdoctor/gguf/_dequant_pool.c"],
            # Bit-exactness with gguf-py needs each product and sum rounded on its own: no FMA
            # contraction, no fast-math reassociation.
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        ),
        Extension(  # the forensics accumulator's moment passes (checks/file/forensics.py; fixed summation order)
            "llmdoctor.checks.file._forensics_native",
            sources=["src/llmdoctor/checks/file/_forensics_native.c"],
            extra_compile_args=["-O2", "-funroll-loops", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        ),
    ]
)
