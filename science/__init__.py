"""Science domain: 1-D Burgers data (``burgers``), FNO-1D (``fno``), figures (``plots``).

Plain NumPy and torch; no Lightning, Accelerate or DeepSpeed imports (docs/design.md, layout).
"""
