"""knnconv's tooling: the benchmarks (``bench``, ``bench_networks``), the demo and the
``knnconv`` command (``cli``). Nothing in the library imports this package."""
