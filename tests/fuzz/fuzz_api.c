/* libFuzzer target for the OpenAI request parser / validator (server/api.h).
 *
 * Every input is fed, unchanged, to each public parse entry point:
 *   api_parse_request(API_COMPLETION), api_parse_request(API_CHAT), api_parse_tokenize,
 *   api_parse_detokenize (and api_normalize_messages through chat / tokenize), and the
 *   Responses and Messages mappings onto chat (api_resp_parse, api_msg_parse,
 *   api_msg_parse_count: a success is a chat request under the same checks, an error
 *   also serialises in the Messages shape); an input that is a JSON object is also fed
 *   as a chat delta to a Messages stream, whose events and message must serialise.
 * Invariants checked (abort() on violation, so libFuzzer records a crash):
 *   - a failure fills an api_error with a 4xx/5xx status and a NUL-terminated message, and
 *     api_error_json serialises to JSON that parses back with the same status fields;
 *   - a success yields a request whose fields are in the documented ranges (ids < vocab,
 *     n <= max_n, prompts x n <= API_MAX_CHOICES, <= API_MAX_STOP non-empty stops without
 *     NUL, temperature / top_p / min_p ranges, include_usage only with stream, ...);
 *   - the success can be answered: a whole response (api_response_json with one choice per
 *     prompt x n, text = the prompt / last message) and streaming chunks serialise to
 *     valid JSON that round-trips the text byte for byte, and api_sse_event frames each
 *     chunk as "data: <json>\n\n" with no raw newline inside;
 *   - api_stop_scan on the prompt text agrees with a brute-force reference and never cuts
 *     a UTF-8 character;
 *   - api_check_length / api_default_max_tokens leave room for at least one token;
 *   - logprobs accumulators keep their parallel arrays the same length.
 * Build and run: scripts/fuzz.sh api SECONDS. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api.h"
#include "server/api_messages.h"
#include "server/api_responses.h"

#define VOCAB 1000
#define MAX_N 8
#define CHECK(c)                                                                      \
    do {                                                                              \
        if (!(c)) {                                                                   \
            fprintf(stderr, "fuzz_api: invariant failed at %s:%d: %s\n", __FILE__,    \
                    __LINE__, #c);                                                    \
            abort();                                                                  \
        }                                                                             \
    } while (0)

static const api_limits LIM = {.served_model = "m", .vocab = VOCAB, .max_n = MAX_N, .max_token_bytes = 16};

static int utf8_boundary(const char *s, size_t len, size_t at) {
    return at == 0 || at >= len || ((unsigned char)s[at] & 0xC0) != 0x80;
}

static void check_error(const api_error *e) {
    CHECK(e->status == 400 || e->status == 404 || e->status == 500);
    CHECK(memchr(e->message, 0, sizeof e->message));
    CHECK(memchr(e->param, 0, sizeof e->param));
    CHECK(e->message[0]);
    json_t *j = api_error_json(e);
    CHECK(j);
    char *s = json_dumps(j, JSON_COMPACT);
    /* a message cut at 511 bytes can split a UTF-8 character of echoed input: jansson then
     * refuses the string. That would make the error body lose its message; check it. */
    CHECK(s);
    json_t *back = json_loads(s, 0, NULL);
    CHECK(back);
    json_t *err = json_object_get(back, "error");
    CHECK(json_is_object(err));
    CHECK(json_is_string(json_object_get(err, "message")));
    CHECK(json_is_string(json_object_get(err, "type")));
    json_decref(back);
    free(s);
    json_decref(j);
}

/* Brute-force reference for api_stop_scan. */
static void check_stop_scan(const char *text, size_t len, char *const *stops, int n) {
    size_t emit = (size_t)-1;
    int hit = api_stop_scan(text, len, stops, n, &emit);
    size_t best = (size_t)-1;
    for (int i = 0; i < n; i++) {
        size_t sl = strlen(stops[i]);
        for (size_t p = 0; p + sl <= len && p < best; p++)
            if (!memcmp(text + p, stops[i], sl)) { best = p; break; }
    }
    if (best != (size_t)-1) {
        CHECK(hit == 1 && emit == best);
    } else {
        CHECK(hit == 0 && emit <= len);
        size_t hold = 0;
        for (int i = 0; i < n; i++) {
            size_t sl = strlen(stops[i]);
            for (size_t k = 1; k < sl && k <= len; k++)
                if (!memcmp(text + len - k, stops[i], k) && k > hold) hold = k;
        }
        CHECK(emit == len - hold);
    }
    CHECK(utf8_boundary(text, len, emit));
}

