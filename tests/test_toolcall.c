/* Unit tests of the output parsers: tool calls (server/toolcall.c) and reasoning sections
 * (server/reasoning.c), on outputs written the way each family's models write them.
 *
 * Every case is run three ways: the whole text in one final feed (what a non-streamed
 * response does), one byte per feed, and cut in two at every byte. The streamed runs
 * rebuild the message from the deltas (content concatenated, calls by index: id and name
 * from the first delta, arguments concatenated) and must equal the one-shot result, which
 * must equal the expected content and calls. Call ids come from a fixed seed, so they are
 * compared too. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/grammar.h"
#include "server/reasoning.h"
#include "server/toolcall.h"
#include "tests/fixtures.h"

typedef struct {
    char *content;
    size_t clen;
    json_t *calls;   /* [{"id", "type", "function": {"name", "arguments"}}] */
} tc_result;

static void result_free(tc_result *r) {
    free(r->content);
    json_decref(r->calls);
}

static void append(char **s, size_t *len, const char *add, size_t n) {
    *s = realloc(*s, *len + n + 1);
    memcpy(*s + *len, add, n);
    *len += n;
    (*s)[*len] = 0;
}

static tc_config config(tc_format f, json_t *tools, int max_calls) {
    tc_config c = {.format = f, .max_calls = max_calls, .tools = tools, .id_seed = 42};
    return c;
}

/* Apply one feed's deltas to a rebuilt tool_calls array. */
static void apply_deltas(json_t *calls, json_t *deltas) {
    size_t i;
    json_t *d;
    json_array_foreach(deltas, i, d) {
        size_t idx = (size_t)json_integer_value(json_object_get(d, "index"));
        json_t *fn = json_object_get(d, "function");
        const char *frag = json_string_value(json_object_get(fn, "arguments"));
        assert_non_null(frag);
        if (idx == json_array_size(calls)) {   /* a new call: its first delta names it */
            assert_non_null(json_object_get(d, "id"));
            assert_string_equal(json_string_value(json_object_get(d, "type")), "function");
            assert_non_null(json_object_get(fn, "name"));
            json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:s}}", "id", json_object_get(d, "id"),
                                                   "type", "function", "function", "name",
                                                   json_object_get(fn, "name"), "arguments", frag));
            continue;
        }
        assert_true(idx < json_array_size(calls));
        assert_null(json_object_get(d, "id"));
        assert_null(json_object_get(fn, "name"));
        json_t *f = json_object_get(json_array_get(calls, idx), "function");
        char *args = NULL;
        size_t alen = 0;
        const char *old = json_string_value(json_object_get(f, "arguments"));
        append(&args, &alen, old, strlen(old));
        append(&args, &alen, frag, strlen(frag));
        json_object_set_new(f, "arguments", json_string(args));
        free(args);
    }
}

/* Feed text cut at the given offsets (ascending; none = one feed), then a final empty feed. */
static tc_result run_cuts(const tc_config *cfg, const char *text, const size_t *cuts, int n_cuts) {
    tc_parser *p = tc_parser_new(cfg);
    assert_non_null(p);
    tc_result r = {NULL, 0, json_array()};
    size_t len = strlen(text), prev = 0;
    for (int i = 0; i <= n_cuts + 1; i++) {
        size_t end = i < n_cuts ? cuts[i] : len;
        int final = i == n_cuts + 1;
        assert_int_equal(tc_feed(p, text + prev, final ? 0 : end - prev, final), 0);
        prev = final ? len : end;
        const char *s;
        size_t n;
        tc_take_content(p, &s, &n);
        append(&r.content, &r.clen, s, n);
        json_t *d = tc_take_deltas(p);
        if (d) apply_deltas(r.calls, d);
        json_decref(d);
    }
    /* The parser's own message view agrees with what its deltas built. */
    json_t *own = tc_calls_json(p);
    assert_true(json_equal(own, r.calls));
    assert_int_equal(tc_n_calls(p), (int)json_array_size(own));
    json_decref(own);
    tc_parser_free(p);
    if (!r.content) append(&r.content, &r.clen, "", 0);
    return r;
}

