#!/usr/bin/env bash
# One prepared GPU benchmark: the NLP recipe at 1B class on a single GPU (docs/benchmarks_gpu.md).
#
#   bash bench/gpu.sh --first-run  # GPU, < 8 min: doctor, ZeRO stages 0 and 3, a recipe run with async_save, the
#                                  # long sequence with and without tiling, no activation checkpointing
#   bash bench/gpu.sh              # GPU: every variant (ZeRO stages 0-3 and their FSDP2 peers, offload, ZeRO++,
#                                  # FlashAttention-2 vs SDPA, activation-checkpointing presets, long sequences) within
#                                  # 7 minutes
#   bash bench/gpu.sh --variants stage2,fsdp2_grad_op,stage3,fsdp2   # GPU: ZeRO beside FSDP2 only
#   bash bench/gpu.sh --cpu        # no GPU: every variant on the tiny model (section "cpu-mode")
#
# Results go to bench/results/gpu.json after every variant, and docs/benchmarks_gpu.md is rendered from it; each
# variant has its own time limit (bench/gpu.py), past which it is killed with every process it started.
# FlashAttention-2 runs when flash-attn is installed (pip install -e ".[flash]"); without it the "auto" rows say
# sdpa. The offload variants compile DeepSpeedCPUAdam on first use (about a minute, once).
set -euo pipefail
cd "$(dirname "$0")/.."
# A machine may have python3 and no python (or a python without torch): the first one on PATH that has torch.
PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
            PYTHON=$candidate
            break
        fi
    done
fi
if [[ -z "$PYTHON" ]]; then
    echo "error: no python3 or python on PATH imports torch; install torch, or set PYTHON=/path/to/python" >&2
    exit 2
fi
cpu=false
for arg in "$@"; do [[ "$arg" == "--cpu" ]] && cpu=true; done
if ! $cpu && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "error: no GPU visible; run 'bash bench/gpu.sh --cpu' for the tiny CPU mode ($PYTHON: torch" \
        "$("$PYTHON" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
if ! problem=$("$PYTHON" -c "import deepspeed" 2>&1); then
    echo "error: DeepSpeed does not import with $PYTHON: $(printf '%s\n' "$problem" | tail -n 1)" >&2
    echo "  install it: $PYTHON -m pip install 'deepspeed>=0.16,<0.20' (it brings hjson and pydantic); without a" \
        "network, from wheels built elsewhere: $PYTHON -m pip install --no-index --no-deps --target /tmp/site" \
        ".whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD" >&2
    exit 2
fi
"$PYTHON" -c "import flash_attn" 2>/dev/null && echo "flash-attn: installed" || echo "flash-attn: not installed (auto = sdpa)"
exec "$PYTHON" bench/gpu.py "$@"
