/* Constrained decoding tests: compile errors name the problem; each kind (JSON, JSON
 * Schema, regex, choice, GBNF) accepts and rejects the strings it should; and on the real
 * Qwen3 and Llama-3.1 vocabularies the trie mask equals a brute-force check of every
 * token, step by step while a valid document (tokenized as the tokenizer does) is fed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core/engine.h"
#include "engine/core/err.h"
#include "engine/text/grammar.h"
#include "engine/text/grammar_internal.h"
#include <jansson.h>
#include <unistd.h>
#include "engine/text/tokenizer.h"
#include "tests/fixtures.h"

/* ---- helpers ---- */

static grammar *compile_ok(grammar_kind k, const char *spec) {
    char err[512] = "";
    grammar *g = grammar_compile(k, spec, spec ? strlen(spec) : 0, err, sizeof err);
    if (!g) print_error("compile(%s) failed: %s\n", spec ? spec : "(null)", err);
    assert_non_null(g);
    return g;
}

/* Compile must fail and the message must contain want. */
static void compile_fails(grammar_kind k, const char *spec, const char *want) {
    char err[512] = "";
    grammar *g = grammar_compile(k, spec, strlen(spec), err, sizeof err);
    if (g || !strstr(err, want)) print_error("compile(%s): got '%s', want an error with '%s'\n", spec, err, want);
    assert_null(g);
    assert_non_null(strstr(err, want));
}

/* 1: s is a complete sentence; 0: rejected somewhere or incomplete. */
static int full_match(grammar *g, const char *s) {
    matcher *m = matcher_new(g, NULL);
    assert_non_null(m);
    int ok = matcher_accept_bytes(m, s, strlen(s)) == 0 && matcher_accepting(m);
    matcher_free(m);
    return ok;
}

/* 1: s is a prefix of some sentence. */
static int prefix_ok(grammar *g, const char *s) {
    matcher *m = matcher_new(g, NULL);
    int ok = matcher_check_bytes(m, s, strlen(s));
    matcher_free(m);
    return ok;
}

#define ACCEPT(g, s) do { if (!full_match(g, s)) print_error("should accept: %s\n", s); assert_true(full_match(g, s)); } while (0)
#define REJECT(g, s) do { if (full_match(g, s)) print_error("should reject: %s\n", s); assert_false(full_match(g, s)); } while (0)

/* ---- compile errors ---- */

static void test_schema_errors_name_keyword_and_path(void **state) {
    (void)state;
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\",\"multipleOf\":2}}}",
                  "/properties/age: 'multipleOf' is not supported");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":\"number\",\"maximum\":5}", "'maximum' is not supported");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"not\":{}}", "'not' is not supported");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":\"array\",\"uniqueItems\":true}", "'uniqueItems' is not supported");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"allOf\":[{},{}]}", "'allOf' is not supported");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"$ref\":\"#/$defs/missing\"}", "does not resolve");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"$ref\":\"http://x/y.json\"}", "does not resolve");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":\"strung\"}", "unknown type 'strung'");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":", "not valid JSON");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",\"required\":[\"x\"]}", "required property 'x'");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "backreferences");
    compile_fails(GRAMMAR_JSON_SCHEMA, "{\"anyOf\":[{\"type\":\"string\"}],\"minLength\":2}", "next to 'anyOf'");
    compile_fails(GRAMMAR_JSON_SCHEMA, "false", "matches nothing");
}

static void test_regex_choice_gbnf_errors(void **state) {
    (void)state;
    compile_fails(GRAMMAR_REGEX, "a(?=b)", "lookaround");
    compile_fails(GRAMMAR_REGEX, "a\\bc", "assertion");
    compile_fails(GRAMMAR_REGEX, "(ab", "missing ')'");
    compile_fails(GRAMMAR_REGEX, "a{2000}", "out of range");
    compile_fails(GRAMMAR_REGEX, "*a", "nothing to repeat");
    compile_fails(GRAMMAR_REGEX, "a^b", "anchors");
    compile_fails(GRAMMAR_CHOICE, "[\"a\", 3]", "choice[1] is not a string");
    compile_fails(GRAMMAR_CHOICE, "[]", "non-empty");
    compile_fails(GRAMMAR_GBNF, "root ::= item\n", "'item' is used but not defined");
    compile_fails(GRAMMAR_GBNF, "item ::= \"a\"\n", "no 'root' rule");
    compile_fails(GRAMMAR_GBNF, "root ::= root \"a\" | \"b\"\n", "left-recursive");
    compile_fails(GRAMMAR_GBNF, "root ::= \"a\"\nroot ::= \"b\"\n", "defined twice");
}

/* ---- languages ---- */

static void test_json_object_accepts_json_rejects_other(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_JSON, NULL);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"a\": [1, -2.5e+3, \"x\\u00e9\\n\", true, null, {\"b\": {}}], \"c\": \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}");
    ACCEPT(g, "{\n  \"a\": 0\n}");
    REJECT(g, "[1]");                 /* json_object: the root is an object */
    REJECT(g, "{\"a\": 01}");
    REJECT(g, "{\"a\": 1,}");
    REJECT(g, "{\"a\" 1}");
    REJECT(g, "{\"a\": \"\x01\"}");   /* raw control character */
    REJECT(g, "{\"a\": \"\xc0\xaf\"}"); /* overlong UTF-8 */
    REJECT(g, "{\"a\": \"\\q\"}");
    REJECT(g, "{\"a\": 1} ");         /* nothing after the document */
    /* bounded whitespace: a newline and up to 20 spaces, not 21; never two spaces */
    ACCEPT(g, "{\n                    \"a\": 1}");
    REJECT(g, "{\n                     \"a\": 1}");
    REJECT(g, "{  \"a\": 1}");
    /* bounded numbers: 16 integer digits, not 17 */
    ACCEPT(g, "{\"a\": 1234567890123456}");
    REJECT(g, "{\"a\": 12345678901234567}");
    grammar_unref(g);
}

