"""Workloads, in four parts with one dependency order: ``bench`` -> ``train`` -> ``models`` -> ``data``.

``data``: data sets and the data protocol; ``models``: single-device models and the model protocol;
``train``: the training loop that applies each parallelism to them; ``bench``: the benchmarks.
``examples`` holds specs and scripts, not library code.
"""
