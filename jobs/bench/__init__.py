"""The benchmarks behind ``hpc bench``, kept out of the libraries they measure.

They sit above ``parallel`` and ``hpc.checkpoint`` in the dependency order, so those
packages carry no measurement code; ``jobs.bench.rank`` is what every benchmark rank runs.
"""