/* Dump, parse back, compare the text at choices[0] (path depends on kind). */
static void check_roundtrip_text(json_t *v, api_kind kind, int chunk, const char *text, size_t len) {
    char *s = json_dumps(v, JSON_COMPACT);
    CHECK(s);
    CHECK(!strchr(s, '\n'));
    json_error_t je;
    json_t *back = json_loads(s, 0, &je);
    CHECK(back);
    json_t *ch = json_array_get(json_object_get(back, "choices"), 0);
    CHECK(json_is_object(ch));
    json_t *t;
    if (kind == API_COMPLETION) t = json_object_get(ch, "text");
    else t = json_object_get(json_object_get(ch, chunk ? "delta" : "message"), "content");
    CHECK(json_is_string(t));
    CHECK(json_string_length(t) == len && !memcmp(json_string_value(t), text, len));
    json_decref(back);

    size_t el = 0;
    char *ev = api_sse_event(v, &el);
    CHECK(ev);
    CHECK(el == strlen(s) + 8 && !memcmp(ev, "data: ", 6) && !memcmp(ev + el - 2, "\n\n", 2));
    CHECK(!memchr(ev, '\n', el - 2));
    CHECK(!memcmp(ev + 6, s, strlen(s)));
    free(ev);
    free(s);
}

static void check_logprobs(api_kind kind, const char *text, size_t len) {
    json_t *lp = api_logprobs_new(kind);
    CHECK(lp);
    /* tokens: the text cut at character boundaries into up to 8 pieces */
    size_t at = 0;
    int added = 0;
    while (at < len && added < 8) {
        size_t end = at + 1 + (len - at) / 3;
        while (end < len && !utf8_boundary(text, len, end)) end++;
        if (end > len) end = len;
        const char *top[2] = {text + at, text};
        size_t top_len[2] = {end - at, at};
        float top_lp[2] = {-0.5f, -1.5f};
        api_logprobs_add(lp, kind, text + at, end - at, -0.25f, 2, top, top_len, top_lp, (long long)at);
        added++;
        at = end;
    }
    if (kind == API_CHAT) {
        CHECK(json_array_size(json_object_get(lp, "content")) == (size_t)added);
    } else {
        size_t n = json_array_size(json_object_get(lp, "tokens"));
        CHECK(n == (size_t)added);
        CHECK(json_array_size(json_object_get(lp, "token_logprobs")) == n);
        CHECK(json_array_size(json_object_get(lp, "top_logprobs")) == n);
        CHECK(json_array_size(json_object_get(lp, "text_offset")) == n);
    }
    char *s = json_dumps(lp, JSON_COMPACT);
    CHECK(s);
    free(s);
    json_decref(lp);
}

static void answer(api_request *r, const char *text, size_t len, uint32_t h) {
    api_kind kind = r->kind;
    int nc = r->n * (kind == API_COMPLETION ? r->n_prompts : 1);
    CHECK(nc >= 1 && nc <= API_MAX_CHOICES);
    json_t *choices = json_array();
    for (int i = 0; i < nc; i++)
        json_array_append_new(choices, kind == API_CHAT
                                           ? api_chat_choice(i, text, len, "stop", NULL)
                                           : api_completion_choice(i, text, len, "length", NULL));
    CHECK(json_array_size(choices) == (size_t)nc);
    api_usage u = {(int)(h & 0xffff), (int)(h >> 16), (int)(h & 1), h % 7, h % 5, h % 3, h & 2 ? "ngram" : NULL, h % 11};
    json_t *resp = api_response_json(kind, "cmpl-x", 1700000000, LIM.served_model, choices, &u);
    check_roundtrip_text(resp, kind, 0, text, len);
    json_decref(resp);

    json_t *c = api_chunk_json(kind, "cmpl-x", 1, "m", 0, 1, text, len, NULL, NULL, r->include_usage);
    check_roundtrip_text(c, kind, 1, text, len);
    json_decref(c);
    c = api_usage_chunk_json(kind, "cmpl-x", 1, "m", &u);
    size_t el;
    char *ev = api_sse_event(c, &el);
    CHECK(ev && !memchr(ev, '\n', el - 2));
    free(ev);
    json_decref(c);

    if (r->n_stop) check_stop_scan(text, len, r->stop, r->n_stop);
    if (r->logprobs >= 0) check_logprobs(kind, text, len);
}

