/* Unit tests of the server's pure parts: OpenAI request validation, response / chunk
 * shapes, SSE framing and the response channel, stop-string hold-back, config precedence
 * and the metrics text. No HTTP, no engine. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/err.h"
#include "server/api.h"
#include "server/log.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/sse.h"

static const api_limits LIM = {"tiny", 1024, 16, 0};

static api_request *parse(api_kind k, const char *body, api_error *e) {
    memset(e, 0, sizeof *e);
    return api_parse_request(k, body, strlen(body), &LIM, e);
}

/* Expect a 400 (or other status) naming param. */
static void expect_error(api_kind k, const char *body, int status, const char *param) {
    api_error e;
    api_request *r = parse(k, body, &e);
    if (r) fail_msg("accepted: %s", body);
    assert_int_equal(e.status, status);
    assert_string_equal(e.param, param);
    assert_true(strlen(e.message) > 0);
}

static void test_completion_defaults_and_text_prompt(void **s) {
    (void)s;
    api_error e;
    api_request *r = parse(API_COMPLETION, "{\"model\":\"tiny\",\"prompt\":\"hello\"}", &e);
    assert_non_null(r);
    assert_int_equal(r->n_prompts, 1);
    assert_string_equal(r->prompts[0].text, "hello");
    assert_int_equal(r->prompts[0].text_len, 5);
    assert_null(r->prompts[0].ids);
    assert_int_equal(r->n, 1);
    assert_int_equal(r->max_tokens, -1);
    assert_int_equal(r->logprobs, -1);
    assert_int_equal(r->sp.logprobs, -1);
    assert_int_equal(r->stream, 0);
    assert_int_equal(r->n_stop, 0);
    assert_true(r->sp.temperature == 1.0f);
    assert_int_equal(r->sp.has_seed, 0);
    api_request_free(r);
}

static void test_completion_token_prompts_and_fields(void **s) {
    (void)s;
    api_error e;
    api_request *r = parse(API_COMPLETION,
                           "{\"prompt\":[[1,2,3],[1023]],\"max_tokens\":7,\"temperature\":0,"
                           "\"top_p\":0.5,\"top_k\":-1,\"min_p\":0.1,\"seed\":42,\"n\":3,"
                           "\"stop\":[\"a\",\"bc\"],\"logprobs\":2,\"presence_penalty\":-2,"
                           "\"frequency_penalty\":2,\"repetition_penalty\":1.1,"
                           "\"logit_bias\":{\"5\":-100,\"7\":3.5},\"ignore_eos\":true,"
                           "\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                           "\"user\":\"u\",\"some_unknown_field\":{\"x\":1}}",
                           &e);
    assert_non_null(r);
    assert_int_equal(r->n_prompts, 2);
    assert_int_equal(r->prompts[0].n_ids, 3);
    assert_int_equal(r->prompts[0].ids[2], 3);
    assert_int_equal(r->prompts[1].n_ids, 1);
    assert_int_equal(r->prompts[1].ids[0], 1023);
    assert_int_equal(r->max_tokens, 7);
    assert_true(r->sp.temperature == 0.0f);
    assert_true(r->sp.top_p == 0.5f);
    assert_int_equal(r->sp.top_k, 0);
    assert_true(r->sp.min_p == 0.1f);
    assert_int_equal(r->sp.seed, 42);
    assert_int_equal(r->sp.has_seed, 1);
    assert_int_equal(r->n, 3);
    assert_int_equal(r->n_stop, 2);
    assert_string_equal(r->stop[1], "bc");
    assert_int_equal(r->sp.logprobs, 2);
    assert_true(r->sp.presence_penalty == -2.0f);
    assert_true(r->sp.frequency_penalty == 2.0f);
    assert_true(r->sp.repetition_penalty == 1.1f);
    assert_int_equal(r->sp.n_logit_bias, 2);
    assert_int_equal(r->sp.logit_bias_ids[0], 5);
    assert_true(r->sp.logit_bias_vals[0] == -100.0f);
    assert_int_equal(r->sp.logit_bias_ids[1], 7);
    assert_true(r->sp.logit_bias_vals[1] == 3.5f);
    assert_int_equal(r->sp.ignore_eos, 1);
    assert_int_equal(r->stream, 1);
    assert_int_equal(r->include_usage, 1);
    api_request_free(r);
}

static void test_single_token_array_is_one_prompt(void **s) {
    (void)s;
    api_error e;
    api_request *r = parse(API_COMPLETION, "{\"prompt\":[4,5,6],\"stop\":\"x\",\"max_tokens\":3.0}", &e);
    assert_non_null(r);
    assert_int_equal(r->n_prompts, 1);
    assert_int_equal(r->prompts[0].n_ids, 3);
    assert_int_equal(r->n_stop, 1);
    assert_string_equal(r->stop[0], "x");
    assert_int_equal(r->max_tokens, 3);
    api_request_free(r);
}

/* echo + logprobs asks the engine for the prompt's logprobs (top N as logprobs), as does
 * vLLM's prompt_logprobs (the larger N wins); max_tokens 0 is the prompt only. */
