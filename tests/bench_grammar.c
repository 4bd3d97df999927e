/* Constrained decoding benchmark (prints numbers; not a test): schema compile time, trie
 * build time, and the time of one token mask while a valid JSON document is generated,
 * at the vocabularies given on the command line.
 *
 *   make bench-grammar   (or: build/tests/bench_grammar TOKENIZER... )
 *
 * TOKENIZER is a .gguf, a tokenizer.json or a checkpoint directory. For each one it
 * feeds the real tokenization of several documents valid under a realistic schema (and
 * under json_object) and times matcher_fill_mask before every token: p50 / p99 / max
 * over all steps ("no mask cache": every mask a full trie scan, as the first visit of a
 * state costs). docs/structured-outputs.md holds the numbers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/text/grammar.h"
#include "engine/text/tokenizer.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *v, int n, double p) { return v[(int)(p * (n - 1) + 0.5)]; }

/* A schema shaped like what agents send: nested object, enum, array of objects,
 * optional fields, a number, a boolean, a $ref. */
static const char *SCHEMA =
    "{\"$defs\":{\"Address\":{\"type\":\"object\",\"properties\":{"
    "\"street\":{\"type\":\"string\"},\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},"
    "\"required\":[\"street\",\"city\",\"zip\"],\"additionalProperties\":false}},"
    "\"type\":\"object\",\"properties\":{"
    "\"id\":{\"type\":\"integer\"},"
    "\"name\":{\"type\":\"string\",\"description\":\"full name\"},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"},"
    "\"role\":{\"enum\":[\"admin\",\"editor\",\"viewer\"]},"
    "\"score\":{\"type\":\"number\"},"
    "\"active\":{\"type\":\"boolean\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":8},"
    "\"addresses\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/Address\"}},"
    "\"manager\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"
    "\"notes\":{\"type\":\"string\"}},"
    "\"required\":[\"id\",\"name\",\"email\",\"role\",\"score\",\"active\",\"tags\",\"addresses\",\"manager\"],"
    "\"additionalProperties\":false}";

static const char *DOCS[] = {
    "{\"id\": 1042, \"name\": \"Ada Lovelace\", \"email\": \"ada@example.org\", \"role\": \"admin\", "
    "\"score\": 98.5, \"active\": true, \"tags\": [\"math\", \"engines\", \"poetry\"], "
    "\"addresses\": [{\"street\": \"12 St James's Square\", \"city\": \"London\", \"zip\": \"10001\"}], "
    "\"manager\": null, \"notes\": \"First to publish an algorithm meant for a machine; wrote at length "
    "about what the Analytical Engine could and could not do.\"}",
    "{\n  \"id\": 7,\n  \"name\": \"Grace Hopper\",\n  \"email\": \"grace@navy.mil\",\n  \"role\": \"editor\",\n"
    "  \"score\": -3.25e2,\n  \"active\": false,\n  \"tags\": [],\n  \"addresses\": [\n    {\"street\": \"1 Main St\", "
    "\"city\": \"Arlington\", \"zip\": \"22201\"},\n    {\"street\": \"Pier 4\", \"city\": \"Norfolk\", \"zip\": \"23501\"}\n  ],\n"
    "  \"manager\": \"Howard Aiken\"\n}",
    "{\"id\":0,\"name\":\"\xe5\xbc\xa0\xe4\xbc\x9f \\\"Wei\\\"\",\"email\":\"w@x.cn\",\"role\":\"viewer\",\"score\":0,"
    "\"active\":true,\"tags\":[\"a\",\"b\",\"c\",\"d\"],\"addresses\":[],\"manager\":null,"
    "\"notes\":\"Caf\xc3\xa9 \xe2\x98\x95 and \\u00e9 escapes, tabs\\tand newlines\\n too.\"}",
};

typedef struct {
    double *v;
    int n, cap;
} samples;

static void push(samples *s, double x) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 1024;
        s->v = realloc(s->v, (size_t)s->cap * sizeof *s->v);
    }
    s->v[s->n++] = x;
}

static void report(const char *what, samples *s) {
    qsort(s->v, (size_t)s->n, sizeof *s->v, cmp_d);
    double sum = 0;
    for (int i = 0; i < s->n; i++) sum += s->v[i];
    printf("  %-34s steps %5d  p50 %8.1f us  p99 %8.1f us  max %8.1f us  mean %8.1f us\n", what, s->n,
           pct(s->v, s->n, 0.5), pct(s->v, s->n, 0.99), s->v[s->n - 1], sum / s->n);
}

