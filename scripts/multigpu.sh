#!/usr/bin/env bash
# Decode on 2 / 4 / 8 GPUs against one (scripts/mesh_bench.py), one device call per machine kind:
#   bash scripts/multigpu.sh 2|4|8
# Results under $OUT (mesh_<model>/mesh.json and the printed tables). A dry run on CPU: python
# scripts/mesh_bench.py --model tiny --dtype float32 --meshes "tensor=2;expert=2" --batches 1,4 --context 64
set -u
n=${1:-2}
out=${OUT:-./multigpu_out}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
case $n in
2) meshes="tensor=2;expert=2;data=2" ;;
4) meshes="tensor=4;expert=4;data=2,tensor=2" ;;
8) meshes="tensor=8;expert=8;data=2,tensor=2,expert=2;data=4,tensor=2" ;;
esac
for model in flash-slice flash-1gpu; do
  timeout 280 python3 -W ignore scripts/mesh_bench.py --model $model --meshes "$meshes" --batches 1,32,128 \
    --context 4096 --new 32 --out "$out/mesh_$model" 2>&1 | grep "^|\|x gpu\|Error" | tail -16
done