static void test_echo_logprobs_ask_for_prompt_logprobs(void **s) {
    (void)s;
    api_error e;
    static const struct { const char *body; int max_tokens, prompt_logprobs, engine; } cases[] = {
        {"{\"prompt\":\"p\",\"echo\":true,\"logprobs\":1,\"max_tokens\":0}", 0, -1, 1},
        {"{\"prompt\":\"p\",\"echo\":true,\"logprobs\":0}", -1, -1, 0},
        {"{\"prompt\":\"p\",\"logprobs\":3}", -1, -1, -1},
        {"{\"prompt\":\"p\",\"echo\":true}", -1, -1, -1},
        {"{\"prompt\":\"p\",\"prompt_logprobs\":2,\"max_tokens\":0}", 0, 2, 2},
        {"{\"prompt\":\"p\",\"echo\":true,\"logprobs\":4,\"prompt_logprobs\":2}", -1, 2, 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        api_request *r = parse(API_COMPLETION, cases[i].body, &e);
        assert_non_null(r);
        assert_int_equal(r->max_tokens, cases[i].max_tokens);
        assert_int_equal(r->prompt_logprobs, cases[i].prompt_logprobs);
        assert_int_equal(r->sp.prompt_logprobs, cases[i].engine);
        api_request_free(r);
    }
}

static void test_null_fields_mean_default(void **s) {
    (void)s;
    api_error e;
    api_request *r = parse(API_COMPLETION,
                           "{\"prompt\":\"p\",\"max_tokens\":null,\"temperature\":null,\"stop\":null,"
                           "\"stream_options\":null,\"n\":null,\"model\":null}", &e);
    assert_non_null(r);
    assert_int_equal(r->max_tokens, -1);
    assert_true(r->sp.temperature == 1.0f);
    assert_int_equal(r->n, 1);
    api_request_free(r);
}

static void test_completion_rejects_bad_fields(void **s) {
    (void)s;
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"model\":\"gpt-4\"}", 404, "model");
    api_error e;
    assert_null(parse(API_COMPLETION, "{\"prompt\":\"p\",\"model\":\"other\"}", &e));
    assert_string_equal(e.code, "model_not_found");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"model\":5}", 400, "model");
    expect_error(API_COMPLETION, "{}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":5}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":[]}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":[[]]}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":[1,1024]}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":[1,-1]}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":[1,\"a\"]}", 400, "prompt");
    expect_error(API_COMPLETION, "{\"prompt\":[\"a\",[1]]}", 400, "prompt");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":0}", 400,
                 "max_tokens");   /* completions may ask for 0 (the prompt only), chat not */
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"max_tokens\":-5}", 400, "max_tokens");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"max_tokens\":\"5\"}", 400, "max_tokens");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"max_tokens\":5.5}", 400, "max_tokens");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"max_tokens\":1e300}", 400, "max_tokens");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"max_completion_tokens\":0}", 400, "max_completion_tokens");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"temperature\":2.01}", 400, "temperature");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"temperature\":-0.1}", 400, "temperature");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"temperature\":\"hot\"}", 400, "temperature");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"top_p\":0}", 400, "top_p");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"top_p\":1.5}", 400, "top_p");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"top_k\":-2}", 400, "top_k");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"top_k\":true}", 400, "top_k");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"min_p\":1.5}", 400, "min_p");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"seed\":\"1\"}", 400, "seed");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"n\":0}", 400, "n");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"n\":17}", 400, "n");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"presence_penalty\":2.5}", 400, "presence_penalty");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"frequency_penalty\":-3}", 400, "frequency_penalty");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"repetition_penalty\":0}", 400, "repetition_penalty");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, "stop");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stop\":[1]}", 400, "stop");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stop\":7}", 400, "stop");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logit_bias\":[1]}", 400, "logit_bias");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logit_bias\":{\"x\":1}}", 400, "logit_bias");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logit_bias\":{\"1024\":1}}", 400, "logit_bias");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logit_bias\":{\"3\":101}}", 400, "logit_bias");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logit_bias\":{\"3\":\"1\"}}", 400, "logit_bias");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"ignore_eos\":1}", 400, "ignore_eos");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stream\":\"yes\"}", 400, "stream");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stream_options\":{\"include_usage\":true}}", 400, "stream_options");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400, "stream_options");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"stream\":true,\"stream_options\":3}", 400, "stream_options");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"user\":3}", 400, "user");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logprobs\":21}", 400, "logprobs");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"logprobs\":true}", 400, "logprobs");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"echo\":\"no\"}", 400, "echo");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"prompt_logprobs\":21}", 400, "prompt_logprobs");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"prompt_logprobs\":1,\"stream\":true}", 400, "prompt_logprobs");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"min_tokens\":5,\"max_tokens\":2}", 400, "min_tokens");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"response_format\":{\"type\":\"yaml\"}}", 400, "response_format");
    /* constrained decoding: a field that does not compile is a 400 naming it; two at once too */
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                 "{\"name\":\"x\",\"schema\":{\"type\":\"integer\",\"multipleOf\":2}}}}", 400, "response_format");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"guided_regex\":\"a(?=b)\"}", 400, "guided_regex");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"guided_choice\":[]}", 400, "guided_choice");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"grammar\":\"root ::= x\"}", 400, "grammar");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"structured_outputs\":{\"structural_tag\":\"t\"}}", 400, "structured_outputs");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"guided_regex\":\"a\",\"guided_choice\":[\"a\"]}", 400, "guided_choice");
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"suffix\":\"end\"}", 400, "suffix");
}

/* Each spelling of a constraint compiles into the request's grammar, with the language
 * asked for (checked by matching a sentence and a non-sentence). */
