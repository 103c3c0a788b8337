"""The local test cluster (``cluster``) and the network-namespace testbed it and the benchmarks run on (``netns``)."""
