#!/usr/bin/env bash
# The browser tests of the GPU quota sidebar, from a fresh Debian machine with the project's Python venv
# active (gpu-quota-ext installed in it, e.g. `pip install -e ".[test]"`):
#   1. Debian's Chromium, when /usr/bin/chromium is missing (never `npx playwright install`);
#   2. the JupyterLab extension, built when missing or older than its sources, and known to jupyter;
#   3. Galata and Playwright in tests/ui/node_modules;
#   4. `jupyter lab` on a free loopback port with the extension and two static GPUs (their usage and
#      parking faked through a scenario file: ui_scenario.py);
#   5. the Galata tests; the server stopped; non-zero on a failure or when no test ran.
# The tests write screenshots only under build/ui/ (ignored by git): a test run leaves the tree as it was.
# `tests/ui/run.sh --pictures` (what `./run pictures` runs) instead starts the demo's server
# (jupyter_server_pictures_config.py), runs tests/pictures.spec.ts and copies its pictures to docs/images/.
# Extra arguments go to `playwright test` (e.g. `tests/ui/run.sh -g "shutting"`).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"

log() { echo "[ui] $*"; }

PICTURES=""
if [ "${1:-}" = "--pictures" ]; then
  PICTURES=1
  shift
fi
CONFIG="$HERE/jupyter_server_test_config.py"
OUT="$ROOT/build/ui"
if [ -n "$PICTURES" ]; then
  CONFIG="$HERE/jupyter_server_pictures_config.py"
  OUT="$ROOT/build/ui-pictures"
fi

if [ -z "${VIRTUAL_ENV:-}" ] && ! command -v jupyter >/dev/null; then
  echo "[ui] activate the project's Python venv first (jupyter not found)" >&2
  exit 2
fi

# 1. Chromium
CHROMIUM_PATH="${CHROMIUM_PATH:-/usr/bin/chromium}"
if [ ! -x "$CHROMIUM_PATH" ]; then
  log "installing Debian's chromium"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
export CHROMIUM_PATH

# 2. The extension: build when missing or stale, then make sure jupyter serves this build.
BUILT="$ROOT/gpu_quota_ext/labextension/static/style.js"
if [ ! -f "$BUILT" ] || [ -n "$(find labextension/src labextension/style labextension/schema labextension/package.json -newer "$BUILT" -print -quit)" ]; then
  log "building the JupyterLab extension"
  (cd labextension && jlpm install && jlpm build:prod)
fi
# The build jupyter serves must be this checkout's (another checkout or an installed copy may be there).
SERVED="$(python - <<'EOF'
import os
from jupyter_core.paths import jupyter_path
found = [os.path.join(d, "gpu-quota-ext") for d in jupyter_path("labextensions")]
print(next((os.path.realpath(f) for f in found if os.path.exists(f)), ""))
EOF
)"
if [ "$SERVED" != "$(cd gpu_quota_ext/labextension && pwd -P)" ] \
  || ! jupyter labextension list 2>&1 | grep -E "gpu-quota-ext .*enabled" | grep -q "OK"; then
  log "linking this checkout's extension into jupyter's labextensions folder (it served ${SERVED:-none})"
  jupyter labextension develop --overwrite . >/dev/null
fi

# 3. Galata
cd "$HERE"
if [ ! -x node_modules/.bin/playwright ]; then
  log "installing Galata and Playwright"
  if [ -f package-lock.json ]; then npm ci --no-audit --no-fund; else npm install --no-audit --no-fund; fi
fi

# 4. The server
PORT="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
WORK="$(mktemp -d -t gq-ui-XXXXXX)"
export GQ_UI_PORT="$PORT"
export JUPYTERLAB_GALATA_ROOT_DIR="$WORK/root"
# The scenario file the specs write through the contents API (its name under the root: SCENARIO in the specs).
export GQ_UI_SCENARIO="$JUPYTERLAB_GALATA_ROOT_DIR/gpu-scenario.json"
mkdir -p "$JUPYTERLAB_GALATA_ROOT_DIR"
log "starting jupyter lab on 127.0.0.1:$PORT with $(basename "$CONFIG") (log: $WORK/server.log)"
jupyter lab --config "$CONFIG" --allow-root --no-browser >"$WORK/server.log" 2>&1 &
SERVER_PID=$!

stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT

for _ in $(seq 1 120); do
  if curl -fsS "http://127.0.0.1:$PORT/api/gpu-quota/status" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "[ui] jupyter lab exited:" >&2
    tail -30 "$WORK/server.log" >&2
    exit 1
  fi
  sleep 0.5
done
curl -fsS "http://127.0.0.1:$PORT/api/gpu-quota/status" >/dev/null || {
  echo "[ui] the server did not answer on /api/gpu-quota/status" >&2
  tail -30 "$WORK/server.log" >&2
  exit 1
}

# 5. The tests (or the pictures), their screenshots under $OUT
rm -rf "$OUT"
mkdir -p "$OUT"
set +e
GQ_UI_OUT="$OUT" GQ_UI_PICTURES="$PICTURES" TARGET_URL="http://127.0.0.1:$PORT" \
  PLAYWRIGHT_JSON_OUTPUT_NAME="$WORK/results.json" \
  node_modules/.bin/playwright test --reporter=list,json "$@"
STATUS=$?
set -e

RAN="$(python - "$WORK/results.json" <<'EOF'
import json, sys
try:
    stats = json.load(open(sys.argv[1]))["stats"]
except Exception:
    print(0)
else:
    print(stats.get("expected", 0) + stats.get("unexpected", 0) + stats.get("flaky", 0))
EOF
)"
# For the caller's summary (./run test): the Playwright report as it is.
if [ -n "${UI_RESULTS_OUT:-}" ] && [ -f "$WORK/results.json" ]; then cp "$WORK/results.json" "$UI_RESULTS_OUT"; fi
if [ "$STATUS" -ne 0 ]; then
  echo "[ui] FAILED (server log: $WORK/server.log)" >&2
  tail -20 "$WORK/server.log" >&2
  exit "$STATUS"
fi
if [ "$RAN" -eq 0 ]; then
  echo "[ui] no test ran" >&2
  exit 1
fi
if [ -n "$PICTURES" ]; then
  mkdir -p "$ROOT/docs/images"
  # Lossless, a fifth smaller: the pictures are in every clone and on every docs page load.
  if command -v optipng >/dev/null; then
    optipng -quiet -o2 -strip all "$OUT"/*.png
  else
    log "optipng not found (Debian: apt-get install optipng): the pictures are copied as Chromium wrote them"
  fi
  cp "$OUT"/*.png "$ROOT/docs/images/"
  log "pictures refreshed in docs/images: $(cd "$OUT" && ls *.png | tr '\n' ' ')"
  exit 0
fi
log "$RAN tests passed (screenshots in ${OUT#"$ROOT"/})"
