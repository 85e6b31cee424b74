"""Triton kernels of fastdet.ops, registered as ``fastdet_triton::*`` custom ops.

Importing this package needs triton; the dispatch (``fastdet.ops.dispatch``) imports it
only when the Triton back end is chosen. Kernels run on CUDA tensors, or on CPU tensors
in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which is
how the CPU test suite checks them.

The launchers are wrapped in ``torch.library.custom_op`` (not ``triton_op``) with fake
implementations: a ``triton_op`` fails under torch.compile with the interpreter, and a
custom op behaves the same on a GPU (opaque to inductor, captured by CUDA graphs).
"""

from fastdet.ops.triton import assign, ema, fcos, iou, simota  # noqa: F401  (registers the ops)
