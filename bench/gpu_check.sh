#!/usr/bin/env bash
# On a CUDA machine: build with the CUDA kernels, run the test suite, compute-sanitizer and the benchmarks.
#   bash bench/gpu_check.sh LOGDIR [build|tests|tests-all|sanitize|bench-attention|bench-attention-fp32|bench-ops ...]
#   (default: build tests sanitize bench-attention bench-ops)
set -uo pipefail
cd "$(dirname "$0")/.."
logdir=${1:?usage: gpu_check.sh LOGDIR [steps...]}
shift
steps=${*:-"build tests sanitize bench-attention bench-ops"}
mkdir -p "$logdir"
PY=${PYTHON:-python3}
. "$(dirname "$0")/build_env.sh"
status=0
for step in $steps; do
  t0=$(date +%s)
  case $step in
    build)
      MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} \
        $PY setup.py build_ext --inplace > "$logdir/build.log" 2>&1 || { echo "build FAILED"; tail -40 "$logdir/build.log"; exit 1; }
      ldd vdcompile/_C*.so | grep -q 'libstdc++' || echo "WARNING: vdcompile/_C links libstdc++ statically; C++ errors will crash"
      $PY -c "import vdcompile; print({op: sorted(vdcompile.built_backends(op)) for op in ['fused_attention','strided_attention','group_norm_silu','conv_bn_silu','temporal_conv','scheduler_step']})" ;;
    tests)
      $PY -m pytest -q -rs -x tests -k "cuda" -p no:cacheprovider 2>&1 | tee "$logdir/tests_cuda.log" | tail -25 || status=1 ;;
    tests-all)
      $PY -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$logdir/tests_all.log" | tail -25 || status=1 ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --print-limit 20 $PY bench/sanitize_ops.py > "$logdir/sanitize_$tool.log" 2>&1
        echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_ops' "$logdir/sanitize_$tool.log" | tr '\n' ' ')"
      done ;;
    bench-attention)
      $PY bench/attention.py --backward --strided 2>&1 | tee "$logdir/bench_attention.log" | tail -40 ;;
    bench-attention-fp32)
      $PY bench/attention.py --dtype fp32 --no-ceilings --shapes temporal,spatial-2304,spatial-576 2>&1 \
        | tee "$logdir/bench_attention_fp32.log" | tail -12 ;;
    bench-ops)
      $PY bench/ops.py 2>&1 | tee "$logdir/bench_ops.log" | tail -40 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "[$step: $(( $(date +%s) - t0 )) s]"
done
cp -f bench/results/*.json "$logdir/" 2>/dev/null || true
exit $status
