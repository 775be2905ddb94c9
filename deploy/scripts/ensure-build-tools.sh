#!/usr/bin/env bash
# The llama-server build needs cmake and a C++ compiler; install them when they are missing.
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "The llama-server build needs: ${missing[*]}. Install them (apt-get install -y ${missing[*]}) and rerun." >&2
  exit 1
fi
echo "Installing build tools: ${missing[*]}"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
