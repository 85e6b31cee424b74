"""The runtime layer, below everything that trains, scores, converts or loads data.

- ``dist``: the process group, rank-aware broadcasts and means, seeds;
- ``checkpoint``: reading and writing checkpoints and weight files (the safe unpickler);
- ``logging``: the log setup, progress, NVTX ranges, TensorBoard, timers;
- ``amp``: the AMP dtype and the cuDNN / TF32 flags a run uses.

It imports nothing from fastdet but ``fastdet.config`` (the import contract in
pyproject.toml checks it).
"""
