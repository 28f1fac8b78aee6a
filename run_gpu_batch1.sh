#!/bin/bash
# device batch 1: merged overlap + piecewise + indexer + tensor-core sparse MLA (two GPUs side by side)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:.
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 420 python -m pytest -q -p no:cacheprovider -rfE tests/engine/test_overlap_gpu.py tests/engine/test_piecewise_gpu.py \
    tests/engine/test_engine_gpu.py tests/kernels/test_gpu_sparse_mla_tc.py tests/kernels/test_gpu_indexer_topk.py \
    tests/kernels/test_gpu_attention.py tests/kernels/test_gpu_gemm_moe.py > $OUT/g0_tests.log 2>&1
  echo "tests exit $?" >> $OUT/g0_tests.log
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 python bench/sweep_sparse_mla_tc.py --out $OUT > $OUT/g1_sweep.log 2>&1
  timeout 150 python bench/bench_kernels.py --only indexer_prefill,indexer_long --out $OUT > $OUT/g1_indexer.log 2>&1
  timeout 150 python bench/bench_piecewise.py --out $OUT > $OUT/g1_piecewise.log 2>&1
  echo done >> $OUT/g1_piecewise.log
) &
wait
echo "== g0 tests"; grep -E "passed|failed|FAILED|ERROR|exit" $OUT/g0_tests.log | tail -25
echo "== sweep"; grep -v ' ok$' $OUT/g1_sweep.log | tail -30; echo "checks ok: $(grep -c ' ok$' $OUT/g1_sweep.log)"
echo "== indexer"; tail -25 $OUT/g1_indexer.log
echo "== piecewise"; tail -15 $OUT/g1_piecewise.log