static const char *PERSON =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":20},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2},"
    "\"kind\":{\"enum\":[\"cat\",\"dog\",7,null]},"
    "\"ok\":{\"anyOf\":[{\"type\":\"boolean\"},{\"type\":\"null\"}]}},"
    "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}";

static void test_schema_object_required_optional_order(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, PERSON);
    ACCEPT(g, "{\"name\":\"Bob\",\"age\":3}");
    ACCEPT(g, "{ \"name\": \"Bob\", \"age\": 30, \"tags\": [\"a\", \"b\"], \"kind\": 7, \"ok\": null }");
    ACCEPT(g, "{\"name\":\"B\",\"age\":0,\"ok\":false}");
    ACCEPT(g, "{\"name\":\"B\",\"age\":0,\"kind\":\"dog\"}");
    REJECT(g, "{\"name\":\"Bob\"}");                        /* age is required */
    REJECT(g, "{\"age\":3,\"name\":\"Bob\"}");              /* schema order */
    REJECT(g, "{\"name\":\"Bob\",\"age\":3,\"x\":1}");      /* no extra properties */
    REJECT(g, "{\"name\":\"Bob\",\"age\":-3}");             /* minimum 0 */
    REJECT(g, "{\"name\":\"Bob\",\"age\":3.5}");
    REJECT(g, "{\"name\":\"\",\"age\":3}");                 /* minLength 1 */
    REJECT(g, "{\"name\":\"123456789012345678901\",\"age\":3}"); /* maxLength 20 */
    REJECT(g, "{\"name\":\"Bob\",\"age\":3,\"tags\":[\"a\",\"b\",\"c\"]}");
    REJECT(g, "{\"name\":\"Bob\",\"age\":3,\"kind\":\"cow\"}");
    REJECT(g, "{\"name\":\"Bob\",,\"age\":3}");
    REJECT(g, "{\"name\":\"Bob\",\"age\":3,}");
    grammar_unref(g);
}

static void test_schema_refs_recursion_and_defs(void **state) {
    (void)state;
    const char *tree =
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
        "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\",\"kids\"]}},"
        "\"$ref\":\"#/$defs/node\"}";
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, tree);
    assert_true(grammar_n_rules(g) >= 2);   /* the recursive ref is a rule of its own */
    ACCEPT(g, "{\"v\":1,\"kids\":[]}");
    ACCEPT(g, "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3,\"kids\":[]}]},{\"v\":4,\"kids\":[]}]}");
    REJECT(g, "{\"v\":1,\"kids\":[{\"v\":2}]}");
    grammar_unref(g);
    /* pydantic's shape: definitions under $defs, Optional as anyOf with null */
    g = compile_ok(GRAMMAR_JSON_SCHEMA,
                   "{\"$defs\":{\"Pet\":{\"properties\":{\"name\":{\"title\":\"Name\",\"type\":\"string\"}},"
                   "\"required\":[\"name\"],\"title\":\"Pet\",\"type\":\"object\"}},"
                   "\"properties\":{\"pet\":{\"anyOf\":[{\"$ref\":\"#/$defs/Pet\"},{\"type\":\"null\"}],\"default\":null},"
                   "\"scores\":{\"additionalProperties\":{\"type\":\"number\"},\"type\":\"object\"},"
                   "\"pair\":{\"maxItems\":2,\"minItems\":2,\"prefixItems\":[{\"type\":\"integer\"},{\"type\":\"string\"}],\"type\":\"array\"}},"
                   "\"required\":[\"pair\"],\"title\":\"Owner\",\"type\":\"object\"}");
    ACCEPT(g, "{\"pet\":{\"name\":\"Rex\"},\"scores\":{\"a\":1.5,\"b\":-2},\"pair\":[1,\"x\"]}");
    ACCEPT(g, "{\"pet\":null,\"pair\":[1, \"x\"]}");
    REJECT(g, "{\"pair\":[1]}");
    REJECT(g, "{\"scores\":{\"a\":\"x\"},\"pair\":[1,\"x\"]}");
    grammar_unref(g);
}

static void test_schema_strings_pattern_format_const(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"^[a-z]{2,3}$\"}");
    ACCEPT(g, "\"ab\"");
    ACCEPT(g, "\"abc\"");
    REJECT(g, "\"abcd\"");
    REJECT(g, "\"a\"");
    grammar_unref(g);
    g = compile_ok(GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"a\\\"b\"}");   /* unanchored: a search */
    ACCEPT(g, "\"xxa\\\"byy\"");
    REJECT(g, "\"xxayy\"");
    grammar_unref(g);
    g = compile_ok(GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"date\"}");
    ACCEPT(g, "\"2024-02-29\"");
    REJECT(g, "\"2024-13-01\"");
    grammar_unref(g);
    g = compile_ok(GRAMMAR_JSON_SCHEMA, "{\"const\":{\"a\":[1,\"x\"]}}");
    ACCEPT(g, "{\"a\":[1,\"x\"]}");
    REJECT(g, "{\"a\":[1,\"y\"]}");
    grammar_unref(g);
    g = compile_ok(GRAMMAR_JSON_SCHEMA, "{\"type\":[\"integer\",\"null\"]}");
    ACCEPT(g, "-12");
    ACCEPT(g, "null");
    REJECT(g, "1.5");
    grammar_unref(g);
}

static void test_regex_language(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_REGEX, "^(cat|dog)s?\\d{2}$");
    ACCEPT(g, "cats12");
    ACCEPT(g, "dog01");
    REJECT(g, "cat1");
    REJECT(g, "cow12");
    REJECT(g, "cats123");
    grammar_unref(g);
    g = compile_ok(GRAMMAR_REGEX, "[\xce\xb1-\xcf\x89]+ [^a-z\\s]\\w*\\.?");   /* Greek letters, a negated class */
    ACCEPT(g, "\xce\xb1\xce\xb2\xce\xb3 X_1.");
    ACCEPT(g, "\xcf\x89 \xe2\x82\xac");
    REJECT(g, "abc X");
    REJECT(g, "\xce\xb1 x");
    REJECT(g, "\xce\xb1  ");
    grammar_unref(g);
    g = compile_ok(GRAMMAR_REGEX, "(?:a|b){2,3}c*.");
    ACCEPT(g, "abz");
    ACCEPT(g, "abacccz");
    REJECT(g, "az");
    REJECT(g, "ab\n");   /* . is not a newline */
    grammar_unref(g);
}

