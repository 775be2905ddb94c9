#!/usr/bin/env bash
# Refresh static/vendor/htmx/ from the npm package htmx.org (no CDN at run time).
# Usage: deploy/scripts/vendor-htmx.sh [VERSION]
set -euo pipefail
version="${1:-2.0.11}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack "htmx.org@${version}" --silent >/dev/null)
tar -xzf "$work/htmx.org-${version}.tgz" -C "$work"
install -m 0644 "$work/package/dist/htmx.min.js" "$root/static/vendor/htmx/htmx.min.js"
install -m 0644 "$work/package/LICENSE" "$root/static/vendor/htmx/LICENSE"
echo "$version" > "$root/static/vendor/htmx/VERSION"
echo "htmx.org ${version} vendored into static/vendor/htmx/"
