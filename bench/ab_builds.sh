#!/usr/bin/env bash
# A/B of two builds in one GPU session: this tree against another commit, built side by side, the same
# benchmark command run in each (rounds alternate which tree goes first), every new result JSON kept with
# the tree's label. Same-session numbers are the only fair comparison of two builds: a fresh machine
# starts at another clock and power state.
#   bash bench/ab_builds.sh stage REF                # here: REF's sources into vdcompile-ab/REF (ignored by git)
#   bash bench/ab_builds.sh run vdcompile-ab/REF OUTDIR CMD...   # on the GPU machine, vdcompile-ab copied along
# e.g. run vdcompile-ab/main vdcompile-ab/out python3 bench/ops.py --ops conv_bn_silu --dtype fp16
# Environment: ROUNDS (default 1), SKIP_BUILD=1 (trees already built), MAX_JOBS (split between the builds).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case ${1:-} in
  stage)
    ref=${2:?usage: ab_builds.sh stage REF}
    dir=vdcompile-ab/$(echo "$ref" | tr '/~^' '___')
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$ref" -- setup.py pyproject.toml csrc vdcompile bench tests | tar -x -C "$dir" --exclude='bench/results/*'
    mkdir -p "$dir/bench/results"
    echo "$dir: $(git rev-parse --short "$ref")" ;;
  run)
    other=${2:?usage: ab_builds.sh run DIR OUTDIR CMD...}
    out=${3:?usage: ab_builds.sh run DIR OUTDIR CMD...}
    shift 3
    [ $# -gt 0 ] || { echo "no command"; exit 2; }
    mkdir -p "$out"
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
      . bench/build_env.sh  # the compiler gpu_check.sh builds with (a shared libstdc++)
      jobs=$(( ${MAX_JOBS:-16} / 2 > 0 ? ${MAX_JOBS:-16} / 2 : 1 ))
      out_abs=$(realpath "$out")
      for tree in . "$other"; do
        log="$out_abs/build_$([ "$tree" = . ] && echo this || basename "$tree").log"
        ( cd "$tree" && MAX_JOBS=$jobs TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} \
            $PY setup.py build_ext --inplace > "$log" 2>&1 ) &
      done
      wait
      for tree in . "$other"; do
        ls "$tree"/vdcompile/_C*.so > /dev/null 2>&1 || { echo "build of $tree FAILED"; exit 1; }
      done
    fi
    here=$(realpath .); there=$(realpath "$other")
    for ((r = 0; r < ${ROUNDS:-1}; r++)); do
      if (( r % 2 == 0 )); then order="$there $here"; else order="$here $there"; fi
      for tree in $order; do
        label=$([ "$tree" = "$here" ] && echo this || echo "$(basename "$tree")")
        stamp=$(mktemp)
        echo "== $label (round $r): $*"
        # the tree first on the path: its vdcompile, whatever else PYTHONPATH holds (e.g. staged wheels)
        ( cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$@" ) || echo "== $label: exit $?"
        find "$tree/bench/results" -newer "$stamp" -name '*.json' | while read -r f; do
          cp "$f" "$out/${label}_r${r}_$(basename "$f")"
        done
        rm -f "$stamp"
      done
    done ;;
  *) sed -n 2,9p "$0"; exit 2 ;;
esac
