#!/bin/bash
# bench/detached.sh RUN... : bench/gpu_suite.py's runs, one after another, in the background
# of a device call, from a private copy of the tree. Start it with
#   setsid nohup bash bench/detached.sh RUN... > /tmp/detached.log 2>&1 < /dev/null &
# and collect /tmp/suite (RUN's output in /tmp/suite/RUN, /tmp/suite/DONE at the end) in the
# calls after it (bench/README.md).
#
# The copy: every device call copies the working tree into the repository root again, and
# session 55's first all-tests run, collecting while the next call arrived, failed to import
# a third of its test files. What the carry cap leaves no room for beside .whl (the oracle
# fixtures) travels in calls of their own before, each keeping its carry under /tmp/keep:
#   cp -a --parents .cache/oracle /tmp/keep/
# and the copy takes /tmp/keep's files at their paths.
set -u
SRC="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf /tmp/w /tmp/suite && cp -a "$SRC" /tmp/w && cd /tmp/w
if [ -d /tmp/keep ]; then cp -a /tmp/keep/. /tmp/w/; fi
mkdir -p /tmp/suite
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /tmp/suite/gpu-name.txt
for run in "$@"; do
    python3 bench/gpu_suite.py "$run" --out "/tmp/suite/$run"
done
echo done > /tmp/suite/DONE
