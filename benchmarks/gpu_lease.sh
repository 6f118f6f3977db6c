#!/usr/bin/env bash
# One call of a GPU lease (the device tool's `run`), from the repository root:
#
#     bash benchmarks/gpu_lease.sh [STEPS] [MINUTES]
#
# runs benchmarks/gpu_suite.py with the device's own python3 (PYTHONPATH=., no install) and
# leaves what comes back in $OUT, within the tool's limits (at most 8 files, 16 MiB each):
# suite.json and suite.md (every step's numbers), results.tar.gz (each step's JSON and log).
# One command may run 10 minutes (call it with timeout_s=600) and a lease is 15 minutes of
# device time, the machine's start included: the suite's own deadline (MINUTES, default 8)
# ends every step, and a hard limit 45 s later ends the suite, in time to pack what it has.
# STEPS defaults to the suite's order without kernel_tests (long); what a first call did not
# reach, a second call can name.
set -u
steps=${1:-env,decode,gemm,tests,serve7b,offline8b,throughput,prefix_cache,attention,sweep,fidelity,limits,arena}
minutes=${2:-8}
out=${OUT:?the device tool sets OUT}
work=$(mktemp -d /tmp/gpu-suite.XXXX)
PYTHONPATH=. timeout $((minutes * 60 + 45)) python3 benchmarks/gpu_suite.py --out "$work" --minutes "$minutes" \
    --steps "$steps"
cp "$work/suite.json" "$work/suite.md" "$out/" 2>/dev/null
tar -czf "$out/results.tar.gz" -C "$work" --exclude=suite.json --exclude=suite.md .
ls -l "$out"
