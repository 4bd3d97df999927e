/* libFuzzer target for chat templates (engine/text/tmpl*.c): a template comes from the
 * model file (GGUF tokenizer.chat_template, tokenizer_config.json), so any bytes a model
 * author or a corrupted file can put there must parse to a template or to a message.
 * The input is the template source; a parsed template is rendered with three fixed
 * conversations (plain turns; a system prompt, tool calls and a tool result with tools
 * given; content as a list of parts) as the server renders them (tmpl_render_chat with
 * bos / eos tokens and add_generation_prompt), at a fixed time for strftime_now.
 * Invariants (abort() on violation): a parse failure and a render failure carry a
 * non-empty message; a render's output is NUL-terminated at its reported length. Hangs
 * and runaway memory are caught by libFuzzer's -timeout and -rss_limit_mb.
 * Seeds: tests/fuzz/seeds_tmpl and the fixture models' templates (scripts/fuzz.sh).
 * Build and run: scripts/fuzz.sh tmpl SECONDS. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tmpl.h"

#define CHECK(c)                                                                                  \
    do {                                                                                          \
        if (!(c)) {                                                                               \
            fprintf(stderr, "fuzz_tmpl: invariant failed at %s:%d: %s\n", __FILE__, __LINE__, #c); \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

static const char *const CONVS[] = {
    "[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Hello!\"},"
    "{\"role\":\"user\",\"content\":\"What is 2+2?\"}]",
    "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Weather in Paris?\"},"
    "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
    "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]},"
    "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"18 C\"}]",
    "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"part one \"},{\"type\":\"text\",\"text\":\"two\"}]}]",
};
static const char TOOLS[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather now\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}]";

static json_t *convs[3], *tools;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    for (int i = 0; i < 3; i++) {
        convs[i] = json_loads(CONVS[i], 0, NULL);
        CHECK(convs[i] != NULL);
    }
    tools = json_loads(TOOLS, 0, NULL);
    CHECK(tools != NULL);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[512] = "";
    tmpl_template *t = tmpl_parse((const char *)data, size, err, sizeof err);
    if (!t) {
        CHECK(err[0]);
        return 0;
    }
    for (int i = 0; i < 3; i++) {
        char *out = NULL;
        size_t len = 0;
        json_t *extra = json_pack("{s:b}", "enable_thinking", i == 1);
        json_t *ctx = tmpl_chat_context(convs[i], i == 1 ? tools : NULL, i != 2, "<s>", "</s>", extra);
        json_decref(extra);
        CHECK(ctx != NULL);
        err[0] = 0;
        int rc = tmpl_render_at(t, ctx, 1764979200 /* 2025-12-06 */, &out, &len, err, sizeof err);
        json_decref(ctx);
        if (rc) {
            CHECK(err[0]);
            CHECK(out == NULL);
            continue;
        }
        CHECK(out != NULL && out[len] == 0);
        free(out);
    }
    tmpl_free(t);
    return 0;
}
