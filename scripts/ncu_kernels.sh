#!/usr/bin/env bash
# Nsight Compute on the GPU kernels (the H200 machine is Firecracker, where ncu reads the hardware counters):
# registers, spills (local-memory sectors), global-load sectors per request (is the row gather vectorised?),
# DRAM bytes and time, occupancy and stall reasons, for the sparse attention and indexer kernels
# (per-kernel times of everything else: v4jax bench kernels --harness trace).
#   bash scripts/ncu_kernels.sh $OUT        -> $OUT/ncu_<kernel>.txt
set -u
out=${1:-.}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,\
l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum,\
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,\
smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,\
launch__shared_mem_per_block_dynamic,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
run() {  # name, kernel regex, launches, python args...
  local name=$1 regex=$2 count=$3; shift 3
  timeout 200 ncu --clock-control none -k "regex:$regex" --launch-count "$count" --metrics "$metrics" \
    --section WarpStateStats python3 -W ignore "$@" > "$out/ncu_$name.txt" 2>&1
  echo "$name rc=$?"; grep -E "^  [a-z_]+.*\(|gpu__time|registers|local_op|global_op|dram__bytes|Stall|warps_active|hmma" \
    "$out/ncu_$name.txt" | head -60
}
run attention "sparse" 4 scripts/tune_kernels.py --only attention --harness trace --repeats 1 \
  --attention-configs 64:16:4:2:1 32:64:8:2:1 32:16:4:3:1 16:64:4:2:1
run indexer "indexer" 2 -m v4jax.bench kernels --only indexer --harness trace --repeats 1
