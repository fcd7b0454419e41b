"""Expert-parallel token dispatch/combine and grouped-GEMM kernels (Triton on GPU, torch on CPU)."""

__version__ = "0.1.0"
