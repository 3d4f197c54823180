#!/usr/bin/env bash
# The MISTILL grid: {llama, gpt2} x {cot, mistill} x {bf16, fp32-master} x seeds, then the report.
#
#   benchmarks/distill_grid.sh OUT [JOBS] [SEEDS] [-- extra `mistill-lens distill` options]
#
# e.g. benchmarks/distill_grid.sh runs/distill 2 "0 1 2" -- --teacher default --steps 300
#
# PRECISIONS (default "bf16 fp32-master") and FAMILIES (default "llama gpt2") narrow the grid.
# "{family}" in an option stands for the run's student family, e.g.
# --student-init checkpoints/base_students/{family} starts each run from its family's base student.
#
# The first run goes alone when the cache folder is empty: it writes the shared cache (the
# teacher's generations and its characterisation) that the others then read. The rest run JOBS at a time, one thread each.
# Every run is resumable, so rerunning the script after an interruption loses nothing.
set -euo pipefail
out=${1:?usage: distill_grid.sh OUT [JOBS] [SEEDS] [-- distill options]}
jobs=${2:-2}
seeds=${3:-0 1 2}
shift $(( $# < 3 ? $# : 3 ))
[[ ${1:-} == -- ]] && shift
bin=${MISTILL_LENS:-mistill-lens}
# Stopping the script stops its runs too (they resume when it is started again).
trap 'trap - TERM; kill 0' INT TERM
mkdir -p "$out/logs"

runs=()
for seed in $seeds; do
  for family in ${FAMILIES:-llama gpt2}; do
    for objective in cot mistill; do
      for precision in ${PRECISIONS:-bf16 fp32-master}; do
        runs+=("$family $objective $precision $seed")
      done
    done
  done
done

run_one() {
  read -r family objective precision seed <<<"$1"; shift
  local name="$family-$objective-$precision-$seed"
  set -- "${@//\{family\}/$family}"
  OMP_NUM_THREADS=1 "$bin" distill --student "$family" --objective "$objective" --precision "$precision" \
    --seed "$seed" --out "$out/$name" --cache "$out/cache" --no-progress "$@" >"$out/logs/$name.log" 2>&1 \
    || { echo "FAILED $name (see $out/logs/$name.log)" >&2; return 1; }
  echo "done $name: $(tail -n 1 "$out/logs/$name.log")"
}
export -f run_one
export out bin

# In the background and waited for, so that a signal reaches the trap at once.
first=0
if [[ -z $(ls -A "$out/cache" 2>/dev/null) ]]; then
  run_one "${runs[0]}" "$@" & wait $!
  first=1
fi
printf '%s\n' "${runs[@]:$first}" | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} "$@" & wait $!
"$bin" distill-report --runs "$out"/*-[0-9]* --out "$out/report"
