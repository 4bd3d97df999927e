/* `specd tokenize` and `specd detokenize`: the tokenizer from a shell, no model, no HTTP.
 * The hidden `tokenize --bench N [--bench-chunk BYTES]` encodes the text N times (whole, or
 * as documents of about BYTES each) and prints the best throughput as JSON;
 * scripts/bench_tokenizer.py uses it to compare with HF tokenizers. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/err.h"
#include "engine/text/tokenizer.h"
#include "server/cli.h"
#include "server/cmd.h"

static const char TOKENIZE_HELP[] =
    "usage: specd tokenize --tokenizer PATH (--text S | --text-file F) [--add-special] [--json]\n"
    "\n"
    "Encode UTF-8 text to token ids exactly as HF tokenizers does.\n"
    "\n"
    "  --tokenizer PATH   checkpoint directory, tokenizer.json, or .gguf file\n"
    "  --text S           the text\n"
    "  --text-file F      read the text from a file\n"
    "  --add-special      add BOS/EOS as the tokenizer's config says\n"
    "  --json             print {\"ids\":[...],\"count\":N} instead of space-separated ids\n";

static const char DETOKENIZE_HELP[] =
    "usage: specd detokenize --tokenizer PATH --ids 1,2,3 [--skip-special] [--json]\n"
    "\n"
    "Decode token ids to text (bytes that are not valid UTF-8 become U+FFFD, as HF).\n"
    "\n"
    "  --tokenizer PATH   checkpoint directory, tokenizer.json, or .gguf file\n"
    "  --ids LIST         comma-separated token ids\n"
    "  --skip-special     drop special tokens\n"
    "  --json             print {\"text\":\"...\"}\n";

/* Encodes `reps` times (at least once) and prints bytes, seconds, MB/s as JSON. With
 * chunk > 0 the text is encoded as separate documents of about `chunk` bytes (cut after a
 * newline), the size of real prompts; "hash" then lets a caller check the ids without
 * printing millions of them. */
static int bench(const tok_tokenizer *t, const char *text, size_t len, int add_special,
                 int reps, size_t chunk) {
    char err[256];
    double best = 1e30;
    long count = 0;
    uint64_t hash = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = cli_now_s();
        count = 0;
        hash = 0;
        for (size_t pos = 0; pos < len || (len == 0 && pos == 0);) {
            size_t end = len;
            if (chunk && pos + chunk < len) {
                const char *nl = memchr(text + pos + chunk, '\n', len - pos - chunk);
                end = nl ? (size_t)(nl - text) + 1 : len;
            }
            int32_t *ids;
            int n = tok_encode(t, text + pos, end - pos, add_special, &ids, err, sizeof err);
            if (n < 0) {
                fprintf(stderr, "specd tokenize: %s\n", err);
                return 1;
            }
            for (int i = 0; i < n; i++, count++)
                hash = hash * 1000003u + (uint64_t)(uint32_t)ids[i] + 1;
            free(ids);
            if (end == pos) break;
            pos = end;
        }
        double dt = cli_now_s() - t0;
        if (dt < best) best = dt;
    }
    printf("{\"bytes\":%zu,\"count\":%ld,\"hash\":%llu,\"seconds\":%.6f,\"mb_per_s\":%.3f}\n",
           len, count, (unsigned long long)hash, best, (double)len / 1e6 / best);
    return 0;
}