/* Feed every document's tokens, timing the mask before each; reps times over. */
static int run_docs(grammar *g, const tok_tokenizer *t, const vocab_trie *vt, const char *const *docs, int nd,
                    int reps, int nocache, samples *s) {
    uint32_t *mask = malloc(vocab_mask_words(vocab_trie_n_vocab(vt)) * sizeof *mask);
    for (int r = 0; r < reps; r++)
        for (int d = 0; d < nd; d++) {
            int32_t *ids;
            char err[256];
            int n = tok_encode(t, docs[d], strlen(docs[d]), 0, &ids, err, sizeof err);
            if (n <= 0) return fprintf(stderr, "encode: %s\n", err), -1;
            matcher *m = matcher_new(g, vt);
            if (nocache) matcher_set_cache(m, 0);   /* a full scan every time */
            for (int i = 0; i <= n; i++) {
                double t0 = now_us();
                matcher_fill_mask(m, mask);
                push(s, now_us() - t0);
                if (i < n && matcher_accept_token(m, ids[i])) {
                    fprintf(stderr, "document %d: token %d (#%d) rejected\n", d, ids[i], i);
                    return -1;
                }
            }
            matcher_free(m);
            free(ids);
        }
    free(mask);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TOKENIZER...  (a .gguf, tokenizer.json or checkpoint dir)\n", argv[0]);
        return 2;
    }
    char err[512];
    /* schema compile time (no vocabulary involved) */
    samples comp = {0};
    grammar *g = NULL;
    char *text = malloc(strlen(SCHEMA) + 64);
    for (int i = 0; i < 50; i++) {
        /* i trailing spaces: the same schema, another text, so the compile cache misses */
        size_t n = strlen(SCHEMA);
        memcpy(text, SCHEMA, n);
        memset(text + n, ' ', (size_t)i);
        double t0 = now_us();
        grammar *x = grammar_compile(GRAMMAR_JSON_SCHEMA, text, n + (size_t)i, err, sizeof err);
        push(&comp, now_us() - t0);
        if (!x) return fprintf(stderr, "compile: %s\n", err), 1;
        if (g) grammar_unref(x);
        else g = x;
    }
    free(text);
    qsort(comp.v, (size_t)comp.n, sizeof *comp.v, cmp_d);
    grammar_unref(grammar_compile(GRAMMAR_JSON_SCHEMA, SCHEMA, strlen(SCHEMA), err, sizeof err));
    double t0 = now_us();
    grammar *hit = grammar_compile(GRAMMAR_JSON_SCHEMA, SCHEMA, strlen(SCHEMA), err, sizeof err);
    double hit_us = now_us() - t0;
    grammar_unref(hit);
    printf("schema compile: p50 %.0f us, max %.0f us (%d DFA states, %d rules); again (compile cache) %.1f us\n",
           pct(comp.v, comp.n, 0.5), comp.v[comp.n - 1], grammar_n_states(g), grammar_n_rules(g), hit_us);
    grammar *gj = grammar_compile(GRAMMAR_JSON, NULL, 0, err, sizeof err);
    for (int a = 1; a < argc; a++) {
        tok_tokenizer *t = tok_load(argv[a], err, sizeof err);
        if (!t) return fprintf(stderr, "%s: %s\n", argv[a], err), 1;
        int32_t eos = tok_eos_id(t);
        double t0 = now_us();
        vocab_trie *vt = vocab_trie_build(t, tok_vocab_size(t), &eos, 1, err, sizeof err);
        if (!vt) return fprintf(stderr, "trie: %s\n", err), 1;
        printf("%s: vocab %d, trie %d nodes built in %.1f ms\n", argv[a], tok_vocab_size(t), vocab_trie_n_nodes(vt),
               (now_us() - t0) / 1e3);
        /* the first matcher of a grammar for this vocabulary makes its mask classes */
        char *spaced = malloc(strlen(SCHEMA) + 80);   /* SCHEMA and 60 + a spaces: a grammar not cached */
        sprintf(spaced, "%s%*s", SCHEMA, 60 + a, "");
        grammar *fresh = grammar_compile(GRAMMAR_JSON_SCHEMA, spaced, strlen(spaced), err, sizeof err);
        free(spaced);
        if (!fresh) return fprintf(stderr, "compile: %s\n", err), 1;
        t0 = now_us();
        matcher *m1 = matcher_new(fresh, vt);
        double first_us = now_us() - t0;
        t0 = now_us();
        matcher *m2 = matcher_new(fresh, vt);
        printf("  first matcher of the schema (mask classes made) %.0f us, next %.1f us\n", first_us, now_us() - t0);
        matcher_free(m1);
        matcher_free(m2);
        grammar_unref(fresh);
        samples s = {0}, sj = {0}, sn = {0};
        if (run_docs(g, t, vt, DOCS, 3, 5, 0, &s) || run_docs(gj, t, vt, DOCS + 2, 1, 5, 0, &sj) ||
            run_docs(g, t, vt, DOCS, 3, 1, 1, &sn))
            return 1;
        report("json_schema, mask per token", &s);
        report("json_object, mask per token", &sj);
        report("json_schema, no mask cache", &sn);
        free(s.v);
        free(sj.v);
        free(sn.v);
        vocab_trie_free(vt);
        tok_free(t);
    }
    grammar_unref(g);
    grammar_unref(gj);
    free(comp.v);
    return 0;
}