static void assert_same(const tc_result *a, const tc_result *b, const char *how, size_t at) {
    if (strcmp(a->content, b->content) || !json_equal(a->calls, b->calls)) {
        char *ja = json_dumps(a->calls, JSON_COMPACT), *jb = json_dumps(b->calls, JSON_COMPACT);
        fail_msg("%s at %zu differs:\n content [%s] vs [%s]\n calls %s vs %s", how, at, a->content, b->content,
                 ja, jb);
    }
}

/* Parse text every way and check the result against the expected content and calls
 * (expected_calls: [[name, arguments], ...] as a JSON string). */
static void check(const tc_config *cfg, const char *text, const char *want_content, const char *expected_calls) {
    tc_result one = run_cuts(cfg, text, NULL, 0);
    assert_string_equal(one.content, want_content);
    json_t *want = json_loads(expected_calls, 0, NULL);
    assert_non_null(want);
    assert_int_equal(json_array_size(one.calls), json_array_size(want));
    for (size_t i = 0; i < json_array_size(want); i++) {
        json_t *c = json_array_get(one.calls, i), *fn = json_object_get(c, "function");
        assert_string_equal(json_string_value(json_object_get(fn, "name")),
                            json_string_value(json_array_get(json_array_get(want, i), 0)));
        assert_string_equal(json_string_value(json_object_get(fn, "arguments")),
                            json_string_value(json_array_get(json_array_get(want, i), 1)));
        const char *id = json_string_value(json_object_get(c, "id"));
        if (cfg->format == TC_MISTRAL) assert_int_equal(strlen(id), 9);
        else assert_true(strlen(id) == 29 && !strncmp(id, "call_", 5));
    }
    json_decref(want);
    size_t len = strlen(text);
    size_t *every = malloc((len ? len : 1) * sizeof *every);
    for (size_t i = 0; i < len; i++) every[i] = i + 1;
    tc_result bytes = run_cuts(cfg, text, every, len ? (int)len - 1 : 0);
    assert_same(&one, &bytes, "byte by byte", 0);
    result_free(&bytes);
    free(every);
    for (size_t cut = 0; cut <= len; cut++) {
        tc_result two = run_cuts(cfg, text, &cut, 1);
        assert_same(&one, &two, "cut in two", cut);
        result_free(&two);
    }
    result_free(&one);
}

static json_t *weather_tools(void) {
    return json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
                      "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}},"
                      " {\"type\": \"function\", \"function\": {\"name\": \"get_time\"}}]", 0, NULL);
}

/* ---- hermes / Qwen ------------------------------------------------------------------------- */

static void test_hermes_two_calls_no_content(void **s) {
    (void)s;
    tc_config c = config(TC_HERMES, NULL, 0);
    check(&c,
          "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n"
          "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>",
          "",
          "[[\"get_weather\", \"{\\\"city\\\": \\\"Paris\\\", \\\"unit\\\": \\\"celsius\\\"}\"],"
          " [\"get_time\", \"{\\\"tz\\\": \\\"Europe/Paris\\\"}\"]]");
}

static void test_hermes_text_around_calls_stays_content(void **s) {
    (void)s;
    tc_config c = config(TC_HERMES, NULL, 0);
    check(&c,
          "Let me check the weather.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
          "</tool_call>\nI will report back.",
          "Let me check the weather.\nI will report back.", "[[\"get_weather\", \"{\\\"city\\\": \\\"Oslo\\\"}\"]]");
    /* text only before: trailing whitespace before the call is not content */
    check(&c, "Checking.\n\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n", "Checking.",
          "[[\"get_time\", \"{}\"]]");
}

