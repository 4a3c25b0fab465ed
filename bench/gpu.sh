#!/usr/bin/env bash
# One prepared GPU benchmark: the NLP recipe at 1B class on a single GPU, within 8 minutes.
#
#   bash bench/gpu.sh          # GPU: ZeRO stages 0-3, stage 3 + offload, FlashAttention-2 vs SDPA,
#                              # activation-checkpointing presets; tokens/s, MFU, peak allocated
#                              # -> docs/benchmarks_gpu.md (section "gpu")
#   bash bench/gpu.sh --cpu    # no GPU: every variant on the tiny model (section "cpu-mode")
#
# FlashAttention-2 runs when flash-attn is installed (pip install -e ".[flash]"); without it the
# "auto" rows say sdpa. The first offload variant compiles DeepSpeedCPUAdam (about a minute, once).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--cpu" ]] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "error: no GPU visible; run 'bash bench/gpu.sh --cpu' for the tiny CPU mode" >&2
    exit 2
fi
python -c "import flash_attn" 2>/dev/null && echo "flash-attn: installed" || echo "flash-attn: not installed (auto = sdpa)"
exec timeout 470 python bench/gpu.py "$@"