static void test_constraint_fields_compile_into_the_request(void **s) {
    (void)s;
    static const struct { const char *body, *yes, *no; } cases[] = {
        {"{\"prompt\":\"p\",\"response_format\":{\"type\":\"json_object\"}}", "{\"a\": [1]}", "[1]"},
        {"{\"prompt\":\"p\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\","
         "\"schema\":{\"type\":\"integer\"}}}}", "-12", "1.5"},
        {"{\"prompt\":\"p\",\"response_format\":{\"type\":\"text\"}}", NULL, NULL},
        {"{\"prompt\":\"p\",\"guided_json\":\"{\\\"type\\\":\\\"boolean\\\"}\"}", "true", "1"},
        {"{\"prompt\":\"p\",\"json_schema\":{\"enum\":[\"a\",\"b\"]}}", "\"b\"", "\"c\""},
        {"{\"prompt\":\"p\",\"guided_regex\":\"[0-9]{2}\"}", "42", "4"},
        {"{\"prompt\":\"p\",\"guided_choice\":[\"yes\",\"no\"]}", "no", "nope"},
        {"{\"prompt\":\"p\",\"grammar\":\"root ::= \\\"x\\\"+\"}", "xxx", "xy"},
        {"{\"prompt\":\"p\",\"structured_outputs\":{\"choice\":[\"up\"]}}", "up", "down"},
        {"{\"prompt\":\"p\",\"structured_outputs\":{\"json_object\":true}}", "{}", "1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        api_error e;
        api_request *r = parse(API_COMPLETION, cases[i].body, &e);
        if (!r) fail_msg("%s: %s", cases[i].body, e.message);
        if (!cases[i].yes) {
            assert_null(r->sp.grammar);
        } else {
            assert_non_null(r->sp.grammar);
            matcher *m = matcher_new(r->sp.grammar, NULL);
            assert_int_equal(matcher_accept_bytes(m, cases[i].yes, strlen(cases[i].yes)), 0);
            assert_true(matcher_accepting(m));
            matcher_free(m);
            m = matcher_new(r->sp.grammar, NULL);
            assert_false(matcher_accept_bytes(m, cases[i].no, strlen(cases[i].no)) == 0 && matcher_accepting(m));
            matcher_free(m);
        }
        api_request_free(r);
    }
}

static void test_invalid_json_bodies(void **s) {
    (void)s;
    expect_error(API_COMPLETION, "{\"prompt\":", 400, "");
    expect_error(API_COMPLETION, "[1,2]", 400, "");
    expect_error(API_COMPLETION, "", 400, "");
    /* Invalid UTF-8 inside a string is rejected by the JSON parser. */
    expect_error(API_COMPLETION, "{\"prompt\":\"\xff\xfe\"}", 400, "");
    /* An integer beyond int64 is a parse error, not a wrap-around. */
    expect_error(API_COMPLETION, "{\"prompt\":\"p\",\"max_tokens\":99999999999999999999999}", 400, "");
}

static void test_chat_messages_normalised(void **s) {
    (void)s;
    api_error e;
    api_request *r = parse(API_CHAT,
                           "{\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
                           "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                           "{\"type\":\"text\",\"text\":\"b\"}]},"
                           "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]},"
                           "{\"role\":\"tool\",\"content\":\"42\",\"tool_call_id\":\"c1\"}],"
                           "\"logprobs\":true,\"top_logprobs\":3,\"tools\":[{\"type\":\"function\"}]}",
                           &e);
    assert_non_null(r);
    assert_int_equal(json_array_size(r->messages), 4);
    assert_string_equal(json_string_value(json_object_get(json_array_get(r->messages, 1), "content")), "a\nb");
    /* an assistant turn with content null renders as "" (vLLM's choice); [] tool_calls go */
    assert_string_equal(json_string_value(json_object_get(json_array_get(r->messages, 2), "content")), "");
    assert_null(json_object_get(json_array_get(r->messages, 2), "tool_calls"));
    assert_string_equal(json_string_value(json_object_get(json_array_get(r->messages, 3), "tool_call_id")), "c1");
    assert_int_equal(json_array_size(r->tools), 1);
    assert_int_equal(r->sp.logprobs, 3);
    assert_int_equal(r->add_generation_prompt, 1);
    api_request_free(r);
    r = parse(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true}", &e);
    assert_non_null(r);
    assert_int_equal(r->sp.logprobs, 0);
    api_request_free(r);
    r = parse(API_CHAT, "{\"messages\":[{\"role\":\"developer\",\"content\":\"x\"}]}", &e);
    assert_non_null(r);
    assert_int_equal(r->sp.logprobs, -1);
    api_request_free(r);
}

/* A tool-result turn as the OpenAI SDK sends it: arguments arrive as a JSON string and
 * reach the template as the value it encodes (HF and vLLM do the same). */
static void test_chat_tool_turns_and_tool_choice(void **s) {
    (void)s;
    api_error e;
    const char *tools = "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}]";
    char body[1024];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"w?\"},"
             "{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
             "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}},"
             "{\"id\":\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"not json\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"18\"}],%s,"
             "\"tool_choice\":\"none\",\"parallel_tool_calls\":false}", tools);
    api_request *r = parse(API_CHAT, body, &e);
    if (!r) fail_msg("%s", e.message);
    json_t *calls = json_object_get(json_array_get(r->messages, 1), "tool_calls");
    assert_string_equal(json_string_value(json_object_get(json_array_get(r->messages, 1), "content")), "");
    json_t *args = json_object_get(json_object_get(json_array_get(calls, 0), "function"), "arguments");
    assert_true(json_is_object(args));
    assert_string_equal(json_string_value(json_object_get(args, "city")), "Paris");
    args = json_object_get(json_object_get(json_array_get(calls, 1), "function"), "arguments");
    assert_string_equal(json_string_value(args), "not json");
    assert_int_equal(r->tool_choice, API_TOOL_NONE);
    assert_int_equal(r->parallel_tool_calls, 0);
    api_request_free(r);
    r = parse(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", &e);
    assert_int_equal(r->tool_choice, API_TOOL_AUTO);
    assert_int_equal(r->parallel_tool_calls, 1);
    api_request_free(r);
    /* a named function must be one of the tools; required and named need tools */
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s,"
             "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}}", tools);
    expect_error(API_CHAT, body, 400, "tool_choice");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"}",
                 400, "tool_choice");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"sometimes\"}",
                 400, "tool_choice");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":1}]}]}",
                 400, "messages");
}

static void test_chat_rejects_bad_messages(void **s) {
    (void)s;
    expect_error(API_CHAT, "{}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":{}}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[\"hi\"]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"hi\"}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":3}]}", 400, "messages");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400, "top_logprobs");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}", 400, "top_logprobs");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":2}", 400, "logprobs");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}", 400, "tools");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[1]}", 400, "tools");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":3}", 400, "temperature");
    expect_error(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":1}", 400, "chat_template_kwargs");
}

static void test_length_checks(void **s) {
    (void)s;
    api_error e;
    assert_int_equal(api_check_length(10, -1, 16, 0, &e), 0);
    assert_int_equal(api_check_length(15, -1, 16, 0, &e), 0);
    assert_int_equal(api_check_length(16, -1, 16, 0, &e), -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.code, "context_length_exceeded");
    assert_int_equal(api_check_length(10, 6, 16, 0, &e), 0);
    assert_int_equal(api_check_length(10, 7, 16, 0, &e), -1);
    assert_string_equal(e.param, "max_tokens");
    assert_int_equal(api_check_length(0, -1, 16, 2, &e), -1);
    assert_int_equal(api_default_max_tokens(API_COMPLETION, 10, 100), 16);
    assert_int_equal(api_default_max_tokens(API_COMPLETION, 90, 100), 10);
    assert_int_equal(api_default_max_tokens(API_CHAT, 10, 100), 90);
}

static void test_tokenize_bodies(void **s) {
    (void)s;
    api_error e;
    json_t *o = api_parse_tokenize("{\"prompt\":\"hi\"}", 15, &e);
    assert_non_null(o);
    json_decref(o);
    const char *both = "{\"prompt\":\"hi\",\"messages\":[]}";
    assert_null(api_parse_tokenize(both, strlen(both), &e));
    assert_int_equal(e.status, 400);
    const char *num = "{\"prompt\":3}";
    assert_null(api_parse_tokenize(num, strlen(num), &e));
    const char *msgs = "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"q\"}]}]}";
    o = api_parse_tokenize(msgs, strlen(msgs), &e);
    assert_non_null(o);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(o, "messages"), 0), "content")), "q");
    json_decref(o);
    const char *tok = "{\"tokens\":[1,2,1023]}";
    o = api_parse_detokenize(tok, strlen(tok), 1024, &e);
    assert_non_null(o);
    json_decref(o);
    const char *big = "{\"tokens\":[1,1024]}";
    assert_null(api_parse_detokenize(big, strlen(big), 1024, &e));
    assert_string_equal(e.param, "tokens");
    const char *str = "{\"tokens\":\"1\"}";
    assert_null(api_parse_detokenize(str, strlen(str), 1024, &e));
}