static void test_choice_and_gbnf(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_CHOICE, "[\"yes\", \"no\", \"yes!\"]");
    ACCEPT(g, "yes");
    ACCEPT(g, "yes!");
    ACCEPT(g, "no");
    REJECT(g, "ye");
    assert_true(prefix_ok(g, "ye"));
    assert_false(prefix_ok(g, "n!"));
    grammar_unref(g);
    g = compile_ok(GRAMMAR_GBNF,
                   "# arithmetic\nroot ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\n"
                   "term ::= [0-9]+ | \"(\" expr \")\"\n");
    ACCEPT(g, "1+2");
    ACCEPT(g, "(1+(22-3))-4");
    REJECT(g, "1+");
    REJECT(g, "(1+2");
    grammar_unref(g);
}

/* The same spec compiles once and is shared; another spec is another grammar. */
static void test_compile_cache_shares_grammars(void **state) {
    (void)state;
    grammar *a = compile_ok(GRAMMAR_REGEX, "cache-[0-9]+");
    grammar *b = compile_ok(GRAMMAR_REGEX, "cache-[0-9]+");
    grammar *c = compile_ok(GRAMMAR_CHOICE, "[\"cache-[0-9]+\"]");
    grammar *d = compile_ok(GRAMMAR_REGEX, "cache-[0-9]*");
    assert_ptr_equal(a, b);
    assert_ptr_not_equal(a, c);   /* same text, another kind */
    assert_ptr_not_equal(a, d);
    grammar_unref(a);
    assert_true(full_match(b, "cache-12"));   /* b's own reference still holds it */
    grammar_unref(b);
    grammar_unref(c);
    grammar_unref(d);
}

/* The matcher reports completion: eos only when accepting; done when nothing can follow. */
static void test_matcher_done_and_eos(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_CHOICE, "[\"ab\", \"abc\"]");
    matcher *m = matcher_new(g, NULL);
    assert_int_equal(matcher_accept_bytes(m, "ab", 2), 0);
    assert_true(matcher_accepting(m));
    assert_false(matcher_done(m));          /* "c" may still follow */
    assert_int_equal(matcher_accept_bytes(m, "x", 1), SPECD_EINVAL);
    assert_int_equal(matcher_accept_bytes(m, "c", 1), 0);
    assert_true(matcher_done(m));
    matcher_free(m);
    grammar_unref(g);
}

/* Going back to a saved state (speculative drafts tried ahead of the output): the state
 * after restore accepts, refuses and completes exactly as it did when saved, also after
 * the tried bytes made the matcher push frames (nested objects) and finish. */
static void test_matcher_save_restore(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA,
                            "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"object\",\"properties\":"
                            "{\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}},\"required\":[\"a\"]}");
    matcher *m = matcher_new(g, NULL);
    matcher_saved *sv = matcher_saved_new();
    assert_non_null(sv);
    assert_int_equal(matcher_accept_bytes(m, "{\"a\":", 5), 0);
    const int dist = matcher_distance(m);
    matcher_save(m, sv);
    assert_int_equal(matcher_accept_bytes(m, " {\"b\": 12}}", 11), 0);
    assert_true(matcher_accepting(m));
    matcher_restore(m, sv);
    assert_false(matcher_accepting(m));
    assert_int_equal(matcher_distance(m), dist);
    assert_int_equal(matcher_check_bytes(m, "}", 1), 0);           /* "a" still needs its value */
    assert_int_equal(matcher_check_bytes(m, "{\"b\":7}}", 8), 1);
    assert_int_equal(matcher_accept_bytes(m, "{\"b\":7}}", 8), 0);  /* a different value this time */
    assert_true(matcher_accepting(m));
    matcher_free(m);
    matcher_saved_free(sv);
    grammar_unref(g);
}

/* ---- masks on real vocabularies ---- */

typedef struct {
    tok_tokenizer *tok;
    vocab_trie *vt;
    int n_vocab;
    int32_t eos;
    uint32_t *mask;
} vocab_fx;

static void vocab_load(vocab_fx *f, const char *rel) {
    char err[512] = "";
    f->tok = tok_load(fixture_path(rel), err, sizeof err);
    if (!f->tok) print_error("tok_load(%s): %s\n", rel, err);
    assert_non_null(f->tok);
    f->n_vocab = tok_vocab_size(f->tok);
    f->eos = tok_eos_id(f->tok);
    assert_true(f->eos >= 0);
    f->vt = vocab_trie_build(f->tok, f->n_vocab, &f->eos, 1, err, sizeof err);
    assert_non_null(f->vt);
    f->mask = malloc(vocab_mask_words(f->n_vocab) * sizeof *f->mask);
    assert_non_null(f->mask);
}

static void vocab_free(vocab_fx *f) {
    free(f->mask);
    vocab_trie_free(f->vt);
    tok_free(f->tok);
}

static int bit(const uint32_t *mask, int id) { return (mask[id >> 5] >> (id & 31)) & 1; }

static int token_with_bytes(vocab_fx *f, const char *s) {
    for (int id = 0; id < f->n_vocab; id++) {
        const char *p;
        size_t len;
        if (!tok_is_special(f->tok, id) && !tok_token_bytes(f->tok, id, &p, &len) && len == strlen(s) && !memcmp(p, s, len))
            return id;
    }
    return -1;
}

