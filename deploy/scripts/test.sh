#!/usr/bin/env bash
# The whole test suite against real PostgreSQL, Redis, Docker, llama-server and Chromium.
# Called by `make test` (after the virtualenv is ready) and, through it, by CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python

# The floors first (seconds): no module imports one on a floor above it (pyproject.toml [tool.importlinter]).
.venv/bin/lint-imports

services_env=$(deploy/scripts/ensure-services.sh)  # a failure here stops the run (set -e)
while IFS='=' read -r key value; do export "$key=$value"; done <<<"$services_env"

deploy/scripts/ensure-build-tools.sh
# Plain Python: builds (or reuses) the cached llama-server before Django is configured.
$PY -m serving.engines.build_llamacpp
$PY -m serving.engines.llamacpp_image --if-docker  # the llama.cpp engine image (debootstrap base + that binary)

export DATABASE_URL=${BERTH_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/berth}
export REDIS_URL=${BERTH_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}
export BERTH_SECRET_KEY=test-only-secret-key-not-for-production-use-0123456789
export BERTH_KEY_PEPPER=test-only-key-pepper-not-for-production-use-0123456789
export BERTH_DATA_DIR=${BERTH_TEST_DATA_DIR:-$PWD/var/test}
mkdir -p "$BERTH_DATA_DIR"

set +e
$PY -m pytest "$@"
status=$?
set -e
if [ $status -eq 5 ]; then
  echo "pytest collected no tests: that is a failure, not a pass." >&2
  exit 1
fi

# Again on the embedded default a newcomer meets first (SQLite, the file broker, no Redis): the tests
# marked `embedded` (tests/conftest.py EMBEDDED). Its secret key and pepper are generated into its own
# data directory, as `make up` does.
echo "== the embedded default: SQLite and the file broker ==" >&2
embedded_dir="$BERTH_DATA_DIR/embedded"
rm -rf "$embedded_dir" && mkdir -p "$embedded_dir"
set +e
env -u DATABASE_URL -u REDIS_URL -u BERTH_SECRET_KEY -u BERTH_KEY_PEPPER BERTH_DATA_DIR="$embedded_dir" \
  $PY -m pytest -m embedded -p no:cacheprovider "$@"
embedded_status=$?
set -e
if [ $embedded_status -eq 5 ] && [ $# -gt 0 ]; then
  embedded_status=0  # the arguments chose no embedded test
elif [ $embedded_status -eq 5 ]; then
  echo "no test is marked embedded: that is a failure, not a pass." >&2
  exit 1
fi
[ $status -ne 0 ] && exit $status
exit $embedded_status