/* ---- stop strings ---------------------------------------------------------------------- */

static void test_stop_scan_finds_earliest_match(void **s) {
    (void)s;
    char *stops[] = {"world", "lo w"};
    size_t emit = 99;
    assert_int_equal(api_stop_scan("hello world", 11, stops, 2, &emit), 1);
    assert_int_equal(emit, 3);  /* "lo w" starts at 3, before "world" at 6 */
    char *one[] = {"\n\n"};
    assert_int_equal(api_stop_scan("a\n\nb", 4, one, 1, &emit), 1);
    assert_int_equal(emit, 1);
}

static void test_stop_scan_holds_back_prefix(void **s) {
    (void)s;
    char *stops[] = {"STOP", "xyz"};
    size_t emit = 0;
    assert_int_equal(api_stop_scan("abcST", 5, stops, 2, &emit), 0);
    assert_int_equal(emit, 3);  /* "ST" could start STOP */
    assert_int_equal(api_stop_scan("abcSTO", 6, stops, 2, &emit), 0);
    assert_int_equal(emit, 3);
    assert_int_equal(api_stop_scan("abcx", 4, stops, 2, &emit), 0);
    assert_int_equal(emit, 3);
    assert_int_equal(api_stop_scan("abcSx", 5, stops, 2, &emit), 0);
    assert_int_equal(emit, 4);  /* "Sx" is no prefix, "x" is */
    assert_int_equal(api_stop_scan("abc", 3, stops, 2, &emit), 0);
    assert_int_equal(emit, 3);
    assert_int_equal(api_stop_scan("abc", 3, stops, 0, &emit), 0);
    assert_int_equal(emit, 3);
    assert_int_equal(api_stop_scan("", 0, stops, 2, &emit), 0);
    assert_int_equal(emit, 0);
}

static void test_stop_scan_multibyte_prefix_is_held_whole(void **s) {
    (void)s;
    char *stops[] = {"\xc3\xa9t\xc3\xa9"};  /* "été" */
    size_t emit = 0;
    /* "a" + "ét" : the whole "ét" is held, the cut lands on a character boundary. */
    assert_int_equal(api_stop_scan("a\xc3\xa9t", 4, stops, 1, &emit), 0);
    assert_int_equal(emit, 1);
    assert_int_equal(api_stop_scan("a\xc3\xa9t\xc3\xa9!", 7, stops, 1, &emit), 1);
    assert_int_equal(emit, 1);
}

/* ---- responses and chunks ------------------------------------------------------------------ */

static char *dump(json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(v);
    return s;
}

static void test_completion_response_shape(void **s) {
    (void)s;
    json_t *choices = json_array();
    json_array_append_new(choices, api_completion_choice(0, "hi", 2, "length", NULL));
    api_usage u = {5, 2, 0, 0, 0, 0, NULL, 0};
    char *got = dump(api_response_json(API_COMPLETION, "cmpl-1", 1700000000, "tiny", choices, &u));
    assert_string_equal(got,
                        "{\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"logprobs\":null,\"text\":\"hi\"}],"
                        "\"created\":1700000000,\"id\":\"cmpl-1\",\"model\":\"tiny\",\"object\":\"text_completion\","
                        "\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":5,\"total_tokens\":7}}");
    free(got);
}

static void test_chat_response_shape_with_spec_usage(void **s) {
    (void)s;
    json_t *choices = json_array();
    json_array_append_new(choices, api_chat_choice(1, "ok", 2, "stop", NULL));
    api_usage u = {3, 4, 1, 12, 9, 3, NULL, 0};
    char *got = dump(api_response_json(API_CHAT, "chatcmpl-x", 1, "m", choices, &u));
    assert_string_equal(got,
                        "{\"choices\":[{\"finish_reason\":\"stop\",\"index\":1,\"logprobs\":null,"
                        "\"message\":{\"content\":\"ok\",\"role\":\"assistant\"}}],\"created\":1,"
                        "\"id\":\"chatcmpl-x\",\"model\":\"m\",\"object\":\"chat.completion\","
                        "\"system_fingerprint\":null,\"usage\":{\"completion_tokens\":4,\"prompt_tokens\":3,"
                        "\"spec_decode\":{\"acceptance_length\":4.0,\"accepted_tokens\":9,\"draft_tokens\":12,"
                        "\"verify_steps\":3},\"total_tokens\":7}}");
    free(got);
    /* with the drafter and the decoding steps: which share of them verified drafts */
    json_t *choices2 = json_array();
    json_array_append_new(choices2, api_chat_choice(0, "ok", 2, "stop", NULL));
    api_usage u2 = {3, 4, 1, 12, 9, 3, "ngram", 12};
    got = dump(api_response_json(API_CHAT, "chatcmpl-y", 1, "m", choices2, &u2));
    assert_non_null(strstr(got, "\"spec_decode\":{\"acceptance_length\":4.0,\"accepted_tokens\":9,"
                                "\"decode_steps\":12,\"draft_tokens\":12,\"drafter\":\"ngram\","
                                "\"speculated_share\":0.25,\"verify_steps\":3}"));
    free(got);
}

static void test_chat_chunk_shapes(void **s) {
    (void)s;
    char *first = dump(api_chunk_json(API_CHAT, "c", 2, "m", 0, 1, "", 0, NULL, NULL, 0));
    assert_string_equal(first,
                        "{\"choices\":[{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},\"finish_reason\":null,"
                        "\"index\":0,\"logprobs\":null}],\"created\":2,\"id\":\"c\",\"model\":\"m\","
                        "\"object\":\"chat.completion.chunk\"}");
    free(first);
    char *last = dump(api_chunk_json(API_CHAT, "c", 2, "m", 3, 0, NULL, 0, "length", NULL, 1));
    assert_string_equal(last,
                        "{\"choices\":[{\"delta\":{},\"finish_reason\":\"length\",\"index\":3,\"logprobs\":null}],"
                        "\"created\":2,\"id\":\"c\",\"model\":\"m\",\"object\":\"chat.completion.chunk\",\"usage\":null}");
    free(last);
    api_usage u = {1, 2, 0, 0, 0, 0, NULL, 0};
    char *usage = dump(api_usage_chunk_json(API_CHAT, "c", 2, "m", &u));
    assert_string_equal(usage,
                        "{\"choices\":[],\"created\":2,\"id\":\"c\",\"model\":\"m\",\"object\":\"chat.completion.chunk\","
                        "\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":1,\"total_tokens\":3}}");
    free(usage);
}