/* The mask against every token checked alone. Returns the number of allowed tokens. */
static int check_mask_brute(vocab_fx *f, matcher *m) {
    int n = matcher_fill_mask(m, f->mask), count = 0;
    for (int id = 0; id < f->n_vocab; id++) {
        int want;
        const char *p;
        size_t len;
        if (id == f->eos) want = matcher_accepting(m);
        else if (tok_is_special(f->tok, id) || tok_token_bytes(f->tok, id, &p, &len) || !len) want = 0;
        else want = matcher_check_bytes(m, p, len);
        if (bit(f->mask, id) != want)
            print_error("token %d: mask %d, brute force %d\n", id, bit(f->mask, id), want);
        assert_int_equal(bit(f->mask, id), want);
        count += want && id != f->eos;
    }
    assert_int_equal(n, count);
    return count;
}

/* Feed doc's real tokenization; at every step the mask must equal brute force and allow
 * the next token; at the end only eos may follow when the grammar cannot continue. */
static void walk_document(vocab_fx *f, grammar *g, const char *doc, int expect_done) {
    int32_t *ids;
    char err[256];
    int n = tok_encode(f->tok, doc, strlen(doc), 0, &ids, err, sizeof err);
    assert_true(n > 0);
    matcher *m = matcher_new(g, f->vt);
    assert_non_null(m);
    for (int i = 0; i < n; i++) {
        int allowed = check_mask_brute(f, m);
        assert_true(allowed > 0);
        if (!bit(f->mask, ids[i])) print_error("step %d: token %d of the document is masked\n", i, ids[i]);
        assert_true(bit(f->mask, ids[i]));
        assert_int_equal(matcher_accept_token(m, ids[i]), 0);
    }
    int allowed = check_mask_brute(f, m);
    assert_true(bit(f->mask, f->eos));
    if (expect_done) {
        assert_int_equal(allowed, 0);
        assert_true(matcher_done(m));
    }
    assert_int_equal(matcher_accept_token(m, f->eos), 0);
    assert_true(matcher_done(m));
    matcher_free(m);
    free(ids);
}

static void mask_suite(const char *rel) {
    vocab_fx f;
    vocab_load(&f, rel);
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, PERSON);
    walk_document(&f, g, "{\"name\": \"Zo\xc3\xab \\\"Z\\\" \xe2\x82\xac\", \"age\": 42, \"tags\": [\"x\"], \"kind\": \"dog\"}", 0);
    walk_document(&f, g, "{\n  \"name\": \"A\",\n  \"age\": 7,\n  \"ok\": true\n}", 1);
    grammar_unref(g);
    g = compile_ok(GRAMMAR_JSON, NULL);
    walk_document(&f, g, "{\"a\": [1, {\"b\": null}], \"text\": \"The quick brown fox\"}", 1);
    grammar_unref(g);
    g = compile_ok(GRAMMAR_REGEX, "[A-Z][a-z]+ [0-9]{3}");
    walk_document(&f, g, "Hello 123", 1);
    grammar_unref(g);
    /* counted repetition: the cache keys merge positions far from the end (mask classes),
     * the last ones must stay apart (a token longer than what is left does not fit) */
    g = compile_ok(GRAMMAR_REGEX, "[a-z ,.]{70}");
    walk_document(&f, g, "the quick brown fox jumps over the lazy dog, then sleeps. all is well.", 1);
    grammar_unref(g);
    vocab_free(&f);
}

/* Mask classes: [a-z ]{300} has a state per position; for tokens of up to 16 bytes the
 * positions with more than 16 bytes left read alike (one class: the refinement also keeps
 * apart where the rule may end after 16 bytes, one round more than a mask needs), the
 * last 17 differ from them and from each other. */
static void test_mask_classes_merge_far_positions(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_REGEX, "[a-z ]{300}");
    grammar_mask_classes *mc = grammar_mask_classes_make(g, 16);
    assert_non_null(mc);
    int n = grammar_n_states(g), distinct = 0;
    int32_t *seen = calloc((size_t)n + 1, sizeof *seen);
    for (int s = 0; s < n; s++) {
        assert_true(mc->cls[s] >= 0 && mc->cls[s] < n);
        if (!seen[mc->cls[s]]++) distinct++;
    }
    assert_int_equal(n, 301);
    assert_int_equal(distinct, 18);   /* 0 .. 16 bytes left, and the rest */
    assert_int_equal(mc->cls[g->root], mc->cls[g->trans[(size_t)g->root * g->n_cls + g->cls['a']]]);
    free(seen);
    free(mc);
    grammar_unref(g);
    /* with a longer token bound, fewer merge */
    g = compile_ok(GRAMMAR_REGEX, "[a-z ]{300}");
    mc = grammar_mask_classes_make(g, 64);
    int same = 0;
    int32_t s = g->root;
    for (int k = 0; k < 300 && s >= 0; k++, s = g->trans[(size_t)s * g->n_cls + g->cls['a']]) same += mc->cls[s] == mc->cls[g->root];
    assert_int_equal(same, 300 - 64);   /* positions 0 .. 235 */
    free(mc);
    /* prepared once for the longest token; a shorter bound is served by them, a longer
     * one is not (a matcher would make its own) */
    assert_null(atomic_load(&g->mclasses));
    assert_int_equal(grammar_prepare_masks(g, 64), 0);
    const grammar_mask_classes *held = atomic_load(&g->mclasses);
    assert_non_null(held);
    assert_int_equal(held->L, 64);
    assert_int_equal(grammar_prepare_masks(g, 16), 0);
    assert_int_equal(grammar_prepare_masks(g, 128), 0);
    assert_ptr_equal(atomic_load(&g->mclasses), held);
    grammar_unref(g);
}

/* Masks shared by a grammar's matchers: the second request at a state copies the first's
 * mask (one entry, the same bits); a matcher over another vocabulary takes the cache over
 * and its masks are its own vocabulary's (brute force). */
