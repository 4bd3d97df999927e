/* safetensors reader (prefix st_): the tensor directory of one memory-mapped
 * .safetensors file.
 *
 * Format: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {...}}, then the data section; offsets are relative to its start.
 *
 * Ownership: st_open() mmaps the file read-only; tensor names and data point into memory
 * owned by the st_file and stay valid until st_close(). Nothing is copied. */
#ifndef SPECD_SAFETENSORS_H
#define SPECD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 8

typedef enum {
    ST_F32 = 0, ST_F16, ST_BF16, ST_F64, ST_I64, ST_I32, ST_I16, ST_I8, ST_U8, ST_BOOL,
    ST_F8_E4M3, ST_F8_E5M2,
} st_dtype;

typedef struct {
    const char *name;       /* NUL-terminated */
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;       /* into the mapping */
    size_t nbytes;
} st_tensor;

typedef struct st_file st_file;

/* Open, map and validate the whole header: JSON syntax, every dtype, shape and offset,
 * and that [begin, end) lies in the file and holds exactly numel * element size bytes.
 * NULL + a message naming the file and the problem on failure. */
st_file *st_open(const char *path, char *err, size_t errlen);
void st_close(st_file *f);

const char *st_path(const st_file *f);
int64_t st_n_tensors(const st_file *f);
const st_tensor *st_tensor_at(const st_file *f, int64_t i);   /* sorted by name */
const st_tensor *st_find(const st_file *f, const char *name);  /* NULL if absent */

const char *st_dtype_name(st_dtype t);
size_t st_dtype_size(st_dtype t);

#endif
