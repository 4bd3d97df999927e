# Sourced by the GPU scripts: library paths for binaries built on another machine.
# cuBLAS from the CUDA toolkit (else PyTorch's wheel); NCCL for tensor parallelism from
# $SPECD_NCCL_LIB, the toolkit, the system, or PyTorch's nvidia-nccl wheel.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
if ! ls /usr/local/cuda/lib64/libcublas.so.* >/dev/null 2>&1; then
    pyblas=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
    [ -n "$pyblas" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$pyblas"
fi
export LD_LIBRARY_PATH
if [ -z "${SPECD_NCCL_LIB:-}" ]; then
    for f in /usr/local/cuda/lib64/libnccl.so.2 /usr/lib/x86_64-linux-gnu/libnccl.so.2 \
             "$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)"; do
        if [ -n "$f" ] && [ -f "$f" ]; then export SPECD_NCCL_LIB=$f; break; fi
    done
fi
# NVLink multicast stays off on shared machines (docs/tensor-parallel.md).
export NCCL_NVLS_ENABLE=0