int cmd_tokenize(int argc, char **argv) {
    const char *path = NULL, *text = NULL, *file = NULL;
    int add_special = 0, json = 0, reps = 0, chunk = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(TOKENIZE_HELP, stdout);
            return 0;
        }
        if (!strcmp(a, "--add-special")) add_special = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else if (i + 1 < argc && (!strcmp(a, "--tokenizer") || !strcmp(a, "--model"))) path = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--text")) text = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--text-file")) file = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--bench")) {
            if (cli_int(argv[++i], 1, 1000000, &reps)) {
                fprintf(stderr, "specd tokenize: --bench wants a count >= 1\n");
                return 2;
            }
        } else if (i + 1 < argc && !strcmp(a, "--bench-chunk")) {
            if (cli_int(argv[++i], 1, 1 << 30, &chunk)) {
                fprintf(stderr, "specd tokenize: --bench-chunk wants a byte count >= 1\n");
                return 2;
            }
        } else {
            fprintf(stderr, "specd tokenize: unknown or incomplete option '%s'\n\n%s", a,
                    TOKENIZE_HELP);
            return 2;
        }
    }
    if (!path || (!text == !file)) {
        fprintf(stderr, "specd tokenize: need --tokenizer and one of --text / --text-file\n\n%s",
                TOKENIZE_HELP);
        return 2;
    }
    size_t len = text ? strlen(text) : 0;
    char *buf = NULL;
    if (file && !(buf = cli_read_file(file, &len))) {
        fprintf(stderr, "specd tokenize: cannot read %s\n", file);
        return 1;
    }
    if (file) text = buf;
    char err[512];
    tok_tokenizer *t = tok_load(path, err, sizeof err);
    if (!t) {
        fprintf(stderr, "specd tokenize: %s\n", err);
        free(buf);
        return 1;
    }
    int rc = 0;
    if (reps) {
        rc = bench(t, text, len, add_special, reps, (size_t)chunk);
        goto out;
    }
    int32_t *ids;
    int n = tok_encode(t, text, len, add_special, &ids, err, sizeof err);
    if (n < 0) {
        fprintf(stderr, "specd tokenize: %s\n", err);
        rc = 1;
        goto out;
    }
    if (json) fputs("{\"ids\":[", stdout);
    for (int i = 0; i < n; i++) printf(i ? (json ? ",%d" : " %d") : "%d", ids[i]);
    if (json) printf("],\"count\":%d}\n", n);
    else putchar('\n');
    free(ids);
out:
    tok_free(t);
    free(buf);
    return rc;
}

/* JSON string body: escapes quotes, backslashes and control chars; UTF-8 passes as is. */
static void put_json_string(const char *s, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c == '\n') fputs("\\n", stdout);
        else if (c == '\t') fputs("\\t", stdout);
        else if (c == '\r') fputs("\\r", stdout);
        else if (c < 0x20 || c == 0x7f) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

int cmd_detokenize(int argc, char **argv) {
    const char *path = NULL, *list = NULL;
    int skip = 0, json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(DETOKENIZE_HELP, stdout);
            return 0;
        }
        if (!strcmp(a, "--skip-special")) skip = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else if (i + 1 < argc && (!strcmp(a, "--tokenizer") || !strcmp(a, "--model"))) path = argv[++i];
        else if (i + 1 < argc && !strcmp(a, "--ids")) list = argv[++i];
        else {
            fprintf(stderr, "specd detokenize: unknown or incomplete option '%s'\n\n%s", a,
                    DETOKENIZE_HELP);
            return 2;
        }
    }
    if (!path || !list) {
        fprintf(stderr, "specd detokenize: need --tokenizer and --ids\n\n%s", DETOKENIZE_HELP);
        return 2;
    }
    int32_t *ids = NULL;
    int n = *list ? cli_parse_ids(list, &ids) : 0;
    if (n < 0) {
        fprintf(stderr, "specd detokenize: --ids must be comma-separated integers\n");
        return 2;
    }
    char err[512];
    tok_tokenizer *t = tok_load(path, err, sizeof err);
    if (!t) {
        fprintf(stderr, "specd detokenize: %s\n", err);
        free(ids);
        return 1;
    }
    int rc = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tok_vocab_size(t)) {
            fprintf(stderr, "specd detokenize: id %d out of range (vocabulary of %d)\n", ids[i],
                    tok_vocab_size(t));
            rc = 2;
            goto out;
        }
    char *text;
    size_t len;
    if (tok_decode(t, ids, (size_t)n, skip, &text, &len) != 0) {
        fprintf(stderr, "specd detokenize: out of memory\n");
        rc = 1;
        goto out;
    }
    if (json) {
        fputs("{\"text\":", stdout);
        put_json_string(text, len);
        fputs("}\n", stdout);
    } else {
        fwrite(text, 1, len, stdout);
        putchar('\n');
    }
    free(text);
out:
    free(ids);
    tok_free(t);
    return rc;
}