static void test_hermes_malformed_calls_stay_text(void **s) {
    (void)s;
    tc_config c = config(TC_HERMES, NULL, 0);
    const char *bad[] = {
        "<tool_call>\nnot json at all\n</tool_call>",
        "Use <tool_call>{\"nme\": \"x\", \"arguments\": {}}</tool_call> tags.",
        "<tool_call>{\"name\": 12, \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"get_wea",           /* cut before the name ended */
        "a <tool_cal",                               /* a partial marker at the end */
        "<tool_call><tool_call>{\"arguments\": {\"a\": [1, 2]}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) check(&c, bad[i], bad[i], "[]");
    /* a malformed call, then a good one: the first is text, the second a call */
    check(&c, "<tool_call>oops</tool_call>\n<tool_call>{\"name\": \"get_time\"}</tool_call>",
          "<tool_call>oops</tool_call>", "[[\"get_time\", \"{}\"]]");
}

static void test_hermes_key_order_escapes_and_nesting(void **s) {
    (void)s;
    tc_config c = config(TC_HERMES, NULL, 0);
    check(&c, "<tool_call>{\"arguments\": {\"q\": [1, -2.5e3, true, null, {\"k\": \"v\"}]}, \"name\": \"search\"}</tool_call>",
          "", "[[\"search\", \"{\\\"q\\\": [1, -2.5e3, true, null, {\\\"k\\\": \\\"v\\\"}]}\"]]");
    check(&c, "<tool_call>{\"name\": \"s\\u0065arch\", \"arguments\": {\"q\": \"caf\\u00e9 \\\"}</tool_call>\\\"\"}}</tool_call>",
          "", "[[\"search\", \"{\\\"q\\\": \\\"caf\\\\u00e9 \\\\\\\"}</tool_call>\\\\\\\"\\\"}\"]]");
    check(&c, "<tool_call>{\"name\": \"get_time\", \"parameters\": {}, \"id\": 7}</tool_call>", "",
          "[[\"get_time\", \"{}\"]]");
}

static void test_hermes_break_after_name_keeps_call(void **s) {
    (void)s;
    tc_config c = config(TC_HERMES, NULL, 0);
    /* JSON broken after the arguments: the call stands, the rest is text */
    check(&c, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}, oops}</tool_call>", "oops}</tool_call>",
          "[[\"f\", \"{\\\"a\\\": 1}\"]]");
    /* cut off by max_tokens inside the arguments: partial arguments */
    check(&c, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"hel", "", "[[\"f\", \"{\\\"a\\\": \\\"hel\"]]");
    /* no closing tag at all */
    check(&c, "<tool_call>{\"name\": \"f\", \"arguments\": {}} and more", "and more", "[[\"f\", \"{}\"]]");
}

static void test_hermes_parallel_false_keeps_first_call(void **s) {
    (void)s;
    tc_config c = config(TC_HERMES, NULL, 1);
    check(&c,
          "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}</tool_call>\n"
          "<tool_call>{\"name\": \"b\", \"arguments\": {\"y\": 2}}</tool_call>\nok",
          "ok", "[[\"a\", \"{\\\"x\\\": 1}\"]]");
}

/* ---- llama3_json ---------------------------------------------------------------------------- */

static void test_llama3_json_calls(void **s) {
    (void)s;
    json_t *tools = weather_tools();
    tc_config c = config(TC_LLAMA3_JSON, tools, 0);
    check(&c, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "",
          "[[\"get_weather\", \"{\\\"city\\\": \\\"Paris\\\"}\"]]");
    check(&c, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; "
              "{\"name\": \"get_time\", \"parameters\": {}}",
          "", "[[\"get_weather\", \"{\\\"city\\\": \\\"Rome\\\"}\"], [\"get_time\", \"{}\"]]");
    /* bare JSON must name a declared tool: a JSON answer stays content */
    check(&c, "{\"name\": \"Alice\", \"age\": 3}", "{\"name\": \"Alice\", \"age\": 3}", "[]");
    /* bare JSON only at the start */
    check(&c, "Here: {\"name\": \"get_time\", \"parameters\": {}}", "Here: {\"name\": \"get_time\", \"parameters\": {}}",
          "[]");
    /* python_tag with a name the tools do not declare is still a call (the tag says so) */
    check(&c, "Sure.<|python_tag|>{\"name\": \"lookup\", \"parameters\": {\"k\": 1}}", "Sure.",
          "[[\"lookup\", \"{\\\"k\\\": 1}\"]]");
    /* a ';' not followed by a call is text */
    check(&c, "{\"name\": \"get_time\", \"parameters\": {}}; done", "; done", "[[\"get_time\", \"{}\"]]");
    json_decref(tools);
}

