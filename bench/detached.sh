#!/bin/bash
# bench/detached.sh RUN... : bench/gpu_suite.py's runs, one after another, in the background
# of a device call, from a private copy of the tree. Start it with
#   setsid nohup bash bench/detached.sh RUN... > /tmp/detached.log 2>&1 < /dev/null &
# and collect /tmp/suite (RUN's output in /tmp/suite/RUN, /tmp/suite/DONE at the end) in the
# calls after it (bench/README.md).
#
# The copy: every device call copies the working tree into the repository root again, and
# session 55's first all-tests run, collecting while the next call arrived, failed to import
# a third of its test files. The oracle fixtures travel in a call of their own where the carry
# cap leaves no room beside .whl (bench/README.md): that call keeps them in /tmp/oracle_keep.
set -u
SRC="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf /tmp/w /tmp/suite && cp -a "$SRC" /tmp/w && cd /tmp/w
if [ ! -d .cache/oracle ] && [ -d /tmp/oracle_keep ]; then
    mkdir -p .cache && cp -a /tmp/oracle_keep .cache/oracle
fi
mkdir -p /tmp/suite
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /tmp/suite/gpu-name.txt
for run in "$@"; do
    python3 bench/gpu_suite.py "$run" --out "/tmp/suite/$run"
done
echo done > /tmp/suite/DONE
