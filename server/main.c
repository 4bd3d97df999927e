/* specd: one binary, subcommands (like git). main() only dispatches. */
#include <stdio.h>
#include <string.h>

#include "server/cmd.h"
#include "server/version.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} cmds[] = {
    {"serve", cmd_serve, "run the OpenAI-compatible HTTP server"},
    {"generate", cmd_generate, "generate tokens for one prompt (no HTTP)"},
    {"tokenize", cmd_tokenize, "text -> token ids"},
    {"detokenize", cmd_detokenize, "token ids -> text"},
    {"render", cmd_render, "render a chat template"},
    {"bench", cmd_bench, "measure engine throughput (prefill / decode / speculative)"},
    {"loadgen", cmd_loadgen, "stream requests to an OpenAI-compatible server, report tok/s, TTFT, ITL"},
};

static void usage(FILE *f) {
    fprintf(f, "specd %s - OpenAI-compatible LLM inference server\n\n"
               "usage: specd <command> [options]   (specd <command> --help for details)\n\n"
               "commands:\n", SPECD_VERSION);
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %-11s %s\n", cmds[i].name, cmds[i].help);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("specd %s\n", SPECD_VERSION);
        return 0;
    }
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(argv[1], cmds[i].name)) return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "specd: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