/* ---- mistral ------------------------------------------------------------------------------------- */

static void test_mistral_array_and_name_forms(void **s) {
    (void)s;
    tc_config c = config(TC_MISTRAL, NULL, 0);
    check(&c,
          "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"abc123XYZ\"}, "
          "{\"name\": \"get_time\", \"arguments\": {}}]",
          "", "[[\"get_weather\", \"{\\\"city\\\": \\\"Paris\\\"}\"], [\"get_time\", \"{}\"]]");
    check(&c, "Checking.[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}]", "Checking.",
          "[[\"get_time\", \"{\\\"tz\\\": \\\"UTC\\\"}\"]]");
    check(&c, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{\"tz\": \"UTC\"}", "",
          "[[\"get_weather\", \"{\\\"city\\\": \\\"Paris\\\"}\"], [\"get_time\", \"{\\\"tz\\\": \\\"UTC\\\"}\"]]");
    check(&c, "[TOOL_CALLS] nothing here", "[TOOL_CALLS] nothing here", "[]");
    check(&c, "[TOOL_CALLS]get_time[ARG]{}", "[TOOL_CALLS]get_time[ARG]{}", "[]");
    /* the second array element is broken: the first call stands, the rest is text */
    check(&c, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {oops}]", "{oops}]", "[[\"a\", \"{}\"]]");
}

static void test_detect_from_fixture_templates(void **s) {
    (void)s;
    static const struct {
        const char *file;
        tc_format f;
    } want[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja", TC_HERMES},
        {"Qwen-Qwen3-0.6B.jinja", TC_HERMES},
        {"Qwen-QwQ-32B.jinja", TC_HERMES},
        {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", TC_HERMES},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", TC_LLAMA3_JSON},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", TC_MISTRAL},
        {"google-gemma-2-2b-it.jinja", TC_NONE},
        {"microsoft-Phi-3.5-mini-instruct.jinja", TC_NONE},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "chat-templates/templates/%s", want[i].file);
        char *src = read_all(fixture_path(rel), NULL);
        if (!src) fail_msg("cannot read %s", rel);
        if (tc_detect(src) != want[i].f) fail_msg("%s: detected %s", want[i].file, tc_format_name(tc_detect(src)));
        free(src);
    }
    assert_int_equal(tc_detect(NULL), TC_NONE);
    int f;
    assert_int_equal(tc_format_parse("auto", &f), 0);
    assert_int_equal(f, -1);
    assert_int_equal(tc_format_parse("llama3_json", &f), 0);
    assert_int_equal(f, TC_LLAMA3_JSON);
    assert_int_equal(tc_format_parse("pythonic", &f), -1);
    tc_config none = config(TC_NONE, NULL, 0);
    assert_null(tc_parser_new(&none));
}

/* ---- any text ------------------------------------------------------------------------------------- */

/* Random texts of the pieces tool-call output is made of, well formed or not: whatever the
 * text, the result is the same however it is cut, and the content plus what the calls
 * consumed never invents bytes (content is at most the text). */
