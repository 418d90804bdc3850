"""Where the target's decode and verify forwards are captured as CUDA graphs, and replayed.

A batch-1 forward of an 8B model launches a few hundred kernels; on a GPU their launch overhead, not the weights'
read, sets the step time (the H100 check: 34.6 ms for one token where reading the weights takes 5). SGLang's
``cuda_graph_runner.py`` and gpt-fast's ``reduce-overhead`` compile remove it the same way: record the forward
once per width, then replay it with new inputs copied into the recorded input buffers.

* :data:`WIDTHS` are the widths captured by default; a block of ``n`` tokens runs at the narrowest captured width
  that holds it (:func:`width_for`), padded as :mod:`.static_cache` describes, so nothing is captured per cycle;
* :class:`CapturedForward` is one recorded forward of one width over one :class:`~.static_cache.StaticKVCache` (its
  buffers are the graph's memory: the cache keeps its graphs, and a new cache captures anew);
* capture happens on first use of a width, and its seconds are kept (:func:`capture_seconds`) so that a benchmark
  reports them apart from decoding;
* on a cache made ``compiled``, the decoder layers' RMSNorms and SwiGLU MLPs run compiled by ``torch.compile``
  (:func:`compiled_layers`: the norm's six elementwise kernels and the MLP's SiLU-times-up become fused kernels)
  while the graph is recorded, and eagerly again after: the graph keeps the fused kernels, the prefill stays eager,
  and the compile time is inside the capture seconds.

Only the forward is in the graph: building the mask, copying the inputs in, and reading the logits out stay
outside, and the acceptance rule reads the logits once per cycle (one host sync).

The drafter's side is captured here too: :class:`CapturedCall` records any function of fixed buffers, and
:mod:`kvshot_lib.decoding.device_draft` records with it a whole draft loop (a chain's K steps with their argmax, or
the fixed-width beam tree with its top-k, selection and tree mask) over a draft session's fixed-shape steps
(:mod:`kvshot_lib.drafters.static_steps`), as SGLang's ``eagle_draft_cuda_graph_runner.py`` does; its capture
seconds are kept apart from the target's (:func:`kvshot_lib.decoding.device_draft.draft_capture_seconds`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from .static_cache import StaticKVCache, prepare

WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


def width_for(n: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """The narrowest of ``widths`` (sorted) that holds ``n`` tokens; ``n`` itself past the widest."""
    i = bisect_left(widths, n)
    return widths[i] if i < len(widths) else n


@dataclass
class StaticOutput:
    """What a captured forward gives back, as transformers' output names it (views of the graph's buffers: read
    them before the next replay)."""

    logits: Tensor  # [1, n, V]
    hidden_states: tuple[Tensor, ...] | None  # L + 1 tensors [1, n, H], or None


def fused_modules(model) -> list[torch.nn.Module]:
    """What :func:`compiled_layers` compiles: every decoder layer's RMSNorms (Qwen3's q/k norms too) and its MLP."""
    out = []
    for layer in model.model.layers:
        out += [m for m in layer.modules() if type(m).__name__.endswith("RMSNorm")]
        out.append(layer.mlp)
    return out


@contextmanager
def compiled_layers(model, on: bool = True):
    """Within it, ``model``'s decoder layers' norms and MLPs run compiled (``torch.compile``, fixed shapes, no
    CUDA graphs of its own: the graph here records its kernels); eager again after, parameters untouched."""
    mods = fused_modules(model) if on else []
    try:
        for m in mods:
            m.compile(dynamic=False)
        yield
    finally:
        for m in mods:
            m._compiled_call_impl = None  # what nn.Module.compile set: the module calls its own forward again


class CapturedForward:
    """One forward of ``width`` tokens over ``cache``, recorded as a CUDA graph (``hidden``: with every layer's
    hidden states). ``call(model, ids, cache, positions, mask, hidden)`` is the eager forward to record."""

    def __init__(self, call: Callable, model, cache: StaticKVCache, width: int, hidden: bool):
        t0 = time.perf_counter()
        dev = cache.device
        self.width, self.cache = width, cache
        self.ids = torch.zeros(1, width, dtype=torch.long, device=dev)  # [1, W]
        self.positions = torch.zeros(1, width, dtype=torch.long, device=dev)  # [1, W]
        self.mask = torch.zeros(1, 1, width, cache.max_len, dtype=cache.dtype, device=dev)  # [1, 1, W, S]
        # [W] the warm-up writes the tail, past anything committed
        self.slots = torch.arange(cache.max_len - width, cache.max_len, device=dev)
        cache.slots = self.slots

        def run():
            return call(model, self.ids, cache, self.positions, self.mask, hidden)

        with compiled_layers(model, cache.compiled):
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(
                side
            ):  # warm-up off the capture: cuBLAS handles, workspaces, lazy inits, compile
                for _ in range(2):
                    run()
            torch.cuda.current_stream(dev).wait_stream(side)
            if cache.graph_pool is None:
                cache.graph_pool = torch.cuda.graph_pool_handle()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=cache.graph_pool):
                out = run()
        self.logits = out.logits  # [1, W, V]
        self.hidden = tuple(out.hidden_states) if hidden else None
        torch.cuda.synchronize(dev)
        self.seconds = time.perf_counter() - t0

    def __call__(self, ids: Tensor, positions: Tensor | None, mask: Tensor | None) -> StaticOutput:
        """Replay with ``ids [1, n]`` (n <= width) at ``positions``, under the block's ``mask``; the outputs are
        the first ``n`` rows."""
        n = ids.shape[1]
        ids, positions, full_mask, slots = prepare(self.cache, ids, positions, mask, self.width)
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.mask.copy_(full_mask)
        self.slots.copy_(slots)
        self.cache.slots = self.slots
        self.graph.replay()
        hidden = tuple(h[:, :n] for h in self.hidden) if self.hidden is not None else None
        return StaticOutput(self.logits[:, :n], hidden)


def captured(call: Callable, model, cache: StaticKVCache, n: int, hidden: bool) -> CapturedForward:
    """The recorded forward that runs a block of ``n`` tokens on ``cache`` (captured now if it is new)."""
    key = (width_for(n), hidden)
    if key not in cache.graphs:
        cache.graphs[key] = CapturedForward(call, model, cache, key[0], hidden)
    return cache.graphs[key]


def capture_seconds(cache: StaticKVCache) -> float:
    """Seconds spent capturing ``cache``'s graphs so far (the target's; a draft loop's are
    :func:`kvshot_lib.decoding.device_draft.draft_capture_seconds`)."""
    return sum(g.seconds for g in cache.graphs.values())


class CapturedCall:
    """``fn()`` (no arguments: it reads and writes fixed buffers) recorded once as a CUDA graph on ``device``;
    calling replays it and returns what ``fn`` returned at capture (views of the graph's memory: read them before
    the next replay). ``seconds``: warm-up and capture."""

    def __init__(self, fn: Callable, device):
        t0 = time.perf_counter()
        dev = torch.device(device)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS handles, workspaces, lazy inits
            for _ in range(2):
                fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()
        torch.cuda.synchronize(dev)
        self.seconds = time.perf_counter() - t0

    def __call__(self):
        self.graph.replay()
        return self.out
