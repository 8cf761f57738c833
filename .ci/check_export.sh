#!/usr/bin/env bash
# Fails when the exported modules in mixedprec/ differ from what the notebooks in nbs/ export.
set -euo pipefail
cd "$(dirname "$0")/.."
snapshot() { (cd mixedprec && find . -name '*.py' -not -path './csrc/*' | LC_ALL=C sort | xargs sha1sum); }
before=$(snapshot)
.venv/bin/nbdev-export
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "mixedprec/ was out of sync with nbs/: nbdev-export has now rewritten these files; review and commit them:"
  diff <(echo "$before") <(echo "$after") || true
  exit 1
fi
echo "export check: mixedprec/ matches the notebooks"
