"""The one train step, its compile boundary and its CUDA graphs.

``TrainStep(batch, loss_kwargs)`` runs forward with loss, backward, optional gradient
clipping over the global gradient norm, the optimizer update and the EMA update, and adds the
detached losses into a device accumulator. Nothing in it reads a value back to the
host: the trainer reads the accumulator every ``log_interval`` steps.

Compilation (``--compile``): the model-with-loss is wrapped in
``torch.compile(fullgraph=True, dynamic=False)``. Backward runs through AOTAutograd's
compiled backward; the optimizer and EMA are a handful of foreach kernels outside the
graph (``optimizer.step()`` always breaks a Dynamo graph, COMPILE.md §0.1). Every
(image size, loss-kwargs) bucket compiles once, during :meth:`TrainStep.warmup`;
afterwards :meth:`check_recompiles` fails loudly if Dynamo compiled anything new.

DDP with ``--compile``: the compiled module goes *inside* DDP, ``DDP(torch.compile(model))``.
DDP's own forward (its logger, reducer bookkeeping) runs eagerly, so Dynamo never traces it
(``torch.compile(DDP(model), fullgraph=True)`` fails on ``Logger.set_runtime_stats_and_log``),
and the model's forward stays one Dynamo graph with 0 breaks (``fullgraph=True`` enforces
it). Because DDP calls the compiled module inside ``_inside_ddp_forward``, Dynamo's
DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default) cuts that one captured
graph at DDP's gradient-bucket boundaries and compiles each piece separately: walking the
graph from its output end (head, then neck, then backbone), it cuts where the parameters
seen since the last cut exceed ``bucket_cap_mb`` (25 MB by default). PP-YOLOE-s has 29 MB
of fp32 gradients, so one cut near the start of the backbone; PP-YOLOE-l (~200 MB) about
eight. Each piece's backward then lets its bucket's all-reduce start while the earlier
layers' backward runs. The cuts are backend-level splits of one Dynamo graph, not graph
breaks: ``unique_graphs`` stays one per shape bucket.

CUDA graphs (``--cuda-graphs``): the whole step (zero grads, forward, backward,
clipping, optimizer, EMA, loss accumulation) is captured once per bucket, after
warm-up iterations on a side stream, and replayed with the batch copied into static
input buffers (the MLPerf recipe). All persistent state (weights, grads, momentum,
EMA, LR and decay tensors, the accumulator) is allocated before capture, outside the
graphs' shared memory pool, so graphs of different sizes can share one pool and be
replayed in any order. The LR is a device tensor written before each replay.
Gradients are allocated once, before the first warm-up of the first capture, and only
ever zeroed in place from then on: ``zero_grad(set_to_none=True)`` in a later bucket's
warm-up would free the ``.grad`` tensors that earlier graphs write and read.

Every bucket is captured by :meth:`TrainStep.warmup`, before training starts; after it a
batch of an unseen bucket raises instead of capturing mid-training (the loader threads use
the GPU by then, and a capture would also cost seconds in the middle of an epoch). Captures
use ``capture_error_mode="thread_local"`` all the same: DALI's and the loader's threads may
already be running during warm-up, and their CUDA calls must not invalidate the capture.
Under DDP, DDP is constructed on a side stream and warmed up >= 11 iterations before
capture, as the PyTorch CUDA-graph notes require.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch._dynamo
from torch import Tensor, nn

from fastdet import registry
from fastdet.config import Config, ModelConfig
from fastdet.data.layout import STEP_KEYS as INPUT_KEYS
from fastdet.data.layout import TARGET_KEYS
from fastdet.engine.graph_cache import cache_counts, count_delta, same_keys_in_every_process
from fastdet.engine.host_sync import HostSyncGuard
from fastdet.engine.optim import build_optimizer_and_ema
from fastdet.engine.sync_bn import convert_sync_batchnorm
from fastdet.ops import dispatch
from fastdet.runtime.amp import resolve_amp
from fastdet.runtime.logging import Nvtx

log = logging.getLogger("fastdet")

# Slots of the loss accumulator, allocated at construction (before any warm-up or capture)
# because the loss names are only known after the first forward.
MAX_LOSSES = 16


def _kw_key(kw: dict[str, Any]) -> tuple:
    return tuple(sorted(kw.items()))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]


class _Twin(nn.Module):
    """The step's module and its compiled form; ``use_compiled`` picks which one a call
    runs. One module, so DDP wraps it once and both share its buckets and hooks."""

    def __init__(self, net: nn.Module, compiled: Callable[..., Any]):
        super().__init__()
        self.net = net
        object.__setattr__(self, "compiled", compiled)  # not a second registered submodule
        self.use_compiled = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.compiled if self.use_compiled else self.net)(*args, **kwargs)


@dataclass
class Switch:
    """A bucket moved from its eager twin to its compiled (and captured) step."""

    key: tuple  # (H, W, loss arguments)
    seconds: float  # that step, compile (cache load) and capture included
    graphs: int  # Dynamo graphs it compiled (1 expected)
    cache: dict[str, int]  # inductor cache hits and misses during it


class TrainStep:
    """Callable train step over one model, optimizer and (optional) EMA.

    Args:
        model: the plain module (already on ``device``); its state is what is saved.
        net: what the forward calls: ``model`` (or a module sharing its parameters).
        ddp: wraps the (compiled) ``net`` in DDP, e.g. ``lambda m: DDP(m)``; None when not
            distributed. Called here so that DDP wraps the compiled module (see above).
        optimizer: a :class:`~fastdet.engine.optim.CapturableSGD`.
        ema: an EMA object with ``update(model)`` or None.
        amp_dtype: autocast dtype or None for fp32.
        clip_grad_norm: max global norm of all trained gradients (0 disables).
        compile: wrap ``net`` in ``torch.compile(fullgraph=True)``.
        backend: the ``torch.compile`` backend (``inductor``; ``aot_eager`` for quick tests).
        cuda_graphs: capture the whole step per bucket (CUDA only, no fp16 scaler).
        graph_warmup_iters: eager iterations before each capture (DDP needs >= 11).
    """

    def __init__(self, model: nn.Module, net: nn.Module, optimizer: torch.optim.Optimizer,
                 ema: Any, device: torch.device, amp_dtype: torch.dtype | None,
                 clip_grad_norm: float = 0.0, compile: bool = False, cuda_graphs: bool = False,
                 graph_warmup_iters: int = 3, nvtx: Nvtx | None = None,
                 ddp: Callable[[nn.Module], nn.Module] | None = None, backend: str = "inductor",
                 background: bool = False, shapes: str = "static"):
        if cuda_graphs and device.type != "cuda":
            raise ValueError("--cuda-graphs needs a CUDA device (got --device cpu): drop the flag")
        if cuda_graphs and amp_dtype == torch.float16:
            raise ValueError("--cuda-graphs cannot capture fp16's GradScaler (it syncs with the "
                             "host every step): use --amp bf16 or --amp off")
        if cuda_graphs:
            # A failed extension build must not silently put other kernels into the graphs.
            dispatch.require_defaults(device.type, "--cuda-graphs")
        self.model, self.optimizer, self.ema = model, optimizer, ema
        self.device, self.amp_dtype = device, amp_dtype
        self.clip = clip_grad_norm
        self.cuda_graphs = cuda_graphs
        self.graph_warmup_iters = graph_warmup_iters
        self.nvtx = nvtx or Nvtx(False)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        if compile:
            same_keys_in_every_process()
        # dynamic=False: every shape static but what compile.shapes=dynamic marks (H, W).
        forward = torch.compile(net, fullgraph=True, dynamic=False, backend=backend) if compile else net
        # compile.warmup=background: a bucket runs eagerly until mark_ready (begin_background).
        self._twin = _Twin(net, forward) if (compile and background) else None
        if self._twin is not None:
            forward = self._twin
        if ddp is not None:
            if cuda_graphs:
                # The CUDA-graph notes: DDP's reducer must be built on a side stream for its
                # all-reduces to be capturable.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    forward = ddp(forward)
                torch.cuda.current_stream().wait_stream(side)
            else:
                forward = ddp(forward)
        self.forward: Callable[..., dict[str, Tensor]] = forward
        self._ddp = ddp is not None  # DDP's own bookkeeping is not ours to check (check_capturable)
        self.compiled = compile
        # compile.shapes=dynamic: the images' H and W are symbolic (mark_dynamic), so one
        # graph can serve several sizes where the backend allows it (aot_eager does; inductor
        # on the CPU still specialises per size: COMPILE.md section 9).
        self.mark_hw_dynamic = compile and shapes == "dynamic"
        self.loss_names: tuple[str, ...] | None = None
        # [MAX_LOSSES] device accumulator of the named losses (the first K slots are used).
        # It exists before warm-up, so _preserve_state restores it and graphs capture it.
        self.loss_sum = torch.zeros(MAX_LOSSES, device=device)
        self.steps_accumulated = 0
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self._graphs_after_warmup: int | None = None
        self._buckets = 0
        self._warmed_up = False
        self._ready: set[tuple] = set()  # buckets whose graph can be loaded
        self._live: set[tuple] = set()  # buckets running compiled
        self.switches: list[Switch] = []  # logged and emptied by take_switches
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]

    # ------------------------------------------------------------------ the step body
    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _body(self, inputs: dict[str, Tensor], kw: dict[str, Any]) -> None:
        if self.cuda_graphs:
            # Grads are static tensors allocated once (_allocate_grads) that every graph
            # writes: zeroed in place, never freed.
            torch._foreach_zero_([p.grad for p in self.params])
        else:
            self.optimizer.zero_grad(set_to_none=True)
        targets = {k: inputs[k] for k in TARGET_KEYS}
        images = inputs["images"]
        if self.mark_hw_dynamic:
            torch._dynamo.mark_dynamic(images, 2)
            torch._dynamo.mark_dynamic(images, 3)
        with self.nvtx("forward"), self._autocast():
            losses = self.forward(images, targets, **kw)
        with self.nvtx("backward"):
            self.scaler.scale(losses["total_loss"]).backward()
        with self.nvtx("optimizer"):
            if self.clip > 0:
                self.scaler.unscale_(self.optimizer)
                # One norm over every trained gradient (Paddle ClipGradByGlobalNorm,
                # Ultralytics' clip_grad_norm_(model.parameters())), not one per group.
                torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if self.ema is not None:
            with self.nvtx("ema"):
                self.ema.update(self.model)
        if self.loss_names is None:
            if len(losses) > MAX_LOSSES:
                raise ValueError(f"the model returns {len(losses)} losses; TrainStep accumulates "
                                 f"at most {MAX_LOSSES} (raise MAX_LOSSES)")
            self.loss_names = tuple(losses)
        self.loss_sum[: len(self.loss_names)] += torch.stack(
            [losses[k].detach().float() for k in self.loss_names])

    def __call__(self, batch: dict[str, Tensor], kw: dict[str, Any]) -> None:
        inputs = {k: batch[k] for k in INPUT_KEYS}
        if self._twin is not None:
            h, w = inputs["images"].shape[-2:]
            key = (int(h), int(w), _kw_key(kw))
            if key not in self._live:
                if key in self._ready:
                    self._switch(key, inputs, kw)
                else:
                    self._eager_step(inputs, kw)
                self.steps_accumulated += 1
                return
        if self.cuda_graphs:
            key = (tuple(inputs["images"].shape), _kw_key(kw))
            g = self._graphs.get(key)
            if g is None:
                if self._warmed_up:
                    raise RuntimeError(
                        f"CUDA graphs: a batch of shape {key[0]} with loss arguments {dict(key[1])} "
                        f"was not captured by the warm-up of {self._buckets} bucket(s); every "
                        "size and loss variant the loader can yield must be warmed up")
                g = self._capture(key, inputs, kw)
            for k in INPUT_KEYS:
                g.inputs[k].copy_(inputs[k], non_blocking=True)
            with self.nvtx("step(graph)"):
                g.graph.replay()
        else:
            self._body(inputs, kw)
        self.steps_accumulated += 1

    # ------------------------------------------------------------------ background compile
    def begin_background(self, n_buckets: int) -> None:
        """Train from the first step, every bucket on its eager twin until ``mark_ready``."""
        if self._twin is None:
            raise RuntimeError("TrainStep.begin_background needs compile=True and background=True")
        self._buckets = n_buckets
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, n_buckets + 2)
        if self.cuda_graphs:
            self._allocate_grads()
        self._graphs_after_warmup = compiled_graph_count()
        self._warmed_up = True

    def mark_ready(self, h: int, w: int, kw: dict[str, Any]) -> None:
        """The bucket's graph is in the cache: its next step loads it and runs compiled."""
        self._ready.add((int(h), int(w), _kw_key(kw)))

    def is_compiled(self, h: int, w: int, kw: dict[str, Any]) -> bool:
        return self._twin is None or (int(h), int(w), _kw_key(kw)) in self._live

    @property
    def compiled_buckets(self) -> int:
        """Buckets running compiled so far (compile.warmup=background)."""
        return len(self._live)

    def take_switches(self) -> list[Switch]:
        """The switches since the last call (for the log), emptying ``switches``."""
        out, self.switches = self.switches, []
        return out

    def _eager_step(self, inputs: dict[str, Tensor], kw: dict[str, Any]) -> None:
        assert self._twin is not None
        self._twin.use_compiled = False
        try:
            self._body(inputs, kw)
        finally:
            self._twin.use_compiled = True

    def _switch(self, key: tuple, inputs: dict[str, Tensor], kw: dict[str, Any]) -> None:
        """This step compiles the bucket (a cache load once a worker has compiled it),
        captures it with --cuda-graphs, and runs it on the real batch."""
        t0, c0, n0 = time.perf_counter(), cache_counts(), compiled_graph_count()
        if self.cuda_graphs:
            gkey = (tuple(inputs["images"].shape), _kw_key(kw))
            g = self._capture(gkey, inputs, kw)
            for k in INPUT_KEYS:
                g.inputs[k].copy_(inputs[k], non_blocking=True)
            g.graph.replay()
        else:
            self._body(inputs, kw)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._live.add(key)
        n1 = compiled_graph_count()
        self._graphs_after_warmup = n1  # check_recompiles: nothing new from here on
        self.switches.append(Switch(key, time.perf_counter() - t0, n1 - n0, count_delta(c0, cache_counts())))

    # ------------------------------------------------------------------ losses
    def read_losses(self) -> dict[str, float]:
        """Mean of each loss since the last read: the one host sync per log interval."""
        if self.loss_names is None or self.steps_accumulated == 0:
            return {}
        vals = (self.loss_sum[: len(self.loss_names)] / self.steps_accumulated).tolist()
        self.loss_sum.zero_()
        self.steps_accumulated = 0
        return dict(zip(self.loss_names, vals))

    # ------------------------------------------------------------------ state snapshot
    def _state_tensors(self) -> list[Tensor]:
        ts = list(self.model.parameters()) + list(self.model.buffers())
        for st in self.optimizer.state.values():
            ts += [v for v in st.values() if isinstance(v, Tensor)]
        ts += [g["lr"] for g in self.optimizer.param_groups if isinstance(g["lr"], Tensor)]
        if self.ema is not None:
            ts += self.ema.state_tensors()
        ts.append(self.loss_sum)
        return ts

    @contextlib.contextmanager
    def _preserve_state(self):
        """Run warm-up iterations without changing the training state (values copied back
        into the same tensors, so addresses captured by graphs stay valid)."""
        with torch.no_grad():
            saved = [t.detach().clone() for t in self._state_tensors()]
        steps, scaler_state = self.steps_accumulated, self.scaler.state_dict()
        try:
            yield
        finally:
            with torch.no_grad():
                for t, s in zip(self._state_tensors(), saved):
                    t.copy_(s)
            self.steps_accumulated = steps
            if scaler_state:
                self.scaler.load_state_dict(scaler_state)

    # ------------------------------------------------------------------ CUDA graphs
    def _allocate_grads(self) -> None:
        """Give every trained parameter a ``.grad`` once, outside the graph pool, before the
        first capture's warm-up: the tensors every graph then writes in place."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _capture(self, key: tuple, inputs: dict[str, Tensor], kw: dict[str, Any]) -> _Graph:
        static = {k: v.clone() for k, v in inputs.items()}
        self._allocate_grads()
        with self._preserve_state():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(self.graph_warmup_iters):
                    if i == self.graph_warmup_iters - 1 and i > 0 and not (self.compiled or self._ddp):
                        self.check_capturable(static, kw)  # after the first: lazy tables are made
                    else:
                        self._body(static, kw)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._body(static, kw)
        torch.cuda.synchronize()
        g = _Graph(graph, static)
        self._graphs[key] = g
        return g

    def check_capturable(self, inputs: dict[str, Tensor], kw: dict[str, Any]) -> None:
        """Run one step body under :class:`~fastdet.engine.host_sync.HostSyncGuard` and
        refuse, in one line naming the code, a step that reads a device value back or
        copies host data to the device: a CUDA-graph capture would fail on it (eager steps
        only; a compiled step is checked by Dynamo and cudagraph trees)."""
        with HostSyncGuard(self.device) as guard:
            self._body(inputs, kw)
        if guard.violations:
            v = guard.violations[0]
            at = " ".join(line.strip() for line in v.where.strip().splitlines()[-2:])
            raise RuntimeError(f"--cuda-graphs: this step cannot be captured: {v.what}; at {at}")

    # ------------------------------------------------------------------ warm-up
    def warmup(self, sizes: list[tuple[int, int]], batch_size: int, max_boxes: int,
               kw_variants: list[dict[str, Any]], channels_last: bool = False) -> None:
        """Compile (and capture) every bucket once, on synthetic batches, leaving the
        training state unchanged. Sizes are (H, W)."""
        self._buckets = len(sizes) * len(kw_variants)
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, self._buckets + 2
        )
        gen = torch.Generator().manual_seed(0)
        for h, w in sizes:
            batch = synthetic_batch(batch_size, h, w, max_boxes, self.device, gen, channels_last)
            for kw in kw_variants:
                if self.cuda_graphs:
                    self._capture((tuple(batch["images"].shape), _kw_key(kw)), batch, kw)
                else:
                    with self._preserve_state():
                        self._body(batch, kw)
        self.optimizer.zero_grad(set_to_none=not self.cuda_graphs)
        self._graphs_after_warmup = compiled_graph_count()
        self._warmed_up = True

    def check_recompiles(self) -> None:
        """Raise if Dynamo compiled new graphs after warm-up (a shape or guard leak)."""
        if not self.compiled or self._graphs_after_warmup is None:
            return
        new = compiled_graph_count() - self._graphs_after_warmup
        if new > 0:
            raise RuntimeError(
                f"torch.compile recompiled {new} time(s) after warm-up of {self._buckets} "
                "bucket(s): an input shape or a guarded value changed during training "
                "(run with TORCH_LOGS=recompiles to see which)"
            )


def compiled_graph_count() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def synthetic_batch(batch_size: int, h: int, w: int, max_boxes: int, device: torch.device,
                    gen: torch.Generator | None = None, channels_last: bool = False
                    ) -> dict[str, Tensor]:
    """A batch in the loader layout with random images and a few random valid boxes."""
    gen = gen or torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, h, w, generator=gen)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    n = min(4, max_boxes)
    xy = torch.rand(batch_size, max_boxes, 2, generator=gen) * torch.tensor([w * 0.6, h * 0.6])
    wh = 16 + torch.rand(batch_size, max_boxes, 2, generator=gen) * torch.tensor([w * 0.35, h * 0.35])
    boxes = torch.cat([xy, xy + wh], dim=-1)
    mask = torch.zeros(batch_size, max_boxes, dtype=torch.bool)
    mask[:, :n] = True
    labels = torch.randint(0, 3, (batch_size, max_boxes), generator=gen) * mask
    boxes = boxes * mask[..., None]
    return {
        "images": images.to(device),
        "gt_boxes": boxes.to(device),
        "gt_labels": labels.to(device),
        "gt_mask": mask.to(device),
        "gt_scores": mask.float().to(device),
    }


# --------------------------------------------------------------------------- building a step

def freeze_bn_stats(model: nn.Module) -> None:
    """Put every BatchNorm in eval mode (running statistics fixed, affine still trained)."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.eval()


