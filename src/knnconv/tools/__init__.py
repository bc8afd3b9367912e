"""knnconv's tooling: the benchmarks (``bench``, ``bench_networks``), the demo, the
``knnconv`` command (``cli``) and ``triton_build`` (the triton kernels compiled for a GPU
architecture on any machine). Nothing in the library imports this package."""
