/* Unit tests of the Messages API mapping (server/api_messages.c): the request's blocks as
 * chat messages, tools and choices; the error shape; the content blocks and events built
 * from chat deltas (text, thinking, calls streamed in fragments or whole), and the stop
 * reasons. No HTTP, no engine. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_messages.h"

static const api_limits LIM = {"tiny", 1024, 16, 0};

static api_request *parse(const char *body, api_error *e) {
    memset(e, 0, sizeof *e);
    return api_msg_parse(body, strlen(body), &LIM, e);
}

static const char *str_at(json_t *o, const char *path0, const char *key) {
    return json_string_value(json_object_get(json_object_get(o, path0), key));
}

static void test_parse_maps_blocks(void **state) {
    (void)state;
    api_error e;
    api_request *r = parse(
        "{\"model\":\"tiny\",\"max_tokens\":7,\"system\":[{\"type\":\"text\",\"text\":\"Be brief.\"}],"
        "\"stop_sequences\":[\"END\"],\"top_k\":5,\"messages\":["
        "{\"role\":\"user\",\"content\":\"Weather?\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":\"hm\",\"signature\":\"\"},"
        "{\"type\":\"text\",\"text\":\"Let me look.\"},"
        "{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"w\",\"input\":{\"city\":\"Paris\"}}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"toolu_1\",\"content\":\"22C\"},"
        "{\"type\":\"text\",\"text\":\"Thanks\"}]}],"
        "\"tools\":[{\"name\":\"w\",\"input_schema\":{\"type\":\"object\"}}],\"tool_choice\":{\"type\":\"any\"}}",
        &e);
    assert_non_null(r);
    assert_int_equal(r->messages_api, 1);
    assert_int_equal(r->max_tokens, 7);
    assert_int_equal(r->n_stop, 1);
    assert_string_equal(r->stop[0], "END");
    assert_int_equal(r->sp.top_k, 5);
    assert_int_equal(r->tool_choice, API_TOOL_REQUIRED);
    json_t *m = r->messages;
    assert_int_equal(json_array_size(m), 5);   /* system, user, assistant, tool, user */
    const char *roles[] = {"system", "user", "assistant", "tool", "user"};
    for (int i = 0; i < 5; i++) assert_string_equal(json_string_value(json_object_get(json_array_get(m, i), "role")), roles[i]);
    assert_string_equal(json_string_value(json_object_get(json_array_get(m, 0), "content")), "Be brief.");
    json_t *as = json_array_get(m, 2), *call = json_array_get(json_object_get(as, "tool_calls"), 0);
    assert_string_equal(json_string_value(json_object_get(as, "content")), "Let me look.");   /* thinking dropped */
    assert_string_equal(json_string_value(json_object_get(call, "id")), "toolu_1");
    assert_string_equal(str_at(call, "function", "name"), "w");
    /* (normalised chat messages hold the arguments parsed, as chat templates read them) */
    json_t *args = json_object_get(json_object_get(call, "function"), "arguments");
    assert_string_equal(json_string_value(json_object_get(args, "city")), "Paris");
    json_t *tool = json_array_get(m, 3);
    assert_string_equal(json_string_value(json_object_get(tool, "tool_call_id")), "toolu_1");
    assert_string_equal(json_string_value(json_object_get(tool, "content")), "22C");
    assert_string_equal(json_string_value(json_object_get(json_array_get(m, 4), "content")), "Thanks");
    assert_int_equal(json_array_size(r->tools), 1);
    api_request_free(r);
    /* a named tool, and no parallel calls */
    r = parse("{\"model\":\"tiny\",\"max_tokens\":3,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
              "\"tools\":[{\"name\":\"w\",\"input_schema\":{\"type\":\"object\"}}],"
              "\"tool_choice\":{\"type\":\"tool\",\"name\":\"w\",\"disable_parallel_tool_use\":true}}", &e);
    assert_non_null(r);
    assert_int_equal(r->tool_choice, API_TOOL_NAMED);
    assert_string_equal(r->tool_name, "w");
    assert_int_equal(r->parallel_tool_calls, 0);
    api_request_free(r);
}

/* Each bad body is a 400 whose message names the field; the error is in the Messages shape. */
static void test_parse_errors(void **state) {
    (void)state;
    static const char *const bad[][2] = {
        {"{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", "max_tokens"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[]}", "messages"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image\"}]}]}",
         "image"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\","
         "\"id\":\"a\",\"name\":\"w\",\"input\":\"no\"}]}]}", "input"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\"}]}]}",
         "tool_use_id"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":"
         "[{\"type\":\"bash_20250124\",\"name\":\"bash\"}]}", "bash_20250124"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"mcp_servers\":[{}]}",
         "mcp_servers"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"output_config\":"
         "{\"format\":{\"type\":\"xml\"}}}", "json_schema"},
        {"{\"model\":\"tiny\",\"max_tokens\":1,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop_sequences\":\"x\"}",
         "stop_sequences"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        api_error e;
        assert_null(parse(bad[i][0], &e));
        assert_int_equal(e.status, 400);
        json_t *v = api_msg_error_json(&e);
        assert_string_equal(json_string_value(json_object_get(v, "type")), "error");
        assert_string_equal(str_at(v, "error", "type"), "invalid_request_error");
        if (!strstr(str_at(v, "error", "message"), bad[i][1])) fail_msg("case %zu: '%s' lacks '%s'", i, e.message, bad[i][1]);
        json_decref(v);
    }
    api_error e = {.status = 404};
    snprintf(e.message, sizeof e.message, "no such model");
    json_t *v = api_msg_error_json(&e);
    assert_string_equal(str_at(v, "error", "type"), "not_found_error");
    json_decref(v);
}

