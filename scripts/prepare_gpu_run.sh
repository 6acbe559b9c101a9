#!/usr/bin/env bash
# Packs the committed tree (HEAD) for scripts/gpu_run.sh on the device machine, where git
# history is not available. Run it here, then carry .gpu_src (and .whl) with the call.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_src
git archive HEAD >.gpu_src/head.tar
git rev-parse HEAD >.gpu_src/COMMIT
grep -qx '/.gpu_src/' .git/info/exclude 2>/dev/null || echo '/.gpu_src/' >>.git/info/exclude
echo "packed $(cat .gpu_src/COMMIT) ($(du -h .gpu_src/head.tar | cut -f1))"
