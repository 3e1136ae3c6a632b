"""Build the Cython kernels of fastls against SciPy's BLAS/LAPACK.

No BLAS is linked here: scipy.linalg.cython_blas/cython_lapack hand out the
function pointers of the BLAS that SciPy itself loads.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "fastls._kernels",
        ["fastls/_kernels.pyx"],
        # Without trapping math GCC may turn a per-element select (the leaky
        # ReLU) into vector blends; values are unchanged, only the FP exception
        # flags nobody reads are not preserved.
        extra_compile_args=["-O3", "-fno-trapping-math"],
    ),
    # The draws and their sums of squares must have the same bits whatever the build: no fused
    # multiply-adds, even where CFLAGS (-march=native) would allow GCC to contract them.
    Extension("fastls._random", ["fastls/_random.pyx"], extra_compile_args=["-O3", "-ffp-contract=off"]),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
