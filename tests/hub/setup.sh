#!/usr/bin/env bash
# Installs what tests/hub needs on a fresh machine; a few seconds when everything is already there.
#   - jupyterhub (PyPI) into the Python that runs the tests, when it is missing
#     (normally it comes with `pip install -e '.[test]'`);
#   - every other JupyterHub major the [hub] extra allows, each in a virtual environment of its own under
#     tests/hub/.versions/ (ignored by git; tests/hub/hub_versions.py: about a minute per major the first time);
#   - configurable-http-proxy (npm registry), pinned by tests/hub/node/package-lock.json, into
#     tests/hub/node/node_modules (ignored by git).
# Usage: bash tests/hub/setup.sh   (with the test venv active; HUB_TEST_PYTHON=/path/to/python picks another)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${HUB_TEST_PYTHON:-python3}"

if ! "$python" -c "import jupyterhub" 2>/dev/null; then
  echo "tests/hub/setup.sh: installing jupyterhub into $("$python" -c 'import sys; print(sys.prefix)')"
  "$python" -m pip install --quiet "$("$python" "$here/hub_versions.py" requirement)"
fi
"$python" "$here/hub_versions.py" install

chp="$here/node/node_modules/.bin/configurable-http-proxy"
if [ ! -x "$chp" ] || ! "$chp" --version >/dev/null 2>&1; then
  command -v npm >/dev/null || { echo "tests/hub/setup.sh: npm not found; configurable-http-proxy needs Node.js >= 18" >&2; exit 1; }
  echo "tests/hub/setup.sh: installing configurable-http-proxy into $here/node"
  npm ci --prefix "$here/node" --no-audit --no-fund --loglevel=error
fi
echo "tests/hub/setup.sh: ready: jupyterhub $("$python" -c 'import jupyterhub; print(jupyterhub.__version__)'), configurable-http-proxy $("$chp" --version)"