static void test_shared_masks_across_matchers_and_vocabularies(void **state) {
    (void)state;
    vocab_fx f, h;
    vocab_load(&f, "tokenizers/hf/qwen3/tokenizer.json");
    grammar *g = compile_ok(GRAMMAR_REGEX, "(cat|dog)s are [a-z]{3,9}\\.");
    assert_int_equal(grammar_prepare_masks(g, 1024), 0);   /* classes both vocabularies use */
    matcher *a = matcher_new(g, f.vt), *b = matcher_new(g, f.vt);
    int na = check_mask_brute(&f, a);
    assert_int_equal(g->shared.n, 1);
    size_t words = vocab_mask_words(f.n_vocab);
    uint32_t *first = malloc(words * sizeof *first);
    memcpy(first, f.mask, words * sizeof *first);
    assert_int_equal(check_mask_brute(&f, b), na);
    assert_int_equal(g->shared.n, 1);
    assert_memory_equal(first, f.mask, words * sizeof *first);
    vocab_load(&h, "tokenizers/hf/llama3_1/tokenizer.json");
    matcher *c = matcher_new(g, h.vt);
    check_mask_brute(&h, c);
    assert_int_equal(g->shared.n, 1);
    assert_int_equal(matcher_accept_token(a, token_with_bytes(&f, "cat")), 0);
    check_mask_brute(&f, a);   /* back to the first vocabulary: its own masks again */
    matcher_free(a);
    matcher_free(b);
    matcher_free(c);
    free(first);
    grammar_unref(g);
    vocab_free(&h);
    vocab_free(&f);
}

/* Matchers on 4 threads walking the same document at once: each mask equals one computed
 * without any cache (a matcher that finds the shared entry pending waits for it). */
typedef struct {
    grammar *g;
    const vocab_fx *f;
    const int32_t *ids;
    int n;
    uint32_t *masks;   /* (n + 1) x words, out */
} walk_job;

static void *walk_thread(void *arg) {
    walk_job *j = arg;
    size_t words = vocab_mask_words(j->f->n_vocab);
    matcher *m = matcher_new(j->g, j->f->vt);
    for (int i = 0; i <= j->n; i++) {
        matcher_fill_mask(m, j->masks + (size_t)i * words);
        if (i < j->n && matcher_accept_token(m, j->ids[i])) break;
    }
    matcher_free(m);
    return NULL;
}