static const char *ev_type(json_t *ev, size_t i) { return json_string_value(json_object_get(json_array_get(ev, i), "type")); }

/* Streamed deltas: thinking, then text, then a call in fragments: the blocks open and
 * close in order, the deltas carry the pieces, and the message holds the whole. */
static void test_stream_blocks(void **state) {
    (void)state;
    api_mstream *s = api_mstream_new("msg_1", "tiny");
    json_t *ev = json_array();
    api_mstream_open(s, 12, ev);
    const char *deltas[] = {
        "{\"reasoning_content\":\"let me \"}", "{\"reasoning_content\":\"think\"}", "{\"content\":\"Hi\"}",
        "{\"tool_calls\":[{\"index\":0,\"id\":\"call_a\",\"type\":\"function\",\"function\":{\"name\":\"w\",\"arguments\":\"\"}}]}",
        "{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\":\"}}]}",
        "{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"Rome\\\"}\"}}]}",
    };
    for (size_t i = 0; i < sizeof deltas / sizeof deltas[0]; i++) {
        json_t *d = json_loads(deltas[i], 0, NULL);
        api_mstream_feed(s, d, ev);
        json_decref(d);
    }
    json_t *msg = api_mstream_close(s, "tool_calls", NULL, 12, 9, ev);
    const char *want[] = {"message_start", "content_block_start", "content_block_delta", "content_block_delta",
                          "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                          "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                          "message_delta", "message_stop"};
    assert_int_equal(json_array_size(ev), sizeof want / sizeof want[0]);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) assert_string_equal(ev_type(ev, i), want[i]);
    assert_string_equal(str_at(json_array_get(ev, 2), "delta", "type"), "thinking_delta");
    assert_string_equal(str_at(json_array_get(ev, 3), "delta", "thinking"), "think");
    assert_string_equal(str_at(json_array_get(ev, 6), "delta", "type"), "text_delta");
    assert_string_equal(str_at(json_array_get(ev, 6), "delta", "text"), "Hi");
    assert_int_equal(json_integer_value(json_object_get(json_array_get(ev, 9), "index")), 2);
    assert_string_equal(str_at(json_array_get(ev, 9), "delta", "type"), "input_json_delta");
    assert_string_equal(str_at(json_array_get(ev, 12), "delta", "stop_reason"), "tool_use");
    json_t *c = json_object_get(msg, "content");
    assert_int_equal(json_array_size(c), 3);
    assert_string_equal(json_string_value(json_object_get(json_array_get(c, 0), "thinking")), "let me think");
    assert_string_equal(json_string_value(json_object_get(json_array_get(c, 1), "text")), "Hi");
    json_t *use = json_array_get(c, 2);
    assert_string_equal(json_string_value(json_object_get(use, "id")), "call_a");
    assert_string_equal(json_string_value(json_object_get(json_object_get(use, "input"), "city")), "Rome");
    assert_int_equal(json_integer_value(json_object_get(json_object_get(msg, "usage"), "input_tokens")), 12);
    json_decref(msg);
    json_decref(ev);
    api_mstream_free(s);
}

/* One whole message (not streamed): the stop reasons. */
static void test_stop_reasons(void **state) {
    (void)state;
    static const char *const cases[][4] = {
        {"stop", NULL, "end_turn", NULL}, {"length", NULL, "max_tokens", NULL},
        {"stop", "END", "stop_sequence", "END"}, {"length", "END", "max_tokens", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        api_mstream *s = api_mstream_new("msg_2", "tiny");
        json_t *d = json_loads("{\"content\":\"ok\"}", 0, NULL);
        api_mstream_feed(s, d, NULL);
        json_decref(d);
        json_t *msg = api_mstream_close(s, cases[i][0], cases[i][1], 1, 1, NULL);
        assert_string_equal(json_string_value(json_object_get(msg, "stop_reason")), cases[i][2]);
        json_t *seq = json_object_get(msg, "stop_sequence");
        if (cases[i][3]) assert_string_equal(json_string_value(seq), cases[i][3]);
        else assert_true(json_is_null(seq));
        json_decref(msg);
        api_mstream_free(s);
    }
    /* a whole call (no index) makes a tool_use block and the reason, whatever the finish */
    api_mstream *s = api_mstream_new("msg_3", "tiny");
    json_t *d = json_loads("{\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"w\","
                           "\"arguments\":\"{\\\"a\\\":1}\"}}]}", 0, NULL);
    api_mstream_feed(s, d, NULL);
    json_decref(d);
    json_t *msg = api_mstream_close(s, "stop", NULL, 1, 1, NULL);
    assert_string_equal(json_string_value(json_object_get(msg, "stop_reason")), "tool_use");
    json_t *use = json_array_get(json_object_get(msg, "content"), 0);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(use, "input"), "a")), 1);
    json_decref(msg);
    api_mstream_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_maps_blocks),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_stream_blocks),
        cmocka_unit_test(test_stop_reasons),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