static void test_random_texts_do_not_depend_on_cuts(void **s) {
    (void)s;
    static const char *const pieces[] = {
        "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]", ":",
        ",", ";", "\"name\"", "\"arguments\"", "\"parameters\"", "\"get_time\"", "\"f\"", "get_time", "\"",
        "\\", " ", "\n", "x", "1", "-2.5e3", "true", "null", "<tool", "</think>", "\u00e9", "caf\xc3\xa9"};
    const int n_pieces = (int)(sizeof pieces / sizeof pieces[0]);
    json_t *tools = weather_tools();
    uint64_t rng = 0x9e3779b97f4a7c15ULL;
    for (int f = TC_HERMES; f <= TC_MISTRAL; f++) {
        for (int iter = 0; iter < 300; iter++) {
            char text[512] = "";
            size_t len = 0;
            int n = 1 + (int)(rng % 24);
            for (int i = 0; i < n; i++) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                /* bias towards a well-formed call now and then */
                const char *p = (rng >> 40) % 5 == 0
                                    ? (f == TC_HERMES ? "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"a\": [1, \"x\"]}}</tool_call>"
                                       : f == TC_MISTRAL ? "[TOOL_CALLS]get_time[ARGS]{\"a\": 1}"
                                                         : "{\"name\": \"get_time\", \"parameters\": {}}")
                                    : pieces[(rng >> 20) % (uint64_t)n_pieces];
                size_t pl = strlen(p);
                if (len + pl >= sizeof text) break;
                memcpy(text + len, p, pl + 1);
                len += pl;
            }
            for (int max_calls = 0; max_calls <= 1; max_calls++) {
                tc_config c = config((tc_format)f, tools, max_calls);
                tc_result one = run_cuts(&c, text, NULL, 0);
                assert_true(one.clen <= len);
                size_t *every = malloc((len ? len : 1) * sizeof *every);
                for (size_t i = 0; i < len; i++) every[i] = i + 1;
                tc_result bytes = run_cuts(&c, text, every, len ? (int)len - 1 : 0);
                assert_same(&one, &bytes, text, 0);
                size_t cut = len ? (size_t)(rng % len) : 0;
                tc_result two = run_cuts(&c, text, &cut, 1);
                assert_same(&one, &two, text, cut);
                if (max_calls) assert_true(json_array_size(one.calls) <= 1);
                result_free(&one);
                result_free(&bytes);
                result_free(&two);
                free(every);
            }
        }
    }
    json_decref(tools);
}

/* ---- forced calls (tool_choice required / named) ------------------------------------------------ */

static void test_forced_calls_parse_the_constrained_output(void **s) {
    (void)s;
    json_t *tools = weather_tools();
    tc_config c = config(TC_HERMES, tools, 0);
    c.forced_array = 1;
    check(&c, "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}, {\"name\": \"get_time\", "
              "\"parameters\": {}}]",
          "", "[[\"get_weather\", \"{\\\"city\\\": \\\"Oslo\\\"}\"], [\"get_time\", \"{}\"]]");
    tc_config n = config(TC_MISTRAL, tools, 0);
    n.forced_name = "get_weather";
    check(&n, "{\"city\": \"Oslo\"}", "", "[[\"get_weather\", \"{\\\"city\\\": \\\"Oslo\\\"}\"]]");
    json_decref(tools);
}

static void test_forced_schema_compiles_and_names_the_tools(void **s) {
    (void)s;
    json_t *tools = weather_tools();
    char *named = tc_forced_schema(tools, "get_weather", 0), *any = tc_forced_schema(tools, NULL, 1);
    json_t *n = json_loads(named, 0, NULL), *a = json_loads(any, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(json_object_get(json_object_get(n, "properties"), "city"),
                                                          "type")), "string");
    assert_int_equal(json_integer_value(json_object_get(a, "minItems")), 1);
    assert_int_equal(json_integer_value(json_object_get(a, "maxItems")), 1);
    json_t *alts = json_object_get(json_object_get(a, "items"), "anyOf");
    assert_int_equal(json_array_size(alts), 2);
    assert_string_equal(json_string_value(json_object_get(json_object_get(json_object_get(json_array_get(alts, 1),
                                                          "properties"), "name"), "const")), "get_time");
    /* get_time has no parameters: any object */
    assert_string_equal(json_string_value(json_object_get(json_object_get(json_object_get(json_array_get(alts, 1),
                                                          "properties"), "parameters"), "type")), "object");
    char err[256] = "";
    grammar *g1 = grammar_compile(GRAMMAR_JSON_SCHEMA, named, strlen(named), err, sizeof err);
    if (!g1) fail_msg("named: %s", err);
    grammar *g2 = grammar_compile(GRAMMAR_JSON_SCHEMA, any, strlen(any), err, sizeof err);
    if (!g2) fail_msg("required: %s", err);
    grammar_unref(g1);
    grammar_unref(g2);
    assert_null(tc_forced_schema(tools, "nope", 0));
    json_decref(n);
    json_decref(a);
    free(named);
    free(any);
    json_decref(tools);
}