static void test_shared_masks_on_threads_equal_uncached(void **state) {
    (void)state;
    vocab_fx f;
    vocab_load(&f, "tokenizers/hf/qwen3/tokenizer.json");
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, PERSON);
    assert_int_equal(grammar_prepare_masks(g, 1024), 0);
    const char *doc = "{\"name\": \"Ada Lovelace\", \"age\": 36, \"tags\": [\"math\"], \"kind\": \"cat\"}";
    int32_t *ids;
    char err[256];
    int n = tok_encode(f.tok, doc, strlen(doc), 0, &ids, err, sizeof err);
    assert_true(n > 0);
    size_t words = vocab_mask_words(f.n_vocab);
    uint32_t *want = malloc((size_t)(n + 1) * words * sizeof *want);
    matcher *ref = matcher_new(g, f.vt);
    matcher_set_cache(ref, 0);
    for (int i = 0; i <= n; i++) {
        matcher_fill_mask(ref, want + (size_t)i * words);
        if (i < n) assert_int_equal(matcher_accept_token(ref, ids[i]), 0);
    }
    matcher_free(ref);
    pthread_t th[4];
    walk_job jobs[4];
    for (int t = 0; t < 4; t++) {
        jobs[t] = (walk_job){g, &f, ids, n, malloc((size_t)(n + 1) * words * sizeof(uint32_t))};
        assert_int_equal(pthread_create(&th[t], NULL, walk_thread, &jobs[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        assert_memory_equal(jobs[t].masks, want, (size_t)(n + 1) * words * sizeof *want);
        free(jobs[t].masks);
    }
    assert_true(g->shared.n > 0);
    for (int i = 0; i < g->shared.n; i++) assert_int_equal(g->shared.e[i].pending, 0);
    free(want);
    free(ids);
    grammar_unref(g);
    vocab_free(&f);
}

static void test_mask_equals_brute_force_qwen3(void **state) {
    (void)state;
    mask_suite("tokenizers/hf/qwen3/tokenizer.json");
}

static void test_mask_equals_brute_force_llama3(void **state) {
    (void)state;
    mask_suite("tokenizers/hf/llama3_1/tokenizer.json");
}

/* The shortest way to the end: the smallest valid document from the start, the closing
 * bytes inside one; the budget mask keeps only tokens that leave a short enough way. */
static void test_distance_and_budget_mask(void **state) {
    (void)state;
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, PERSON);
    matcher *m = matcher_new(g, NULL);
    assert_int_equal(matcher_distance(m), (int)strlen("{\"name\":\"x\",\"age\":0}"));
    matcher_free(m);
    grammar_unref(g);
    vocab_fx f;
    vocab_load(&f, "tokenizers/hf/qwen3/tokenizer.json");
    g = compile_ok(GRAMMAR_JSON, NULL);
    m = matcher_new(g, f.vt);
    const char *pre = "{\"a\": [1, {\"b\": \"xx";
    assert_int_equal(matcher_accept_bytes(m, pre, strlen(pre)), 0);
    assert_int_equal(matcher_distance(m), 4);   /* "}]} */
    int n = matcher_fill_mask_within(m, f.mask, 3);
    assert_true(n > 0);
    static const struct { const char *tok; int allowed; } cases[] = {
        {"\"", 1}, {"\"}", 1}, {"x", 0}, {"\",", 0}, {"ab", 0}, {" ", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int id = token_with_bytes(&f, cases[i].tok);
        assert_true(id >= 0);
        if (bit(f.mask, id) != cases[i].allowed) print_error("token '%s'\n", cases[i].tok);
        assert_int_equal(bit(f.mask, id), cases[i].allowed);
    }
    /* at every budget, kept tokens are exactly the valid ones that leave at most that
     * many bytes to go (brute force over the vocabulary) */
    for (int limit = 3; limit <= 8; limit++) {
        int kept = matcher_fill_mask_within(m, f.mask, limit);
        int want_count = 0;
        for (int id = 0; id < f.n_vocab; id++) {
            const char *p;
            size_t len;
            if (id == f.eos || tok_is_special(f.tok, id) || tok_token_bytes(f.tok, id, &p, &len) || !len) continue;
            int d = matcher_distance_after(m, p, len);
            int want = d >= 0 && d <= limit;
            if (bit(f.mask, id) != want) print_error("limit %d token %d: mask %d, distance after %d\n", limit, id, bit(f.mask, id), d);
            assert_int_equal(bit(f.mask, id), want);
            want_count += want;
        }
        assert_int_equal(kept, want_count);
    }
    n = matcher_fill_mask_within(m, f.mask, 3);
    assert_true(matcher_fill_mask(m, f.mask) > n);   /* without the budget: many more */
    matcher_free(m);
    grammar_unref(g);
    vocab_free(&f);
}

/* Special tokens are never allowed, even where their text would fit the grammar. */
static void test_special_tokens_never_allowed(void **state) {
    (void)state;
    vocab_fx f;
    vocab_load(&f, "tokenizers/hf/qwen3/tokenizer.json");
    grammar *g = compile_ok(GRAMMAR_REGEX, "[<>|a-z_]*");
    matcher *m = matcher_new(g, f.vt);
    int32_t special = tok_token_id(f.tok, "<|im_start|>", 12);
    assert_true(special >= 0 && tok_is_special(f.tok, special));
    matcher_fill_mask(m, f.mask);
    assert_false(bit(f.mask, special));
    assert_true(bit(f.mask, f.eos));   /* the empty string is a sentence: eos allowed */
    matcher_free(m);
    grammar_unref(g);
    vocab_free(&f);
}

/* The engine's constrained path (masks computed per step while the pass runs, sampled
 * where the logits are: prefill steps in the forward pass, decode steps in the runner's
 * decode op, which is the captured graph on CUDA): 6 seeded requests at temperature 1
 * under a schema on SmolLM2 give schema-valid JSON, and the same tokens whether the masks
 * are computed on the engine thread or on 4 threads (so the threaded mask path runs here
 * even on a 2-core machine); their decode steps took the decode op, not composed steps. */
#define SMOL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* Queue request id: text in the engine's tokenizer, sampled as sp says; record keeps its
 * first-token logits (engine_add_ex), which keeps its sampling on the host. */
static void add_text_request_rec(engine *e, uint64_t id, const char *text, const engine_sampling *sp, int record) {
    char err[512], terr[256];
    int32_t *ids = NULL;
    int n = tok_encode(engine_tokenizer(e), text, strlen(text), 1, &ids, terr, sizeof terr);
    assert_true(n > 0);
    assert_int_equal(engine_add_ex(e, id, ids, n, sp, record, err, sizeof err), 0);
    free(ids);
}

static void add_text_request(engine *e, uint64_t id, const char *text, const engine_sampling *sp) {
    add_text_request_rec(e, id, text, sp, 0);
}

/* Step until done, collecting each request's tokens (at most cap) into out[id]; every
 * request must end with stop. With drafted / accepted, their speculation counts are summed. */
static void drain(engine *e, int32_t *out, int cap, int *nout, long *drafted, long *accepted) {
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            int r = (int)ev->req_id;
            for (int t = 0; t < ev->n_tokens && nout[r] < cap; t++) out[(size_t)r * cap + nout[r]++] = ev->tokens[t].id;
            if (ev->finish == ENGINE_RUNNING) continue;
            assert_int_equal(ev->finish, ENGINE_FINISH_STOP);
            if (drafted) *drafted += ev->spec_draft_tokens;
            if (accepted) *accepted += ev->spec_accepted_tokens;
        }
    }
}
static void run_constrained_ex(int threads, int sync, int32_t out[6][96], int nout[6], engine_stats *stp) {
    char err[512] = "";
    engine_config c = {.model_path = SMOL, .max_seq_len = 256, .max_batch = 8, .kv_bytes = 64u << 20, .threads = 2,
                       .grammar_threads = threads, .sync_scheduling = sync};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("%s", err);
    static const char schema[] = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":12},"
                                 "\"age\":{\"type\":\"integer\"}},\"required\":[\"name\",\"age\"],"
                                 "\"additionalProperties\":false}";
    grammar *g = grammar_compile(GRAMMAR_JSON_SCHEMA, schema, strlen(schema), err, sizeof err);
    if (!g) fail_msg("%s", err);
    const tok_tokenizer *tok = engine_tokenizer(e);
    assert_non_null(tok);
    for (int i = 0; i < 6; i++) {
        char text[128];
        snprintf(text, sizeof text, "Person %d as JSON:", i);
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = 1.0f;
        sp.seed = 1000 + (uint64_t)i;
        sp.has_seed = 1;
        sp.max_tokens = stp && i % 2 ? 14 + i : 96;   /* (the async test: some closed early by the budget) */
        sp.grammar = g;
        add_text_request(e, (uint64_t)i, text, &sp);
        nout[i] = 0;
    }
    drain(e, &out[0][0], 96, nout, NULL, NULL);
    engine_stats st;
    engine_get_stats(e, &st);
    if (stp) *stp = st;
    assert_true(st.steps_device_decode > 10);   /* one step composes the 6 prefills */
    assert_true(st.steps_composed <= 2);
    for (int i = 0; i < 6; i++) {
        char *txt = NULL;
        size_t len = 0;
        assert_int_equal(tok_decode(tok, out[i], (size_t)nout[i], 1, &txt, &len), 0);
        json_error_t je;
        json_t *j = json_loadb(txt, len, 0, &je);
        if (!j) fail_msg("request %d: not JSON: %s", i, txt);
        assert_true(json_is_string(json_object_get(j, "name")));
        assert_true(json_is_integer(json_object_get(j, "age")));
        assert_int_equal(json_object_size(j), 2);
        json_decref(j);
        free(txt);
    }
    grammar_unref(g);
    engine_destroy(e);
}

