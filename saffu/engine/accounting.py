"""Compute accounting: FLOPs (analytic and XLA's cost analysis), peak memory, wall time.

* Analytic FLOPs come from each model's ``forward_flops(seq_len)`` (2 per multiply-add, per
  predicted token); a training step costs three forward passes (forward + backward).
* XLA FLOPs are the compiler's own count for a compiled executable
  (``jax.stages.Compiled.cost_analysis()``), available on CPU, GPU and TPU backends.
* Peak memory is the process's peak resident set (``ru_maxrss``) — run each model in its own
  process for a per-run figure (the experiment scripts do) — and, on accelerators, the
  device's ``peak_bytes_in_use``.

A :class:`FlopLedger` collects the XLA FLOPs of the streaming passes and calibration steps
that run while it is active (the explicit solver reports its total).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import resource
import sys
from collections.abc import Iterator
from typing import Any

import jax

_LEDGER: contextvars.ContextVar[FlopLedger | None] = contextvars.ContextVar("saffu_flop_ledger", default=None)


def xla_flops(compiled: Any) -> float | None:
    """FLOPs of one call of a compiled executable (``jitted.lower(*args).compile()``) by XLA's
    cost analysis, or None where the backend reports none. XLA counts a loop's body once, not
    once per trip: a program that loops (the transformer's fused loss over chunks of tokens, its
    attention over windows) does more than this count says."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(analysis, (list, tuple)):   # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


class FlopLedger:
    """Sum of XLA FLOPs recorded by :func:`record` while active, by label."""

    def __init__(self):
        self.by_label: dict[str, float] = {}
        self.complete = True          # False once some executable reported no cost analysis

    @property
    def total(self) -> float:
        return float(sum(self.by_label.values()))

    def add(self, label: str, flops_per_call: float | None, calls: int) -> None:
        if flops_per_call is None:
            self.complete = False
            return
        self.by_label[label] = self.by_label.get(label, 0.0) + flops_per_call * calls


@contextlib.contextmanager
def flop_ledger() -> Iterator[FlopLedger]:
    """``with flop_ledger() as ledger: ...`` — every :func:`record` inside lands in ``ledger``."""
    ledger = FlopLedger()
    token = _LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _LEDGER.reset(token)


def record(label: str, compiled: Any, calls: int) -> None:
    """Add ``calls`` calls of ``compiled`` to the active ledger (no-op without one)."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.add(label, xla_flops(compiled), calls)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (monotone over the process's life)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10   # bytes on macOS, KiB on Linux


def rss_mb() -> float:
    """Resident memory of this process now, in MB (``/proc/self/statm``; where there is no
    ``/proc``, the peak so far, :func:`peak_rss_mb`)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except FileNotFoundError:
        return peak_rss_mb()


def device_peak_mb() -> float | None:
    """Peak bytes in use on this process's first device in MB (GPU/TPU), None where not reported
    (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def training_flops(config: Any, tokens: int, seq_len: int, inputs: dict | None = None) -> float:
    """Analytic training FLOPs for ``tokens`` predicted tokens: 3 × forward (forward + backward).
    With a step's ``inputs`` (a model's ``step_inputs``), the forward count of that step
    (``config.step_forward_flops``, e.g. with self-guided training's dense guide)."""
    if inputs and hasattr(config, "step_forward_flops"):
        return 3.0 * config.step_forward_flops(seq_len, inputs) * tokens
    return 3.0 * config.forward_flops(seq_len) * tokens


def memory_record() -> dict[str, float]:
    """``peak_rss_mb`` and, where reported, ``device_peak_mb``."""
    out = {"peak_rss_mb": peak_rss_mb()}
    device = device_peak_mb()
    if device is not None:
        out["device_peak_mb"] = device
    return out