/* ---- reasoning -------------------------------------------------------------------------------------- */

typedef struct {
    char *reason, *content;
    size_t rlen, clen;
} rp_result;

static rp_result rp_run(rp_mode m, rp_prompt ps, const char *text, const size_t *cuts, int n_cuts) {
    rp_parser *p = rp_parser_new(m, ps);
    assert_non_null(p);
    rp_result r = {NULL, NULL, 0, 0};
    append(&r.reason, &r.rlen, "", 0);
    append(&r.content, &r.clen, "", 0);
    size_t len = strlen(text), prev = 0;
    for (int i = 0; i <= n_cuts + 1; i++) {
        size_t end = i < n_cuts ? cuts[i] : len;
        int final = i == n_cuts + 1;
        assert_int_equal(rp_feed(p, text + prev, final ? 0 : end - prev, final), 0);
        prev = final ? len : end;
        const char *a, *b;
        size_t an, bn;
        rp_take(p, &a, &an, &b, &bn);
        append(&r.reason, &r.rlen, a, an);
        append(&r.content, &r.clen, b, bn);
    }
    rp_parser_free(p);
    return r;
}

static void rp_check(rp_mode m, rp_prompt ps, const char *text, const char *want_reason, const char *want_content) {
    size_t len = strlen(text);
    for (size_t cut = 0; cut <= len + 1; cut++) {
        rp_result r = cut <= len ? rp_run(m, ps, text, &cut, 1) : rp_run(m, ps, text, NULL, 0);
        if (strcmp(r.reason, want_reason) || strcmp(r.content, want_content))
            fail_msg("cut %zu of [%s]: reasoning [%s] content [%s]", cut, text, r.reason, r.content);
        free(r.reason);
        free(r.content);
    }
    size_t *every = malloc((len ? len : 1) * sizeof *every);
    for (size_t i = 0; i < len; i++) every[i] = i + 1;
    rp_result r = rp_run(m, ps, text, every, len ? (int)len - 1 : 0);
    assert_string_equal(r.reason, want_reason);
    assert_string_equal(r.content, want_content);
    free(r.reason);
    free(r.content);
    free(every);
}

static void test_reasoning_qwen3_and_r1(void **s) {
    (void)s;
    /* Qwen3: <think> in the output */
    rp_check(RP_QWEN3, RP_PROMPT_NEUTRAL, "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.",
             "Hello!");
    /* Qwen3 without a section: all content */
    rp_check(RP_QWEN3, RP_PROMPT_NEUTRAL, "Hello! </think> is a tag.", "", "Hello! </think> is a tag.");
    /* enable_thinking false rendered an empty section into the prompt */
    rp_check(RP_QWEN3, RP_PROMPT_CLOSED, "<think>x</think>y", "", "<think>x</think>y");
    /* the prompt opened the section (R1, Qwen3 thinking models): only </think> comes */
    rp_check(RP_QWEN3, RP_PROMPT_OPEN, "Two plus two.\n</think>\n\nIt is 4.", "Two plus two.", "It is 4.");
    rp_check(RP_DEEPSEEK_R1, RP_PROMPT_OPEN, "\nHmm, 4.\n</think>\n\n**4**", "Hmm, 4.", "**4**");
    /* R1 without any tag: reasoning until </think>; cut off inside it: all reasoning */
    rp_check(RP_DEEPSEEK_R1, RP_PROMPT_NEUTRAL, "thinking</think>answer", "thinking", "answer");
    rp_check(RP_DEEPSEEK_R1, RP_PROMPT_NEUTRAL, "<think>still thinking </thi", "still thinking </thi", "");
    rp_check(RP_QWEN3, RP_PROMPT_NEUTRAL, "  <thinking>", "", "  <thinking>");
    /* whitespace inside the reasoning is kept */
    rp_check(RP_QWEN3, RP_PROMPT_NEUTRAL, "<think>a\n\nb </think>c  d\n", "a\n\nb", "c  d\n");
}

