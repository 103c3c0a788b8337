"""Command-line entry points: the composition root, the only place that imports every package."""