static void check_request(api_request *r, api_kind kind, uint32_t h) {
    CHECK(r->kind == kind);
    CHECK(r->n >= 1 && r->n <= MAX_N);
    /* completions take max_tokens 0 (the prompt only, its logprobs with echo); chat 1 at least */
    CHECK(r->max_tokens == -1 || (r->max_tokens >= (kind == API_COMPLETION ? 0 : 1) && r->max_tokens <= (1 << 24)));
    CHECK(r->logprobs >= -1 && r->logprobs <= API_MAX_TOP_LOGPROBS);
    CHECK(r->sp.logprobs == r->logprobs);
    CHECK(r->n_stop >= 0 && r->n_stop <= API_MAX_STOP);
    for (int i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        CHECK(sl >= 1 && sl <= API_MAX_STOP_LEN);
    }
    CHECK(r->sp.n_logit_bias >= 0 && r->sp.n_logit_bias <= API_MAX_LOGIT_BIAS);
    for (int i = 0; i < r->sp.n_logit_bias; i++) {
        CHECK(r->sp.logit_bias_ids[i] >= 0 && r->sp.logit_bias_ids[i] < VOCAB);
        CHECK(r->sp.logit_bias_vals[i] >= -100 && r->sp.logit_bias_vals[i] <= 100);
    }
    CHECK(r->sp.temperature >= 0 && r->sp.temperature <= 2);
    CHECK(r->sp.top_p > 0 && r->sp.top_p <= 1);
    CHECK(r->sp.min_p >= 0 && r->sp.min_p <= 1);
    CHECK(r->sp.top_k >= 0);
    CHECK(r->sp.min_tokens >= 0);
    CHECK(!r->sp.min_tokens || r->max_tokens < 0 || r->sp.min_tokens <= r->max_tokens);
    CHECK(!r->include_usage || r->stream);
    CHECK(r->echo == 0 || r->echo == 1);

    const char *text = "";
    size_t len = 0;
    if (kind == API_COMPLETION) {
        CHECK(r->n_prompts >= 1 && r->n_prompts <= API_MAX_CHOICES);
        CHECK((long long)r->n * r->n_prompts <= API_MAX_CHOICES);
        CHECK(!r->messages);
        for (int i = 0; i < r->n_prompts; i++) {
            api_prompt *p = &r->prompts[i];
            CHECK(!p->text != !p->ids);
            if (p->ids) {
                CHECK(p->n_ids >= 1);
                for (int j = 0; j < p->n_ids; j++) CHECK(p->ids[j] >= 0 && p->ids[j] < VOCAB);
                int msl = 1 + (int)(h % 4096);
                api_error e;
                if (!api_check_length(p->n_ids, r->max_tokens, msl, i, &e)) {
                    int mt = r->max_tokens > 0 ? r->max_tokens
                                               : api_default_max_tokens(kind, p->n_ids, msl);
                    CHECK(mt >= 1 && (long long)p->n_ids + mt <= msl);
                } else {
                    check_error(&e);
                }
            } else {
                CHECK(p->text[p->text_len] == 0);
                if (!i) { text = p->text; len = p->text_len; }
            }
        }
    } else {
        CHECK(json_is_array(r->messages) && json_array_size(r->messages) >= 1);
        size_t i;
        json_t *m;
        json_array_foreach(r->messages, i, m) {
            CHECK(json_is_object(m));
            json_t *c = json_object_get(m, "content");
            CHECK(json_is_string(c) || json_is_null(c));
            if (json_is_string(c)) { text = json_string_value(c); len = json_string_length(c); }
        }
        CHECK(!r->tools || (json_is_array(r->tools) && json_array_size(r->tools)));
        CHECK(!r->chat_template_kwargs || json_is_object(r->chat_template_kwargs));
        CHECK(!r->prompts && !r->n_prompts);
    }
    answer(r, text, len, h);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *body = (const char *)data;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < size && i < 64; i++) h = (h ^ data[i]) * 16777619u;

    for (int k = 0; k < 2; k++) {
        api_kind kind = k ? API_CHAT : API_COMPLETION;
        api_error e;
        memset(&e, 0xAA, sizeof e);
        api_request *r = api_parse_request(kind, body, size, &LIM, &e);
        if (r) check_request(r, kind, h);
        else check_error(&e);
        api_request_free(r);
    }

    api_error e;
    memset(&e, 0xAA, sizeof e);
    json_t *t = api_parse_tokenize(body, size, &e);
    if (t) {
        CHECK(json_is_object(t));
        json_t *p = json_object_get(t, "prompt"), *m = json_object_get(t, "messages");
        CHECK((p && !json_is_null(p)) != (m && !json_is_null(m)));
        CHECK(!p || json_is_null(p) || json_is_string(p));
        CHECK(!m || json_is_null(m) || json_is_array(m));
        json_decref(t);
    } else {
        check_error(&e);
    }

    /* the Responses and Messages mappings: chat requests, or errors (also in the Messages shape) */
    for (int k = 0; k < 3; k++) {
        memset(&e, 0xAA, sizeof e);
        api_request *r = k == 0 ? api_resp_parse(body, size, &LIM, &e)
                         : k == 1 ? api_msg_parse(body, size, &LIM, &e)
                                  : api_msg_parse_count(body, size, &LIM, &e);
        if (r) {
            CHECK(r->kind == API_CHAT && (k == 0 ? r->responses != NULL : r->messages_api == 1));
            check_request(r, API_CHAT, h);
            api_request_free(r);
        } else {
            check_error(&e);
            json_t *j = api_msg_error_json(&e);
            char *js = json_dumps(j, JSON_COMPACT);
            CHECK(js && json_is_string(json_object_get(json_object_get(j, "error"), "message")));
            free(js);
            json_decref(j);
        }
    }
    /* a JSON object as a chat delta into a Messages stream: every event and the message serialise */
    json_t *d = json_loadb(body, size, 0, NULL);
    if (json_is_object(d)) {
        api_mstream *ms = api_mstream_new("msg_f", "m");
        json_t *ev = json_array();
        api_mstream_open(ms, 1, ev);
        api_mstream_feed(ms, d, ev);
        api_mstream_feed(ms, d, ev);
        json_t *msg = api_mstream_close(ms, h & 1 ? "stop" : "length", h & 2 ? "s" : NULL, 1, 2, ev);
        CHECK(json_is_array(json_object_get(msg, "content")));
        char *ms_s = json_dumps(msg, JSON_COMPACT);
        CHECK(ms_s);
        free(ms_s);
        size_t i, len;
        json_t *x;
        json_array_foreach(ev, i, x) {
            char *sse = api_rstream_sse(x, &len);
            CHECK(sse && len > 14 && !memcmp(sse, "event: ", 7));
            free(sse);
        }
        json_decref(msg);
        json_decref(ev);
        api_mstream_free(ms);
    }
    json_decref(d);

    memset(&e, 0xAA, sizeof e);
    t = api_parse_detokenize(body, size, VOCAB, &e);
    if (t) {
        json_t *ids = json_object_get(t, "tokens");
        CHECK(json_is_array(ids));
        size_t i;
        json_t *v;
        json_array_foreach(ids, i, v)
            CHECK(json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < VOCAB);
        json_decref(t);
    } else {
        check_error(&e);
    }
    return 0;
}
