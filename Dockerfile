# specd container image: build on CUDA 13 devel, run on CUDA 13 runtime (no compiler).
#
#   docker build -t specd .
#   docker run --gpus all -p 8000:8000 -v $PWD/models:/models specd \
#       --model /models/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda
#
# See docs/deploy.md (what was and was not verified is listed there).

# ---------------------------------------------------------------- build stage
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04 AS build

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        build-essential pkg-config libmicrohttpd-dev libjansson-dev libuv1-dev \
        libpcre2-dev libutf8proc-dev libgnutls28-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .
# nvcc is on PATH in the devel image, so the Makefile also builds kernels/*.cu and
# engine/cuda/*.c (sm_90a / sm_90 + compute_90 PTX). libmicrohttpd, libuv and utf8proc
# are linked statically; jansson, pcre2, gnutls and the CUDA libraries stay shared.
RUN make -j"$(nproc)" build/specd

# -------------------------------------------------------------- runtime stage
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

# Shared libraries build/specd needs beyond libc (from `ldd build/specd`):
#   libjansson.so.4  -> libjansson4
#   libpcre2-8.so.0  -> libpcre2-8-0
#   libgnutls.so.30  -> libgnutls30t64 (Ubuntu 24.04's name; libgnutls30 on Debian 12)
#   libstdc++.so.6   -> libstdc++6 (CUDA build only; already in the base image)
#   libcublas.so.13, libcublasLt.so.13 -> in the CUDA runtime base image
#   libcuda.so (driver) -> injected by the NVIDIA container toolkit (--gpus)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libjansson4 libpcre2-8-0 libgnutls30t64 libstdc++6 \
 && rm -rf /var/lib/apt/lists/*

COPY --from=build /src/build/specd /usr/local/bin/specd
COPY config/specd.json /etc/specd/specd.json

RUN groupadd --gid 10001 specd \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin specd
USER specd

# Listen on all interfaces inside the container (the built-in default is 127.0.0.1).
# Precedence is command line > SPECD_* environment > --config file > default, so this
# beats a "host" key in a mounted config file; pass --host or -e SPECD_HOST to change it.
ENV SPECD_HOST=0.0.0.0
EXPOSE 8000

# Liveness without curl in the image: bash's /dev/tcp. /health answers 200 as soon as the
# HTTP server is up (also while the model loads). Uses SPECD_PORT if set, else 8000.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${SPECD_PORT:-8000} && printf 'GET /health HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200'"]

# SIGTERM starts a drain of up to drain_timeout (30 s) seconds: give `docker stop` at
# least that long (docker run --stop-timeout 35, or stop_grace_period in compose).
STOPSIGNAL SIGTERM
ENTRYPOINT ["specd", "serve"]
CMD ["--model", "/models/model.gguf"]
