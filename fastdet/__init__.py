"""fastdet: a compiled-graph, high-throughput trainer for object detectors.

``fastdet.load_detector(ckpt)`` and ``fastdet.detect(det, images)`` (``fastdet.api``) use a
trained checkpoint; they are imported on first use so ``import fastdet`` stays light.
"""

__version__ = "0.1.0"

_API = ("load_detector", "detect", "preprocess_images", "DetectorInfo", "CheckpointError")


def __getattr__(name: str):
    if name in _API:
        from fastdet import api  # heavy (torch, every model family): `import fastdet` stays light

        return getattr(api, name)
    raise AttributeError(f"module 'fastdet' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, so completion and ``dir(fastdet)`` list them."""
    return sorted({*globals(), *_API})
