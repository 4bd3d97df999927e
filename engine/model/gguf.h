/* GGUF v2/v3 reader (prefix gguf_): metadata key/values and the tensor directory of a
 * memory-mapped .gguf file. Used by the model loader (tensors) and the tokenizer
 * (tokenizer.ggml.* metadata).
 *
 * Ownership: gguf_open() mmaps the file read-only; every pointer handed out (strings,
 * arrays, tensor data) points into that mapping and stays valid until gguf_close().
 * Strings in GGUF are NOT NUL-terminated: they come back as (ptr, len). */
#ifndef SPECD_GGUF_H
#define SPECD_GGUF_H

#include <stddef.h>
#include <stdint.h>

typedef struct gguf gguf;

/* GGUF metadata value types, numbered as in the file format. */
typedef enum {
    GGUF_T_UINT8 = 0, GGUF_T_INT8 = 1, GGUF_T_UINT16 = 2, GGUF_T_INT16 = 3,
    GGUF_T_UINT32 = 4, GGUF_T_INT32 = 5, GGUF_T_FLOAT32 = 6, GGUF_T_BOOL = 7,
    GGUF_T_STRING = 8, GGUF_T_ARRAY = 9, GGUF_T_UINT64 = 10, GGUF_T_INT64 = 11,
    GGUF_T_FLOAT64 = 12,
} gguf_type;

/* ggml tensor types, numbered as ggml numbers them (only these are supported). */
typedef enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7,
    GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30,
} ggml_type;

typedef struct {
    const char *name; size_t name_len;
    int n_dims;
    int64_t ne[4];        /* ggml order: ne[0] is the fastest-varying (row length) */
    ggml_type type;
    const void *data;     /* into the mapping, already offset and alignment-checked */
    size_t nbytes;
} gguf_tensor;

/* Open and validate the whole file (header, every key, tensor directory, that every
 * tensor's bytes lie inside the file). On failure returns NULL and writes a message
 * naming the file and the problem into err. */
gguf *gguf_open(const char *path, char *err, size_t errlen);
void gguf_close(gguf *g);

uint32_t gguf_version(const gguf *g);
int64_t gguf_n_kv(const gguf *g);
int64_t gguf_n_tensors(const gguf *g);

/* Metadata lookup; all return <0 (SPECD_ENOTFOUND / SPECD_EFORMAT on type mismatch). */
int gguf_find_key(const gguf *g, const char *key);              /* index or <0 */
gguf_type gguf_key_type(const gguf *g, int idx);
int gguf_get_u64(const gguf *g, const char *key, uint64_t *out); /* any int type, bool */
int gguf_get_i64(const gguf *g, const char *key, int64_t *out);
int gguf_get_f64(const gguf *g, const char *key, double *out);   /* any float or int */
int gguf_get_bool(const gguf *g, const char *key, int *out);
int gguf_get_str(const gguf *g, const char *key, const char **s, size_t *len);
/* Arrays: element type and count; then element accessors. */
int gguf_get_arr(const gguf *g, const char *key, gguf_type *elem_type, uint64_t *n);
int gguf_arr_str(const gguf *g, const char *key, uint64_t i, const char **s, size_t *len);
int gguf_arr_i64(const gguf *g, const char *key, uint64_t i, int64_t *out);  /* int elems */
int gguf_arr_f64(const gguf *g, const char *key, uint64_t i, double *out);   /* numeric */

/* Tensors. */
const gguf_tensor *gguf_tensor_at(const gguf *g, int64_t i);
const gguf_tensor *gguf_find_tensor(const gguf *g, const char *name);

/* Bytes per row of ne0 elements of type t (block-quantized types need ne0 % block == 0);
 * 0 if unsupported. */
size_t ggml_row_size(ggml_type t, int64_t ne0);
const char *ggml_type_name(ggml_type t);

/* Added for the model loader: IEEE half to float (exact, subnormals and NaN included), and
 * dequantization of n consecutive elements of type t (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
 * Q4_K, Q6_K) starting at a block boundary; n must be a multiple of the block size.
 * Returns 0, SPECD_EUNSUPPORTED for other types, SPECD_EINVAL for a bad n. */
float ggml_fp16_to_f32(uint16_t h);
int ggml_dequantize(ggml_type t, const void *src, float *dst, int64_t n);

#endif