static void test_completion_chunk_shape(void **s) {
    (void)s;
    char *c = dump(api_chunk_json(API_COMPLETION, "cmpl-9", 7, "m", 2, 0, "ab", 2, NULL, NULL, 0));
    assert_string_equal(c,
                        "{\"choices\":[{\"finish_reason\":null,\"index\":2,\"logprobs\":null,\"text\":\"ab\"}],"
                        "\"created\":7,\"id\":\"cmpl-9\",\"model\":\"m\",\"object\":\"text_completion\"}");
    free(c);
}

static void test_logprobs_shapes(void **s) {
    (void)s;
    json_t *lp = api_logprobs_new(API_COMPLETION);
    const char *tt[] = {"a", "b"};
    size_t tl[] = {1, 1};
    float tv[] = {-0.5f, -1.5f};
    api_logprobs_add(lp, API_COMPLETION, "a", 1, -0.5f, 2, tt, tl, tv, 4);
    char *got = dump(lp);
    assert_string_equal(got,
                        "{\"text_offset\":[4],\"token_logprobs\":[-0.5],\"tokens\":[\"a\"],"
                        "\"top_logprobs\":[{\"a\":-0.5,\"b\":-1.5}]}");
    free(got);
    lp = api_logprobs_new(API_CHAT);
    api_logprobs_add(lp, API_CHAT, "\xc3\xa9", 2, -0.25f, 1, tt, tl, tv, 0);
    got = dump(lp);
    assert_string_equal(got,
                        "{\"content\":[{\"bytes\":[195,169],\"logprob\":-0.25,\"token\":\"\xc3\xa9\","
                        "\"top_logprobs\":[{\"bytes\":[97],\"logprob\":-0.5,\"token\":\"a\"}]}],\"refusal\":null}");
    free(got);
}

static void test_error_json_shape(void **s) {
    (void)s;
    api_error e;
    api_fail(&e, 404, NULL, "model", "model_not_found", "no model %s", "x");
    char *got = dump(api_error_json(&e));
    assert_string_equal(got,
                        "{\"error\":{\"code\":\"model_not_found\",\"message\":\"no model x\",\"param\":\"model\","
                        "\"type\":\"invalid_request_error\"}}");
    free(got);
    api_fail(&e, 401, "authentication_error", NULL, NULL, "bad key");
    got = dump(api_error_json(&e));
    assert_string_equal(got, "{\"error\":{\"code\":null,\"message\":\"bad key\",\"param\":null,"
                             "\"type\":\"authentication_error\"}}");
    free(got);
}

static void test_error_message_cut_inside_utf8_stays_valid_json(void **s) {
    (void)s;
    /* A 600-byte model name of 2-byte characters: the 512-byte message is cut mid-char. */
    char body[2048];
    size_t n = (size_t)snprintf(body, sizeof body, "{\"prompt\":[1],\"model\":\"x");
    for (int i = 0; i < 300; i++) n += (size_t)snprintf(body + n, sizeof body - n, "\xc3\xa9");
    snprintf(body + n, sizeof body - n, "\"}");
    api_error e;
    for (int shift = 0; shift < 2; shift++) {
        if (shift) memmove(body + 24, body + 23, strlen(body + 23) + 1), body[23] = 'y';
        assert_null(parse(API_COMPLETION, body, &e));
        assert_int_equal(e.status, 404);
        json_t *j = api_error_json(&e);
        const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        assert_non_null(msg);
        assert_int_equal(strlen(msg), strlen(e.message));
        json_decref(j);
    }
}

static void test_models_json_and_ids(void **s) {
    (void)s;
    char *got = dump(api_models_json("tiny", 5, 4096));
    assert_string_equal(got, "{\"data\":[{\"created\":5,\"id\":\"tiny\",\"max_model_len\":4096,\"object\":\"model\","
                             "\"owned_by\":\"specd\",\"root\":\"tiny\"}],\"object\":\"list\"}");
    free(got);
    char a[64], b[64];
    api_make_id(a, sizeof a, "cmpl-");
    api_make_id(b, sizeof b, "cmpl-");
    assert_int_equal(strlen(a), 5 + 24);
    assert_memory_equal(a, "cmpl-", 5);
    assert_string_not_equal(a, b);
}

static void test_auth_bearer_keys(void **s) {
    (void)s;
    const char *keys[] = {"k1", "secret-two"};
    assert_int_equal(api_auth_ok(NULL, keys, 0), 1);
    assert_int_equal(api_auth_ok("anything", keys, 0), 1);
    assert_int_equal(api_auth_ok("Bearer k1", keys, 2), 1);
    assert_int_equal(api_auth_ok("Bearer secret-two", keys, 2), 1);
    assert_int_equal(api_auth_ok(NULL, keys, 2), 0);
    assert_int_equal(api_auth_ok("k1", keys, 2), 0);
    assert_int_equal(api_auth_ok("Bearer ", keys, 2), 0);
    assert_int_equal(api_auth_ok("Bearer k", keys, 2), 0);
    assert_int_equal(api_auth_ok("Bearer k1k1", keys, 2), 0);
    assert_int_equal(api_auth_ok("Bearer k2", keys, 2), 0);
    assert_int_equal(api_auth_ok("Bearer secret-twO", keys, 2), 0);
    /* the scheme is case-insensitive (RFC 7235), the key is not */
    assert_int_equal(api_auth_ok("bearer k1", keys, 2), 1);
    assert_int_equal(api_auth_ok("BEARER secret-two", keys, 2), 1);
    assert_int_equal(api_auth_ok("bearer K1", keys, 2), 0);
    assert_int_equal(api_auth_ok("Bearerk1", keys, 2), 0);
}

/* Client-chosen text in log lines: control bytes, backslashes and invalid UTF-8 become
 * escapes, valid UTF-8 stays, and the output is cut at a whole escape. */
static void test_log_escape_keeps_lines_whole(void **s) {
    (void)s;
    char out[64];
    assert_int_equal(log_escape("/v1/x\r\nFAKE 200", out, sizeof out), 21);
    assert_string_equal(out, "/v1/x\\x0d\\x0aFAKE 200");
    log_escape("a\\b\x7f\x01", out, sizeof out);
    assert_string_equal(out, "a\\\\b\\x7f\\x01");
    log_escape("caf\xc3\xa9 \xe7\x8c\xab", out, sizeof out);     /* valid: kept */
    assert_string_equal(out, "caf\xc3\xa9 \xe7\x8c\xab");
    log_escape("\xc3(\xff\xed\xa0\x80\xf0\x82\x82\xac", out, sizeof out);  /* invalid, surrogate, overlong */
    assert_string_equal(out, "\\xc3(\\xff\\xed\\xa0\\x80\\xf0\\x82\\x82\\xac");
    char small[8];
    log_escape("ab\ncd", small, sizeof small);   /* "ab\x0a" needs 7 bytes + NUL */
    assert_string_equal(small, "ab\\x0a");
    log_escape("abcdefgh", small, sizeof small);
    assert_true(strlen(small) < sizeof small);
}

