"""Tools beside the tier, never imported by it: the ``hma-redis`` CLI (``cli``), the benchmarks
(``bench``) and the demos, examples and helpers that run vLLM on a CPU (``demo``). Their extra
imports are optional extras of the package (``[bench]``, ``[demo]``)."""