static void run_constrained(int threads, int32_t out[6][96], int nout[6]) {
    run_constrained_ex(threads, 1, out, nout, NULL);
}

static void test_engine_constrained_rows_valid_and_thread_independent(void **state) {
    (void)state;
    if (access(SMOL, R_OK) != 0) fail_msg("%s absent: run scripts/fetch-model.sh", SMOL);
    static int32_t a[6][96], b[6][96];
    int na[6], nb[6];
    run_constrained(1, a, na);
    run_constrained(4, b, nb);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(na[i], nb[i]);
        assert_memory_equal(a[i], b[i], sizeof(int32_t) * (size_t)na[i]);
    }
}

/* Async scheduling with constrained rows: a step is queued behind the one in flight, and
 * its rows' masks are computed once that step's tokens are in, each row's matcher taking
 * its token ahead of the commit. The same requests (some steered shut by a small
 * max_tokens, all ending when their document completes, so a row is dropped a step late)
 * give the tokens they give one step at a time, and the async run queued steps with
 * constrained rows. */
static void test_engine_constrained_rows_async_equals_sync(void **state) {
    (void)state;
    if (access(SMOL, R_OK) != 0) fail_msg("%s absent: run scripts/fetch-model.sh", SMOL);
    static int32_t a[6][96], b[6][96];
    int na[6], nb[6];
    engine_stats sa, sb;
    run_constrained_ex(2, 0, a, na, &sa);
    run_constrained_ex(2, 1, b, nb, &sb);
    print_message("  6 constrained requests: %llu of %llu decode-op steps queued in flight (one at a time: %llu)\n",
                  (unsigned long long)sa.steps_async, (unsigned long long)sa.steps_device_decode,
                  (unsigned long long)sb.steps_async);
    assert_int_equal(sb.steps_async, 0);
    assert_true(sa.steps_async > 10);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(na[i], nb[i]);
        assert_memory_equal(a[i], b[i], sizeof(int32_t) * (size_t)na[i]);
    }
}

/* Constrained rows that want logprobs sample in the runner where it reports them of the
 * logits before the mask (runner.masked_raw_logprobs: the CPU runner), as the host path
 * does: 4 requests under the schema, greedy and seeded, with 3 top logprobs each, give the
 * tokens, logprobs and top logprobs of the same requests kept on the host (recorded
 * first-token logits), bit for bit; the runner run took the decode op, the host run never
 * did. The logprobs are of the model's own distribution: some chosen tokens are not the
 * unconstrained top one. */
typedef struct {
    int32_t id[64];
    float lp[64], top_lp[64][3];
    int32_t top[64][3];
    int n;
} lp_run;

static void run_constrained_logprobs(int host, lp_run out[4], engine_stats *st) {
    char err[512] = "";
    engine_config c = {.model_path = SMOL, .max_seq_len = 256, .max_batch = 8, .kv_bytes = 64u << 20, .threads = 2};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("%s", err);
    static const char schema[] = "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":10},"
                                 "\"n\":{\"type\":\"integer\"}},\"required\":[\"city\",\"n\"],"
                                 "\"additionalProperties\":false}";
    grammar *g = compile_ok(GRAMMAR_JSON_SCHEMA, schema);
    for (int i = 0; i < 4; i++) {
        char text[128];
        snprintf(text, sizeof text, "Answer %d in JSON:", i);
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = i % 2 ? 0.8f : 0.f;
        sp.seed = 77 + (uint64_t)i;
        sp.has_seed = 1;
        sp.max_tokens = 64;
        sp.logprobs = 3;
        sp.grammar = g;
        add_text_request_rec(e, (uint64_t)i, text, &sp, host);
        out[i].n = 0;
    }
    while (engine_has_work(e)) {
        engine_output o;
        assert_int_equal(engine_step(e, &o), 0);
        for (int k = 0; k < o.n_events; k++) {
            const engine_event *ev = &o.events[k];
            lp_run *r = &out[ev->req_id];
            for (int t = 0; t < ev->n_tokens && r->n < 64; t++, r->n++) {
                const engine_token *tk = &ev->tokens[t];
                r->id[r->n] = tk->id;
                r->lp[r->n] = tk->logprob;
                assert_int_equal(tk->n_top, 3);
                for (int j = 0; j < 3; j++) r->top[r->n][j] = tk->top_ids[j], r->top_lp[r->n][j] = tk->top_logprobs[j];
            }
        }
    }
    engine_get_stats(e, st);
    grammar_unref(g);
    engine_destroy(e);
}

static void test_engine_constrained_rows_logprobs_in_the_runner(void **state) {
    (void)state;
    if (access(SMOL, R_OK) != 0) fail_msg("%s absent: run scripts/fetch-model.sh", SMOL);
    static lp_run a[4], b[4];
    engine_stats sa, sb;
    run_constrained_logprobs(0, a, &sa);
    run_constrained_logprobs(1, b, &sb);
    assert_true(sa.steps_device_decode > 10);
    assert_int_equal(sb.steps_device_decode, 0);
    int below_top = 0;
    for (int i = 0; i < 4; i++) {
        assert_true(a[i].n > 3);
        assert_int_equal(a[i].n, b[i].n);
        assert_memory_equal(a[i].id, b[i].id, sizeof(int32_t) * (size_t)a[i].n);
        assert_memory_equal(a[i].lp, b[i].lp, sizeof(float) * (size_t)a[i].n);
        assert_memory_equal(a[i].top, b[i].top, sizeof(int32_t) * 3 * (size_t)a[i].n);
        assert_memory_equal(a[i].top_lp, b[i].top_lp, sizeof(float) * 3 * (size_t)a[i].n);
        for (int t = 0; t < a[i].n; t++) below_top += a[i].id[t] != a[i].top[t][0];
    }
    print_message("  4 constrained requests with logprobs: %llu decode-op steps; %d tokens the mask kept off the "
                  "model's top choice\n", (unsigned long long)sa.steps_device_decode, below_top);
    assert_true(below_top > 0);
}

