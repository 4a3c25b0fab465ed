"""What this machine has: device memory, host RAM. The only reads of ``torch.cuda`` and ``psutil`` the planner and
the linter make; the formulas they feed (:mod:`common.memory_formulas`) stay pure arithmetic.
"""

from __future__ import annotations

from common.memory_formulas import fmt_gb


def local_device_memory(ranks_per_node: int = 1) -> tuple[float, str]:
    """(bytes, label): the first GPU's total memory, or on a CPU the host RAM shared by ``ranks_per_node``."""
    import psutil
    import torch

    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info(0)
        return float(total), f"local GPU: {torch.cuda.get_device_name(0)}"
    total = float(psutil.virtual_memory().total)
    share = max(1, ranks_per_node)
    return total / share, f"no GPU: host RAM {fmt_gb(total)} / {share} process(es)"


def host_memory() -> float:
    """Total host RAM of this machine in bytes."""
    import psutil

    return float(psutil.virtual_memory().total)


def available_host_ram() -> float | None:
    """Host RAM available now, in bytes; None when it cannot be read (no psutil)."""
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except Exception:
        return None
