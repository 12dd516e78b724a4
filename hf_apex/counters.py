"""Which implementation actually ran: a process-wide tally of apex-kernel calls and torch fallbacks.

Every swapped norm forward and every optimizer step records one entry ``(component, backend, reason)``,
e.g. ``("layer_norm", "apex", None)`` or ``("layer_norm", "fallback", "cpu tensor")``. The first fallback
of each kind logs a warning, so no fallback is silent; the metrics callback reports the counts per run.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("hf_apex")

APEX = "apex"
FALLBACK = "fallback"
TORCH_CHOSEN = "torch"  # apex could run, but autotune measured torch's op faster


class KernelCounter:
    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str, str | None]] = Counter()
        self._warned: set[tuple[str, str | None]] = set()
        self._lock = threading.Lock()

    def record(self, component: str, backend: str, reason: str | None = None) -> None:
        with self._lock:
            self._counts[(component, backend, reason)] += 1
            if backend == FALLBACK and (component, reason) not in self._warned:
                self._warned.add((component, reason))
                logger.warning(
                    "hf_apex: %s is running the torch fallback, not an apex kernel (%s). "
                    "The count is in the run's metrics.",
                    component,
                    reason,
                )

    def snapshot(self) -> Counter:
        with self._lock:
            return Counter(self._counts)

    def since(self, earlier: Counter) -> dict[str, dict]:
        """Counts recorded after ``earlier`` (a snapshot), nested as {component: {backend: n, reasons}}."""
        delta = self.snapshot()
        delta.subtract(earlier)
        out: dict[str, dict] = {}
        for (component, backend, reason), n in sorted(delta.items(), key=lambda kv: str(kv[0])):
            if n <= 0:
                continue
            entry = out.setdefault(component, {APEX: 0, FALLBACK: 0, "fallback_reasons": {}})
            entry[backend] = entry.get(backend, 0) + n  # "torch": autotune chose the torch op
            if backend == FALLBACK:
                entry["fallback_reasons"][reason or "unknown"] = n
        return out

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._warned.clear()


KERNEL_COUNTER = KernelCounter()