/* Prompt lookup on constrained rows: drafts are cut where the grammar refuses them and
 * each verified position is masked with the grammar's state after the drafts before it.
 * Greedy on SmolLM2, three requests asked to copy a line under a regex that allows only
 * the three lines: the tokens equal those of the same engine without speculation, the text
 * matches the regex, and drafts were proposed and accepted (the copy is in the prompt).
 * With max_batch 16 the verified positions (3 rows x 4) are masked and sampled in the
 * runner's forward pass (their masks computed in parallel while it runs); with 4 they
 * mostly exceed the mask rows of a step and are masked and accepted on the host. */
static void run_copy(int ngram, int max_batch, int32_t out[3][64], int nout[3], long *drafted, long *accepted,
                     engine_stats *st) {
    char err[512] = "";
    engine_config c = {.model_path = SMOL, .max_seq_len = 256, .max_batch = max_batch, .kv_bytes = 64u << 20,
                       .threads = 2, .grammar_threads = 2, .spec_ngram = ngram, .spec_always = 1,
                       .num_draft_tokens = 3};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("%s", err);
    static const char *lines[3] = {"the cat sat on the mat and the dog sat on the log",
                                   "a small boat drifts along the quiet river at dawn",
                                   "seven green apples fell from the old tree in the yard"};
    /* one of the lines: which tokens may come next changes at every position */
    char re[512];
    snprintf(re, sizeof re, " (%s|%s|%s)\\.", lines[0], lines[1], lines[2]);
    grammar *g = compile_ok(GRAMMAR_REGEX, re);
    const tok_tokenizer *tok = engine_tokenizer(e);
    *drafted = *accepted = 0;
    for (int i = 0; i < 3; i++) {
        char text[512];
        snprintf(text, sizeof text, "Copy each line exactly.\nLine: %s.\nCopy: %s.\nLine: %s.\nCopy:", lines[(i + 1) % 3],
                 lines[(i + 1) % 3], lines[i]);
        engine_sampling sp;
        engine_sampling_defaults(&sp);
        sp.temperature = 0;
        sp.max_tokens = 64;
        sp.grammar = g;
        add_text_request(e, (uint64_t)i, text, &sp);
        nout[i] = 0;
    }
    drain(e, &out[0][0], 64, nout, drafted, accepted);
    for (int i = 0; i < 3; i++) {
        char *txt = NULL;
        size_t len = 0;
        assert_int_equal(tok_decode(tok, out[i], (size_t)nout[i], 1, &txt, &len), 0);
        if (!full_match(g, txt)) fail_msg("request %d: %s does not match the regex", i, txt);
        free(txt);
    }
    engine_get_stats(e, st);
    grammar_unref(g);
    engine_destroy(e);
}

static void test_engine_prompt_lookup_on_constrained_rows(void **state) {
    (void)state;
    if (access(SMOL, R_OK) != 0) fail_msg("%s absent: run scripts/fetch-model.sh", SMOL);
    static int32_t a[3][64], b[3][64];
    int na[3], nb[3];
    long d0, a0, d1, a1;
    engine_stats st;
    run_copy(0, 16, a, na, &d0, &a0, &st);
    assert_int_equal(d0, 0);
    for (int mb = 4; mb <= 16; mb += 12) {
        run_copy(1, mb, b, nb, &d1, &a1, &st);
        print_message("  prompt lookup under a regex, max_batch %d: %ld of %ld drafts accepted, %llu of %llu verified "
                      "rows sampled in the runner\n", mb, a1, d1, (unsigned long long)st.spec_rows_runner_sampled,
                      (unsigned long long)st.spec_drafts);
        for (int i = 0; i < 3; i++) {
            assert_int_equal(na[i], nb[i]);
            assert_memory_equal(a[i], b[i], sizeof(int32_t) * (size_t)na[i]);
        }
        assert_true(a1 >= 10 && a1 <= d1);
        /* (with 4, a step where one row verifies fits the mask rows) */
        if (mb == 4) assert_true(st.spec_rows_runner_sampled < st.spec_drafts);
        else assert_true(st.spec_rows_runner_sampled == st.spec_drafts);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_constrained_rows_valid_and_thread_independent),
        cmocka_unit_test(test_engine_constrained_rows_async_equals_sync),
        cmocka_unit_test(test_engine_constrained_rows_logprobs_in_the_runner),
        cmocka_unit_test(test_engine_prompt_lookup_on_constrained_rows),
        cmocka_unit_test(test_schema_errors_name_keyword_and_path),
        cmocka_unit_test(test_regex_choice_gbnf_errors),
        cmocka_unit_test(test_json_object_accepts_json_rejects_other),
        cmocka_unit_test(test_schema_object_required_optional_order),
        cmocka_unit_test(test_schema_refs_recursion_and_defs),
        cmocka_unit_test(test_schema_strings_pattern_format_const),
        cmocka_unit_test(test_regex_language),
        cmocka_unit_test(test_choice_and_gbnf),
        cmocka_unit_test(test_matcher_done_and_eos),
        cmocka_unit_test(test_matcher_save_restore),
        cmocka_unit_test(test_compile_cache_shares_grammars),
        cmocka_unit_test(test_mask_equals_brute_force_qwen3),
        cmocka_unit_test(test_mask_equals_brute_force_llama3),
        cmocka_unit_test(test_special_tokens_never_allowed),
        cmocka_unit_test(test_distance_and_budget_mask),
        cmocka_unit_test(test_mask_classes_merge_far_positions),
        cmocka_unit_test(test_shared_masks_across_matchers_and_vocabularies),
        cmocka_unit_test(test_shared_masks_on_threads_equal_uncached),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
