/* Helpers shared by the tests that read fixture checkpoints and write modified ones
 * (tests/test_formats.c, tests/test_fp8.c): whole files in and out, JSON files, and a
 * safetensors file parsed here, independently of engine/model/safetensors.c. Include
 * after cmocka.h, jansson.h and tests/fixtures.h. */
#ifndef SPECD_TEST_ST_UTIL_H
#define SPECD_TEST_ST_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fixture_model(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/models/%s", fixtures_dir(), name);
}

/* The whole file; the test fails if it cannot be read. */
static unsigned char *read_file(const char *path, size_t *len) {
    unsigned char *b = (unsigned char *)read_all(path, len);
    if (!b) fail_msg("cannot read %s", path);
    return b;
}

static void write_all(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static json_t *load_json(const char *path) {
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) fail_msg("%s: %s", path, je.text);
    return j;
}

/* A parsed safetensors file. */
typedef struct {
    unsigned char *bytes;
    size_t len, data_start;
    json_t *header;
} raw_st;

static void raw_st_load(raw_st *r, const char *path) {
    uint64_t hl;
    r->bytes = read_file(path, &r->len);
    memcpy(&hl, r->bytes, 8);
    json_error_t je;
    r->header = json_loadb((const char *)r->bytes + 8, (size_t)hl, 0, &je);
    assert_non_null(r->header);
    r->data_start = 8 + (size_t)hl;
}

static void raw_st_free(raw_st *r) {
    json_decref(r->header);
    free(r->bytes);
}

/* Tensor `name`'s bytes (the test fails if it is absent). */
static const unsigned char *raw_st_data(const raw_st *r, const char *name, size_t *nbytes) {
    json_t *t = json_object_get(r->header, name);
    if (!t) fail_msg("fixture has no tensor %s", name);
    json_t *off = json_object_get(t, "data_offsets");
    size_t b = (size_t)json_integer_value(json_array_get(off, 0));
    size_t e = (size_t)json_integer_value(json_array_get(off, 1));
    *nbytes = e - b;
    return r->bytes + r->data_start + b;
}

#endif