/* ---- SSE --------------------------------------------------------------------------------- */

static void test_sse_event_framing(void **s) {
    (void)s;
    json_t *v = json_pack("{s:s}", "t", "a\nb");
    size_t len = 0;
    char *ev = api_sse_event(v, &len);
    json_decref(v);
    assert_string_equal(ev, "data: {\"t\":\"a\\nb\"}\n\n");
    assert_int_equal(len, strlen(ev));
    free(ev);
    assert_string_equal(API_SSE_DONE, "data: [DONE]\n\n");
}

typedef struct { int parks, wakes; } hook_counts;
static void count_park(void *a) { ((hook_counts *)a)->parks++; }
static void count_wake(void *a) { ((hook_counts *)a)->wakes++; }

static void test_chan_parks_when_empty_and_wakes_on_push(void **s) {
    (void)s;
    hook_counts h = {0, 0};
    sse_chan *c = sse_chan_new();
    sse_chan_bind(c, count_park, count_wake, &h);
    char buf[8];
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), 0);
    assert_int_equal(h.parks, 1);
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), 0);
    assert_int_equal(h.parks, 1);  /* already parked: no second suspend */
    assert_int_equal(sse_chan_push(c, "hello world", 11), 0);
    assert_int_equal(h.wakes, 1);
    assert_int_equal(sse_chan_push(c, "!", 1), 0);
    assert_int_equal(h.wakes, 1);  /* not parked: no resume of a running connection */
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), 8);
    assert_memory_equal(buf, "hello wo", 8);
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), 4);
    assert_memory_equal(buf, "rld!", 4);
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), 0);
    assert_int_equal(h.parks, 2);
    sse_chan_close(c, 200);
    assert_int_equal(h.wakes, 2);
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), -1);
    sse_chan_unref(c);
}

static void test_chan_detached_drops_and_never_wakes(void **s) {
    (void)s;
    hook_counts h = {0, 0};
    sse_chan *c = sse_chan_new();
    sse_chan_ref(c);  /* loop's reference */
    sse_chan_bind(c, count_park, count_wake, &h);
    char buf[4];
    assert_int_equal(sse_chan_pull(c, buf, sizeof buf), 0);
    sse_chan_detach(c);
    sse_chan_unref(c);  /* connection's reference */
    assert_int_equal(sse_chan_push(c, "x", 1), SPECD_ECANCELED);
    sse_chan_close(c, 200);
    assert_int_equal(h.wakes, 0);
    assert_int_equal(sse_chan_detached(c), 1);
    sse_chan_unref(c);
}

static void test_chan_take_whole_body(void **s) {
    (void)s;
    hook_counts h = {0, 0};
    sse_chan *c = sse_chan_new();
    sse_chan_bind(c, count_park, count_wake, &h);
    char *data = NULL;
    size_t len = 0;
    int status = 0;
    assert_int_equal(sse_chan_take_if_closed(c, &data, &len, &status), 0);
    assert_int_equal(h.parks, 1);
    sse_chan_push(c, "{\"a\":1}", 7);
    assert_int_equal(h.wakes, 1);
    sse_chan_close(c, 201);
    assert_int_equal(h.wakes, 1);
    assert_int_equal(sse_chan_take_if_closed(c, &data, &len, &status), 1);
    assert_int_equal(status, 201);
    assert_int_equal(len, 7);
    assert_memory_equal(data, "{\"a\":1}", 7);
    free(data);
    sse_chan_unref(c);
}

static void test_chan_push_close_wakes_once(void **s) {
    (void)s;
    hook_counts h = {0, 0};
    sse_chan *c = sse_chan_new();
    sse_chan_bind(c, count_park, count_wake, &h);
    char *data = NULL;
    size_t len = 0;
    int status = 0;
    assert_int_equal(sse_chan_take_if_closed(c, &data, &len, &status), 0);
    assert_int_equal(sse_chan_push_close(c, "{}", 2, 404), 0);
    assert_int_equal(h.wakes, 1);
    assert_int_equal(sse_chan_take_if_closed(c, &data, &len, &status), 1);
    assert_int_equal(status, 404);
    assert_int_equal(len, 2);
    assert_memory_equal(data, "{}", 2);
    free(data);
    assert_int_equal(sse_chan_push(c, "x", 1), SPECD_ESTATE);  /* closed */
    sse_chan_unref(c);
}

/* ---- config ----------------------------------------------------------------------------------- */

static const char *const *fake_env;
static const char *env_lookup(const char *name) {
    for (int i = 0; fake_env && fake_env[i]; i += 2)
        if (!strcmp(fake_env[i], name)) return fake_env[i + 1];
    return NULL;
}

static char cfg_path[256];

