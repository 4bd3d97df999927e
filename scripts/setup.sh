#!/usr/bin/env bash
# Install what specd's build and tests need on a Debian/Ubuntu machine. Idempotent: does
# nothing (and needs no network) when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(build-essential pkg-config libmicrohttpd-dev libjansson-dev libuv1-dev libcmocka-dev
          libpcre2-dev libutf8proc-dev libgnutls28-dev curl python3 python3-pip haproxy)
PIP_PKGS=(pytest openai anthropic requests tokenizers tiktoken jinja2 numpy httpx matplotlib pyyaml kubernetes-validate jsonschema)

missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
need_pip=()
for p in "${PIP_PKGS[@]}"; do
    mod=$p
    [ "$p" = "jinja2" ] && mod=jinja2
    [ "$p" = "pyyaml" ] && mod=yaml
    [ "$p" = "kubernetes-validate" ] && mod=kubernetes_validate
    $PY -c "import $mod" 2>/dev/null || need_pip+=("$p")
done
if ((${#need_pip[@]})); then
    echo "setup: pip installing ${need_pip[*]}"
    $PY -m pip install -q "${need_pip[@]}" 2>/dev/null ||
        $PY -m pip install -q --break-system-packages "${need_pip[@]}"
fi