static void test_reasoning_prompt_state_and_names(void **s) {
    (void)s;
    const char *open = "<|im_start|>assistant\n<think>\n";
    const char *closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    const char *plain = "<|im_start|>user\nsay <think><|im_end|>\n<|im_start|>assistant\n";
    assert_int_equal(rp_prompt_state(open, strlen(open)), RP_PROMPT_OPEN);
    assert_int_equal(rp_prompt_state(closed, strlen(closed)), RP_PROMPT_CLOSED);
    assert_int_equal(rp_prompt_state(plain, strlen(plain)), RP_PROMPT_NEUTRAL);
    rp_mode m;
    assert_int_equal(rp_mode_parse("deepseek_r1", &m), 0);
    assert_int_equal(m, RP_DEEPSEEK_R1);
    assert_string_equal(rp_mode_name(RP_QWEN3), "qwen3");
    assert_int_equal(rp_mode_parse("granite", &m), -1);
    assert_null(rp_parser_new(RP_NONE, RP_PROMPT_NEUTRAL));
}

/* Reasoning first, then tool calls in the content (Qwen3 with tools). */
static void test_reasoning_then_tool_call(void **s) {
    (void)s;
    const char *text = "<think>\nI need the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                       "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    rp_parser *rp = rp_parser_new(RP_QWEN3, RP_PROMPT_NEUTRAL);
    tc_config c = config(TC_HERMES, NULL, 0);
    tc_parser *tc = tc_parser_new(&c);
    char *reason = NULL, *content = NULL;
    size_t rl = 0, cl = 0;
    append(&reason, &rl, "", 0);
    append(&content, &cl, "", 0);
    for (size_t i = 0; i <= strlen(text); i++) {   /* one byte per feed, then the final */
        int final = i == strlen(text);
        assert_int_equal(rp_feed(rp, text + i, final ? 0 : 1, final), 0);
        const char *a, *b;
        size_t an, bn;
        rp_take(rp, &a, &an, &b, &bn);
        append(&reason, &rl, a, an);
        assert_int_equal(tc_feed(tc, b, bn, final), 0);
        tc_take_content(tc, &a, &an);
        append(&content, &cl, a, an);
    }
    assert_string_equal(reason, "I need the weather.");
    assert_string_equal(content, "");
    json_t *calls = tc_calls_json(tc);
    assert_int_equal(json_array_size(calls), 1);
    assert_string_equal(json_string_value(json_object_get(json_object_get(json_array_get(calls, 0), "function"), "arguments")),
                        "{\"city\": \"Paris\"}");
    json_decref(calls);
    free(reason);
    free(content);
    rp_parser_free(rp);
    tc_parser_free(tc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hermes_two_calls_no_content),
        cmocka_unit_test(test_hermes_text_around_calls_stays_content),
        cmocka_unit_test(test_hermes_malformed_calls_stay_text),
        cmocka_unit_test(test_hermes_key_order_escapes_and_nesting),
        cmocka_unit_test(test_hermes_break_after_name_keeps_call),
        cmocka_unit_test(test_hermes_parallel_false_keeps_first_call),
        cmocka_unit_test(test_llama3_json_calls),
        cmocka_unit_test(test_mistral_array_and_name_forms),
        cmocka_unit_test(test_detect_from_fixture_templates),
        cmocka_unit_test(test_random_texts_do_not_depend_on_cuts),
        cmocka_unit_test(test_forced_calls_parse_the_constrained_output),
        cmocka_unit_test(test_forced_schema_compiles_and_names_the_tools),
        cmocka_unit_test(test_reasoning_qwen3_and_r1),
        cmocka_unit_test(test_reasoning_prompt_state_and_names),
        cmocka_unit_test(test_reasoning_then_tool_call),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
