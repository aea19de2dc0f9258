#!/usr/bin/env bash
# The load generator before and after a change, interleaved on one machine
# (benchmarks/loadgen_capacity.py run with either source tree's gpulens.serve.loadgen):
#   mkdir -p .oldsrc && git archive <old sha> src | tar x -C .oldsrc   # once, here
#   OLD_SRC=.oldsrc/src ROUNDS=2 LG_S=8 OUT=$OUT bash benchmarks/loadgen_ab.sh
# Against the canned server at 1,000 and 5,000 requests/s and `gpulens serve --model identity
# --device cpu` at 200 and 1,000/s: lateness, latency and the generator's CPU share of a core.
# Writes $OUT/loadgen_ab-<day>.tgz (one JSON per round, version and server).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
OLD_SRC=${OLD_SRC:-.oldsrc/src}
work=$(mktemp -d)/lg
mkdir -p "$work" "$OUT"
for round in $(seq "${ROUNDS:-2}"); do
  for version in old new; do
    for server in canned identity; do
      rates=$([ "$server" = canned ] && echo 1000,5000 || echo 200,1000)
      src=$([ "$version" = old ] && echo "$OLD_SRC" || echo src)
      python3 - "$src" "$server" "$rates" "${LG_S:-8}" "$work/lg-$round-$version-$server.json" <<'PY' 2>&1 | grep "^rate" | sed "s/^/$version $server: /"
import runpy
import sys

src, server, rates, seconds, out = sys.argv[1:]
sys.path.insert(0, src)
import gpulens.serve.loadgen  # noqa: E402,F401  (this version stays imported for the run)

sys.argv = ["loadgen_capacity.py", "--server", server, "--rate", rates, "--duration", seconds,
            "--json", out]
runpy.run_path("benchmarks/loadgen_capacity.py", run_name="__main__")
PY
    done
  done
done
tar czf "$OUT/loadgen_ab-$(date +%F).tgz" -C "$(dirname "$work")" lg