# The part ``model.freeze_backbone`` keeps fixed: every family's Detector has it.
FROZEN_PART = "backbone"


def freeze_backbone(model: nn.Module) -> None:
    """``model.freeze_backbone``: the backbone's parameters take no gradient (set before the
    optimizer, the EMA and DDP are built, which then leave them out)."""
    model.get_submodule(FROZEN_PART).requires_grad_(False)


def set_train_mode(model: nn.Module, cfg: ModelConfig) -> None:
    """The mode the model trains (and is compiled and captured) in: train mode, with the
    BatchNorm statistics of the whole model (``freeze_bn``) or of a frozen backbone
    (``freeze_backbone``) fixed. Called when the step is built and every time the trainer
    goes back to training: evaluation puts the model in eval mode, and Dynamo guards on each
    module's ``training`` (a change would recompile)."""
    model.train()
    if cfg.freeze_bn:
        freeze_bn_stats(model)
    elif cfg.freeze_backbone:
        freeze_bn_stats(model.get_submodule(FROZEN_PART))


@dataclass
class TrainParts:
    """What a train step updates: built by :func:`build_train_parts`, restored by the trainer
    (resume, fine-tune) before :func:`build_train_step` wraps them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    ema: Any
    base_lr: float  # the LR scaled by the global batch
    amp_dtype: torch.dtype | None


def build_train_parts(cfg: Config, device: torch.device, *, world_size: int = 1,
                      backbone_weights: bool = False) -> TrainParts:
    """The detector on ``device`` (with ``model.backbone_weights`` loaded when
    ``backbone_weights``; its backbone frozen with ``model.freeze_backbone``; channels-last
    with ``data.channels_last``), its optimizer (over the parameters that train) and EMA (a
    frozen backbone's tensors copied, not averaged) for a global batch of
    ``data.batch_size x world_size``, and the AMP dtype."""
    model = registry.build_detector(cfg).to(device)
    if backbone_weights and cfg.model.backbone_weights:
        model.load_backbone_weights(cfg.model.backbone_weights)
    if cfg.model.freeze_backbone:
        freeze_backbone(model)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer, ema, base_lr = build_optimizer_and_ema(cfg.optim, model, cfg.data.batch_size * world_size, device,
                                                      fixed=(FROZEN_PART,) if cfg.model.freeze_backbone else ())
    return TrainParts(model, optimizer, ema, base_lr, resolve_amp(cfg.compile.amp, device))


def ddp_wrapper(device: torch.device) -> Callable[[nn.Module], nn.Module]:
    """What wraps the step's (compiled) module in DDP on ``device``: TrainStep calls it, so
    that DDP wraps the compiled module and not the other way round (the module docstring)."""
    if device.type == "cuda":
        return partial(nn.parallel.DistributedDataParallel, device_ids=[device.index])
    return nn.parallel.DistributedDataParallel


def build_train_step(cfg: Config, device: torch.device, *, parts: TrainParts | None = None,
                     ddp: bool = False, world_size: int = 1, background: bool = False,
                     cuda_graphs: bool | None = None) -> TrainStep:
    """The train step of ``cfg``, as the trainer, the compile workers and the benchmarks run it.

    Everything inductor's cache key can see is set here from ``cfg`` (the model, its layout,
    train mode and frozen BatchNorm statistics, the optimizer and EMA, AMP, the compile
    settings, DDP's wrapping; a frozen backbone's ``requires_grad`` and BatchNorm mode), so a
    worker's graph is the trainer's.

    Args:
        parts: the model, optimizer and EMA to use (the trainer's, restored from a
            checkpoint); built by :func:`build_train_parts` when None.
        ddp: wrap the step's module in DDP (a process group must be up). With
            ``world_size > 1`` and ``model.sync_bn`` BatchNorm becomes the traceable
            SyncBatchNorm first (in place: the optimizer and EMA keep their tensors), and
            CUDA graphs warm up 11 iterations before each capture (DDP's requirement).
        background: each bucket runs eagerly until ``mark_ready`` (compile.warmup=background).
        cuda_graphs: overrides ``compile.cuda_graphs`` (the workers compile the same inductor
            graph without capturing it).
    """
    parts = parts or build_train_parts(cfg, device, world_size=world_size)
    model = parts.model
    # The mode the step is compiled (and captured) in: Dynamo guards on each module's
    # `training`, and a graph bakes BatchNorm's mode in.
    set_train_mode(model, cfg.model)
    wrap = None
    if ddp:
        if cfg.model.sync_bn and world_size > 1:
            # In place: the new modules hold the same parameter and buffer tensors, so the
            # optimizer and EMA built with the model still hold them.
            model = convert_sync_batchnorm(model)
            log.info("SyncBatchNorm: BatchNorm statistics over the %d ranks' batches (functional "
                     "collectives, inside the compiled graph with --compile)", world_size)
        elif world_size > 1:
            log.info("model.sync_bn is off: each rank uses plain BatchNorm on its own batch%s",
                     " (running statistics averaged over the ranks before each evaluation and "
                     "checkpoint)" if cfg.model.all_reduce_bn_stats else "")
        wrap = ddp_wrapper(device)
    c = cfg.compile
    return TrainStep(model, model, parts.optimizer, parts.ema, device, parts.amp_dtype,
                     clip_grad_norm=cfg.optim.clip_grad_norm, compile=c.compile,
                     cuda_graphs=c.cuda_graphs if cuda_graphs is None else cuda_graphs,
                     graph_warmup_iters=11 if ddp else 3, nvtx=Nvtx(cfg.run.nvtx), ddp=wrap,
                     backend=c.backend, background=background, shapes=c.shapes)
