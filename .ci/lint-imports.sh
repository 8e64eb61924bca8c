#!/usr/bin/env bash
# NOTE [Layers] (pyproject.toml): import-linter reads packages from disk, and zerofx.passes and
# zerofx.cost_models exist as such only once installed (setuptools package-dir maps the top-level
# passes/ and cost_models/ folders). So the contracts are checked on a real, non-editable install
# of the working tree in a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
target="$(mktemp -d)"
trap 'rm -rf "$target" build' EXIT
pip install -q --no-deps --no-build-isolation --target "$target" .
(cd "$target" && PYTHONPATH="$target" lint-imports "$OLDPWD/pyproject.toml")