static void write_cfg(const char *text) {
    snprintf(cfg_path, sizeof cfg_path, "/tmp/specd_test_cfg_%d.json", (int)getpid());
    FILE *f = fopen(cfg_path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_config_defaults_are_safe(void **s) {
    (void)s;
    srv_config c;
    srv_config_action a;
    char err[256] = "";
    char *argv[] = {"serve", NULL};
    fake_env = NULL;
    assert_int_equal(srv_config_load(&c, &a, 1, argv, env_lookup, err, sizeof err), 0);
    assert_string_equal(c.host, "127.0.0.1");
    assert_int_equal(c.port, 8000);
    assert_int_equal(c.n_api_keys, 0);
    assert_string_equal(c.device, "cpu");
    assert_int_equal(c.max_seq_len, 4096);
    assert_int_equal(a.print_config, 0);
}

static void test_config_precedence_cli_env_file_default(void **s) {
    (void)s;
    write_cfg("{\"port\": 1111, \"max_batch\": 7, \"max_seq_len\": 333, \"log_level\": \"warn\","
              " \"api_keys\": [\"filekey\"], \"_comment\": \"ignored\"}");
    const char *env[] = {"SPECD_PORT", "2222", "SPECD_MAX_BATCH", "9", "SPECD_API_KEY", "e1,e2",
                         "SPECD_CONFIG", cfg_path, NULL};
    fake_env = env;
    char *argv[] = {"serve", "--port", "3333", "--model", "m.gguf", "--api-key", "c1", "--api-key", "c2", NULL};
    srv_config c;
    srv_config_action a;
    char err[256] = "";
    assert_int_equal(srv_config_load(&c, &a, 9, argv, env_lookup, err, sizeof err), 0);
    assert_int_equal(c.port, 3333);            /* cli over env over file */
    assert_int_equal(c.max_batch, 9);          /* env over file */
    assert_int_equal(c.max_seq_len, 333);      /* file over default */
    assert_string_equal(c.log_level, "warn");
    assert_int_equal(c.max_queued, 1024);      /* default */
    assert_string_equal(c.model, "m.gguf");
    assert_int_equal(c.n_api_keys, 2);         /* cli list replaces env list */
    assert_string_equal(c.api_keys[0], "c1");
    assert_string_equal(c.api_keys[1], "c2");
    assert_string_equal(a.config_path, cfg_path);
    /* Without the CLI keys the env list wins over the file's. */
    char *argv2[] = {"serve", NULL};
    assert_int_equal(srv_config_load(&c, &a, 1, argv2, env_lookup, err, sizeof err), 0);
    assert_int_equal(c.n_api_keys, 2);
    assert_string_equal(c.api_keys[1], "e2");
    assert_int_equal(c.port, 2222);
    fake_env = NULL;
    /* --config on the command line, no env: the file's values. */
    char *argv3[] = {"serve", "--config", cfg_path, NULL};
    assert_int_equal(srv_config_load(&c, &a, 3, argv3, env_lookup, err, sizeof err), 0);
    assert_int_equal(c.port, 1111);
    assert_int_equal(c.n_api_keys, 1);
    assert_string_equal(c.api_keys[0], "filekey");
    unlink(cfg_path);
}

static void test_config_rejects_unknown_and_bad_values(void **s) {
    (void)s;
    srv_config c;
    srv_config_action a;
    char err[512] = "";
    fake_env = NULL;
    write_cfg("{\"port\": 1, \"prot\": 2}");
    char *argv[] = {"serve", "--config", cfg_path, NULL};
    assert_int_equal(srv_config_load(&c, &a, 3, argv, env_lookup, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "unknown key 'prot'"));
    write_cfg("{\"port\": \"80\"}");
    assert_int_equal(srv_config_load(&c, &a, 3, argv, env_lookup, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "port"));
    write_cfg("{\"port\": 70000}");
    assert_int_equal(srv_config_load(&c, &a, 3, argv, env_lookup, err, sizeof err), SPECD_EINVAL);
    write_cfg("{\"port\": ");
    assert_int_equal(srv_config_load(&c, &a, 3, argv, env_lookup, err, sizeof err), SPECD_EFORMAT);
    write_cfg("{\"device\": \"tpu\"}");
    assert_int_equal(srv_config_load(&c, &a, 3, argv, env_lookup, err, sizeof err), SPECD_EINVAL);
    unlink(cfg_path);
    char *missing[] = {"serve", "--config", "/nonexistent/specd.json", NULL};
    assert_int_equal(srv_config_load(&c, &a, 3, missing, env_lookup, err, sizeof err), SPECD_EIO);
    char *bad_flag[] = {"serve", "--prot", "1", NULL};
    assert_int_equal(srv_config_load(&c, &a, 3, bad_flag, env_lookup, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "--prot"));
    char *no_value[] = {"serve", "--port", NULL};
    assert_int_equal(srv_config_load(&c, &a, 2, no_value, env_lookup, err, sizeof err), SPECD_EINVAL);
    char *bad_int[] = {"serve", "--port", "80x", NULL};
    assert_int_equal(srv_config_load(&c, &a, 3, bad_int, env_lookup, err, sizeof err), SPECD_EINVAL);
    const char *env[] = {"SPECD_MEM_FRACTION", "1.5", NULL};
    fake_env = env;
    char *plain[] = {"serve", NULL};
    assert_int_equal(srv_config_load(&c, &a, 1, plain, env_lookup, err, sizeof err), SPECD_EINVAL);
    assert_non_null(strstr(err, "SPECD_MEM_FRACTION"));
    fake_env = NULL;
}

static void test_config_print_and_switches(void **s) {
    (void)s;
    srv_config c;
    srv_config_action a;
    char err[256];
    fake_env = NULL;
    char *argv[] = {"serve", "--print-config", "--log-json", "--api-key", "secret", "--mem-fraction", "0.5", NULL};
    assert_int_equal(srv_config_load(&c, &a, 7, argv, env_lookup, err, sizeof err), 0);
    assert_int_equal(a.print_config, 1);
    assert_int_equal(c.log_json, 1);
    char *js = srv_config_to_json(&c);
    json_t *o = json_loads(js, 0, NULL);
    free(js);
    assert_non_null(o);
    assert_true(json_real_value(json_object_get(o, "mem_fraction")) == 0.5);
    assert_true(json_is_true(json_object_get(o, "log_json")));
    assert_string_equal(json_string_value(json_array_get(json_object_get(o, "api_keys"), 0)), "<redacted>");
    assert_int_equal(json_integer_value(json_object_get(o, "port")), 8000);
    json_decref(o);
}

static void test_config_example_file_matches_defaults(void **s) {
    (void)s;
    /* config/specd.json documents every key with its default: loading it must change
     * nothing, and it must name every key --print-config prints. */
    FILE *f = fopen("config/specd.json", "rb");
    if (!f) f = fopen("../config/specd.json", "rb");
    assert_non_null(f);
    char text[16384];
    size_t n = fread(text, 1, sizeof text, f);
    fclose(f);
    srv_config d, c;
    srv_config_defaults(&d);
    srv_config_defaults(&c);
    char err[256] = "";
    assert_int_equal(srv_config_apply_json(&c, text, n, "specd.json", err, sizeof err), 0);
    char *a = srv_config_to_json(&d), *b = srv_config_to_json(&c);
    assert_string_equal(a, b);
    json_t *file = json_loadb(text, n, 0, NULL), *eff = json_loads(a, 0, NULL);
    const char *k;
    json_t *v;
    json_object_foreach(eff, k, v) if (!json_object_get(file, k)) fail_msg("config/specd.json lacks key %s", k);
    json_decref(file);
    json_decref(eff);
    free(a);
    free(b);
}

/* ---- metrics ------------------------------------------------------------------------------------ */

static void test_metrics_text(void **s) {
    (void)s;
    metrics *m = metrics_create("tiny");
    engine_stats st;
    memset(&st, 0, sizeof st);
    st.running = 3;
    st.waiting = 2;
    st.kv_blocks_total = 200;
    st.kv_blocks_used = 50;
    st.prompt_tokens = 123;
    st.generation_tokens = 45;
    st.spec_drafts = 10;
    st.spec_draft_tokens = 40;
    st.spec_accepted_tokens = 25;
    st.num_draft_tokens = 4;
    st.spec_accepted_per_pos[0] = 9;
    st.spec_drafter = "ngram";
    st.spec_steps_decoding = 30;
    st.spec_steps_speculated = 8;
    st.spec_rows_decoding = 70;
    metrics_set_engine(m, &st);
    metrics_observe_ttft(m, 0.003);
    metrics_observe_ttft(m, 100.0);
    metrics_request_finished(m, "stop");
    metrics_request_finished(m, "stop");
    metrics_request_finished(m, "length");
    char *t = metrics_render(m);
    assert_non_null(t);
    assert_non_null(strstr(t, "specd:num_requests_running{model_name=\"tiny\"} 3\n"));
    assert_non_null(strstr(t, "specd:num_requests_waiting{model_name=\"tiny\"} 2\n"));
    assert_non_null(strstr(t, "specd:kv_cache_usage_perc{model_name=\"tiny\"} 0.25\n"));
    assert_non_null(strstr(t, "specd:kv_blocks_used{model_name=\"tiny\"} 50\n"));
    assert_non_null(strstr(t, "specd:prompt_tokens_total{model_name=\"tiny\"} 123\n"));
    assert_non_null(strstr(t, "specd:generation_tokens_total{model_name=\"tiny\"} 45\n"));
    assert_non_null(strstr(t, "specd:request_success_total{finished_reason=\"stop\",model_name=\"tiny\"} 2\n"));
    assert_non_null(strstr(t, "specd:request_success_total{finished_reason=\"length\",model_name=\"tiny\"} 1\n"));
    assert_non_null(strstr(t, "# TYPE specd:time_to_first_token_seconds histogram\n"));
    assert_non_null(strstr(t, "specd:time_to_first_token_seconds_bucket{le=\"0.001\",model_name=\"tiny\"} 0\n"));
    assert_non_null(strstr(t, "specd:time_to_first_token_seconds_bucket{le=\"0.005\",model_name=\"tiny\"} 1\n"));
    assert_non_null(strstr(t, "specd:time_to_first_token_seconds_bucket{le=\"80\",model_name=\"tiny\"} 1\n"));
    assert_non_null(strstr(t, "specd:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"tiny\"} 2\n"));
    assert_non_null(strstr(t, "specd:time_to_first_token_seconds_count{model_name=\"tiny\"} 2\n"));
    assert_non_null(strstr(t, "specd:time_to_first_token_seconds_sum{model_name=\"tiny\"} 100.003"));
    assert_non_null(strstr(t, "specd:spec_decode_num_drafts_total{model_name=\"tiny\"} 10\n"));
    assert_non_null(strstr(t, "specd:spec_decode_num_draft_tokens_total{model_name=\"tiny\"} 40\n"));
    assert_non_null(strstr(t, "specd:spec_decode_num_accepted_tokens_total{model_name=\"tiny\"} 25\n"));
    assert_non_null(strstr(t, "specd:spec_decode_acceptance_length{model_name=\"tiny\"} 3.5\n"));
    assert_non_null(strstr(t, "specd:spec_decode_num_accepted_tokens_per_pos{position=\"0\",model_name=\"tiny\"} 9\n"));
    assert_non_null(strstr(t, "specd:spec_decode_num_decode_steps_total{model_name=\"tiny\"} 30\n"));
    assert_non_null(strstr(t, "specd:spec_decode_num_speculated_steps_total{model_name=\"tiny\"} 8\n"));
    assert_non_null(strstr(t, "specd:spec_decode_num_decode_rows_total{model_name=\"tiny\"} 70\n"));
    assert_non_null(strstr(t, "specd:spec_decode_drafter{kind=\"ngram\",model_name=\"tiny\"} 1\n"));
    assert_non_null(strstr(t, "# TYPE specd:inter_token_latency_seconds histogram\n"));
    assert_non_null(strstr(t, "# TYPE specd:e2e_request_latency_seconds histogram\n"));
    free(t);
    metrics_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_defaults_and_text_prompt),
        cmocka_unit_test(test_completion_token_prompts_and_fields),
        cmocka_unit_test(test_single_token_array_is_one_prompt),
        cmocka_unit_test(test_null_fields_mean_default),
        cmocka_unit_test(test_echo_logprobs_ask_for_prompt_logprobs),
        cmocka_unit_test(test_completion_rejects_bad_fields),
        cmocka_unit_test(test_constraint_fields_compile_into_the_request),
        cmocka_unit_test(test_invalid_json_bodies),
        cmocka_unit_test(test_chat_messages_normalised),
        cmocka_unit_test(test_chat_tool_turns_and_tool_choice),
        cmocka_unit_test(test_chat_rejects_bad_messages),
        cmocka_unit_test(test_length_checks),
        cmocka_unit_test(test_tokenize_bodies),
        cmocka_unit_test(test_stop_scan_finds_earliest_match),
        cmocka_unit_test(test_stop_scan_holds_back_prefix),
        cmocka_unit_test(test_stop_scan_multibyte_prefix_is_held_whole),
        cmocka_unit_test(test_completion_response_shape),
        cmocka_unit_test(test_chat_response_shape_with_spec_usage),
        cmocka_unit_test(test_chat_chunk_shapes),
        cmocka_unit_test(test_completion_chunk_shape),
        cmocka_unit_test(test_logprobs_shapes),
        cmocka_unit_test(test_error_json_shape),
        cmocka_unit_test(test_error_message_cut_inside_utf8_stays_valid_json),
        cmocka_unit_test(test_models_json_and_ids),
        cmocka_unit_test(test_auth_bearer_keys),
        cmocka_unit_test(test_log_escape_keeps_lines_whole),
        cmocka_unit_test(test_sse_event_framing),
        cmocka_unit_test(test_chan_parks_when_empty_and_wakes_on_push),
        cmocka_unit_test(test_chan_detached_drops_and_never_wakes),
        cmocka_unit_test(test_chan_take_whole_body),
        cmocka_unit_test(test_chan_push_close_wakes_once),
        cmocka_unit_test(test_config_defaults_are_safe),
        cmocka_unit_test(test_config_precedence_cli_env_file_default),
        cmocka_unit_test(test_config_rejects_unknown_and_bad_values),
        cmocka_unit_test(test_config_print_and_switches),
        cmocka_unit_test(test_config_example_file_matches_defaults),
        cmocka_unit_test(test_metrics_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
