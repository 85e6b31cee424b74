"""fastdet: a compiled-graph, high-throughput trainer for object detectors."""

__version__ = "0.1.0"
