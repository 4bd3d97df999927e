/* `specd render`: render a chat template from a shell exactly as HF transformers'
 * apply_chat_template(..., tokenize=False) would, printing the text with nothing added
 * (no trailing newline). A template that raises prints its message to stderr, exit 1.
 *
 * The template comes from --template FILE, or from --model PATH: a checkpoint directory
 * (chat_template.jinja, else tokenizer_config.json "chat_template", a string or a list of
 * {name, template} where "default" is used) or a .gguf file (tokenizer.chat_template).
 * bos/eos tokens default to the model's when --model is given. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/core/err.h"
#include "engine/text/tmpl.h"
#include "engine/text/tokenizer.h"
#include "server/cli.h"
#include "server/cmd.h"

static const char RENDER_HELP[] =
    "usage: specd render (--template FILE.jinja | --model PATH) --messages FILE.json\n"
    "                    [--tools FILE.json] [--add-generation-prompt] [--bos-token S]\n"
    "                    [--eos-token S] [--var KEY=JSON ...]\n"
    "\n"
    "Render a chat template as HF transformers does and print the text exactly.\n"
    "\n"
    "  --template FILE          Jinja2 chat template file\n"
    "  --model PATH             checkpoint directory or .gguf file holding the template\n"
    "  --messages FILE          JSON array of messages (or an object with \"messages\")\n"
    "  --tools FILE             JSON array of tool definitions\n"
    "  --add-generation-prompt  end with the assistant turn header\n"
    "  --bos-token S            value of bos_token (default: the model's)\n"
    "  --eos-token S            value of eos_token (default: the model's)\n"
    "  --var KEY=JSON           extra template variable, e.g. --var enable_thinking=false\n";

/* tokenizer_config.json token fields are a string or an AddedToken {"content": ...}. */
static const char *token_text(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

/* Template and special tokens from a checkpoint directory. Caller frees *tmpl, *bos, *eos. */
static int load_dir(const char *dir, char **tmpl, char **bos, char **eos, char *err, size_t errlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    size_t len;
    *tmpl = cli_read_file(path, &len);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    json_error_t je;
    json_t *cfg = json_load_file(path, 0, &je);
    if (!cfg && !*tmpl)
        return specd_errf(err, errlen, SPECD_EIO, "%s: %s", path, je.text);
    if (cfg) {
        if (!*tmpl) {
            json_t *ct = json_object_get(cfg, "chat_template");
            const char *s = json_is_string(ct) ? json_string_value(ct) : NULL;
            for (size_t i = 0; !s && json_is_array(ct) && i < json_array_size(ct); i++) {
                json_t *e = json_array_get(ct, i);
                const char *name = json_string_value(json_object_get(e, "name"));
                if (name && !strcmp(name, "default"))
                    s = json_string_value(json_object_get(e, "template"));
            }
            if (s) *tmpl = strdup(s);
        }
        const char *b = token_text(json_object_get(cfg, "bos_token"));
        const char *e = token_text(json_object_get(cfg, "eos_token"));
        if (b) *bos = strdup(b);
        if (e) *eos = strdup(e);
        json_decref(cfg);
    }
    if (!*tmpl)
        return specd_errf(err, errlen, SPECD_ENOTFOUND,
                          "%s: no chat_template (tokenizer_config.json or chat_template.jinja)", dir);
    return 0;
}

static int load_gguf(const char *path, char **tmpl, char **bos, char **eos, char *err, size_t errlen) {
    tok_tokenizer *t = tok_load(path, err, errlen);
    if (!t) return SPECD_EFORMAT;
    const char *ct = tok_chat_template(t);
    int rc = 0;
    if (!ct) rc = specd_errf(err, errlen, SPECD_ENOTFOUND, "%s: no tokenizer.chat_template", path);
    else {
        *tmpl = strdup(ct);
        /* absent special tokens stay undefined in the template, as in HF */
        if (*tok_bos_token(t)) *bos = strdup(tok_bos_token(t));
        if (*tok_eos_token(t)) *eos = strdup(tok_eos_token(t));
    }
    tok_free(t);
    return rc;
}

static json_t *load_json(const char *path, const char *what) {
    json_error_t je;
    json_t *j = json_load_file(path, JSON_DECODE_ANY, &je);
    if (!j) fprintf(stderr, "specd render: %s %s: %s (line %d)\n", what, path, je.text, je.line);
    return j;
}

int cmd_render(int argc, char **argv) {
    const char *tmpl_path = NULL, *model = NULL, *msgs_path = NULL, *tools_path = NULL;
    const char *bos_arg = NULL, *eos_arg = NULL;
    int agp = 0, status = 2;
    char *src = NULL, *bos = NULL, *eos = NULL, *out = NULL;
    json_t *extra = json_object(), *messages = NULL, *tools = NULL;
    tmpl_template *t = NULL;
    char err[1024];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(RENDER_HELP, stdout);
            status = 0;
            goto done;
        } else if (!strcmp(a, "--add-generation-prompt")) {
            agp = 1;
        } else if (has_val && !strcmp(a, "--template")) tmpl_path = argv[++i];
        else if (has_val && !strcmp(a, "--model")) model = argv[++i];
        else if (has_val && !strcmp(a, "--messages")) msgs_path = argv[++i];
        else if (has_val && !strcmp(a, "--tools")) tools_path = argv[++i];
        else if (has_val && !strcmp(a, "--bos-token")) bos_arg = argv[++i];
        else if (has_val && !strcmp(a, "--eos-token")) eos_arg = argv[++i];
        else if (has_val && !strcmp(a, "--var")) {
            const char *kv = argv[++i], *eq = strchr(kv, '=');
            json_error_t je;
            json_t *v = eq ? json_loads(eq + 1, JSON_DECODE_ANY, &je) : NULL;
            if (!v) {
                fprintf(stderr, "specd render: --var expects KEY=JSON, got '%s'\n", kv);
                goto done;
            }
            char key[256];
            snprintf(key, sizeof key, "%.*s", (int)(eq - kv), kv);
            json_object_set_new(extra, key, v);
        } else {
            fprintf(stderr, "specd render: unknown or incomplete option '%s'\n\n%s", a, RENDER_HELP);
            goto done;
        }
    }
    if (!msgs_path || (!tmpl_path == !model)) {
        fprintf(stderr, "specd render: need --messages and exactly one of --template / --model\n\n%s",
                RENDER_HELP);
        goto done;
    }
    status = 1;
    if (tmpl_path) {
        size_t len;
        if (!(src = cli_read_file(tmpl_path, &len))) {
            fprintf(stderr, "specd render: cannot read template %s\n", tmpl_path);
            goto done;
        }
    } else {
        struct stat st;
        int is_dir = stat(model, &st) == 0 && S_ISDIR(st.st_mode);
        int rc = is_dir ? load_dir(model, &src, &bos, &eos, err, sizeof err)
                        : load_gguf(model, &src, &bos, &eos, err, sizeof err);
        if (rc) {
            fprintf(stderr, "specd render: %s\n", err);
            goto done;
        }
    }
    if (!(messages = load_json(msgs_path, "messages"))) goto done;
    if (json_is_object(messages) && json_is_array(json_object_get(messages, "messages"))) {
        json_t *m = json_incref(json_object_get(messages, "messages"));
        json_decref(messages);
        messages = m;
    }
    if (tools_path && !(tools = load_json(tools_path, "tools"))) goto done;
    if (!(t = tmpl_parse(src, strlen(src), err, sizeof err))) {
        fprintf(stderr, "specd render: %s\n", err);
        goto done;
    }
    size_t out_len;
    if (tmpl_render_chat(t, messages, tools, agp, bos_arg ? bos_arg : bos, eos_arg ? eos_arg : eos,
                         extra, &out, &out_len, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        goto done;
    }
    fwrite(out, 1, out_len, stdout);
    fflush(stdout);
    status = 0;
done:
    free(out);
    tmpl_free(t);
    json_decref(messages);
    json_decref(tools);
    json_decref(extra);
    free(src);
    free(bos);
    free(eos);
    return status;
}
