/* Small jansson helpers (prefix ju_) for reading configuration files (config.json,
 * generation_config.json, safetensors index) with messages that name the file and key.
 *
 * Lookups distinguish "absent" (key missing or JSON null, which HF configs use for "not
 * set") from "present but the wrong type", so callers can apply defaults for the first
 * and report the second. */
#ifndef SPECD_JSON_UTIL_H
#define SPECD_JSON_UTIL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define JU_ABSENT 1

/* Parse a whole file. 0 and *out (caller json_decref's) or SPECD_EIO / SPECD_EFORMAT with
 * "path: ..." in err. Duplicate keys are rejected. */
int ju_load_file(const char *path, json_t **out, char *err, size_t errlen);

/* 0: *out set; JU_ABSENT: missing or null; SPECD_EFORMAT: wrong type (message written). */
int ju_int(const json_t *obj, const char *key, int64_t *out, const char *file, char *err,
           size_t errlen);
/* Any JSON number (integer or real). */
int ju_num(const json_t *obj, const char *key, double *out, const char *file, char *err,
           size_t errlen);
int ju_bool(const json_t *obj, const char *key, int *out, const char *file, char *err,
            size_t errlen);
/* String value (owned by obj). */
int ju_str(const json_t *obj, const char *key, const char **out, const char *file, char *err,
           size_t errlen);

#endif
