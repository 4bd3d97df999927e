/* Tests of the HF checkpoint loader (config.json + safetensors), random models and shape
 * presets. Fixture models are read in place from $SPECD_FIXTURES/models (default
 * ../shared/fixtures); corrupted variants are written to a fresh temp directory per test.
 * Expected config values come from the fixture's config.json, parsed here independently
 * with jansson, and expected tensor bytes from reading the file with stdio. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/err.h"
#include "engine/model/model.h"
#include "tests/fixtures.h"
#include "tests/st_util.h"

/* ---- helpers -------------------------------------------------------------------------- */

static void copy_file(const char *from, const char *to) {
    size_t n;
    unsigned char *b = read_file(from, &n);
    write_all(to, b, n);
    free(b);
}

/* Temp dir per test; removed (files first) by rm_tmpdir. */
static void make_tmpdir(char *dir) {
    strcpy(dir, "/tmp/specd_formats_XXXXXX");
    assert_non_null(mkdtemp(dir));
}

static void rm_tmpdir(const char *dir) {
    const char *names[] = {"config.json", "generation_config.json", "model.safetensors",
                           "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors"};
    char p[512];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
}

/* Copy a fixture model's files into dir. */
static void copy_fixture(const char *name, const char *dir) {
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors"};
    char src[512], dst[512], m[400];
    fixture_model(m, sizeof m, name);
    for (int i = 0; i < 3; i++) {
        snprintf(src, sizeof src, "%s/%s", m, files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        copy_file(src, dst);
    }
}

static void save_json(const char *path, json_t *j) {
    assert_int_equal(json_dump_file(j, path, JSON_INDENT(1)), 0);
}

static int64_t jint(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    assert_true(json_is_integer(v));
    return json_integer_value(v);
}

/* Write a safetensors file: `header` JSON + the data section of `r` (offsets unchanged). */
static void write_st(const char *path, json_t *header, const unsigned char *data, size_t dlen) {
    char *js = json_dumps(header, JSON_COMPACT);
    assert_non_null(js);
    uint64_t hl = strlen(js);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite(&hl, 8, 1, f);
    fwrite(js, 1, hl, f);
    fwrite(data, 1, dlen, f);
    fclose(f);
    free(js);
}

/* Load `dir` expecting failure; the message must name `file` and contain `problem`. */
static void expect_load_error(const char *dir, const char *file, const char *problem) {
    char err[1024] = "";
    model *m = model_load(dir, err, sizeof err);
    if (m) model_free(m);
    assert_null(m);
    if (!strstr(err, file) || !strstr(err, problem))
        fail_msg("error \"%s\" should name \"%s\" and say \"%s\"", err, file, problem);
}

static model *load_ok(const char *path) {
    char err[1024] = "";
    model *m = model_load(path, err, sizeof err);
    if (!m) fail_msg("model_load(%s): %s", path, err);
    return m;
}

/* Every view the config calls for is present with the right shape; absent ones are NULL. */
static void check_views(const model *m) {
    const model_config *c = &m->cfg;
    int64_t Q = (int64_t)c->n_heads * c->head_dim, KV = (int64_t)c->n_kv_heads * c->head_dim;
    assert_non_null(m->tok_embd.data);
    assert_int_equal(m->tok_embd.shape[0], c->vocab);
    assert_int_equal(m->tok_embd.shape[1], c->hidden);
    assert_int_equal(m->lm_head.shape[0], c->vocab);
    assert_int_equal(m->out_norm.shape[0], c->hidden);
    if (c->tied_embeddings) assert_ptr_equal(m->lm_head.data, m->tok_embd.data);
    else assert_ptr_not_equal(m->lm_head.data, m->tok_embd.data);
    for (int i = 0; i < c->n_layers; i++) {
        const model_layer *l = &m->layers[i];
        assert_int_equal(l->wq.ndim, 2);
        assert_int_equal(l->wq.shape[0], Q);
        assert_int_equal(l->wq.shape[1], c->hidden);
        assert_int_equal(l->wk.shape[0], KV);
        assert_int_equal(l->wv.shape[0], KV);
        assert_int_equal(l->wo.shape[0], c->hidden);
        assert_int_equal(l->wo.shape[1], Q);
        assert_int_equal(l->w_gate.shape[0], c->ffn);
        assert_int_equal(l->w_up.shape[0], c->ffn);
        assert_int_equal(l->w_down.shape[0], c->hidden);
        assert_int_equal(l->w_down.shape[1], c->ffn);
        assert_non_null(l->attn_norm.data);
        assert_non_null(l->ffn_norm.data);
        assert_int_equal(l->bq.data != NULL, c->qkv_bias);
        assert_int_equal(l->bk.data != NULL, c->qkv_bias);
        assert_int_equal(l->q_norm.data != NULL, c->qk_norm);
        assert_int_equal(l->k_norm.data != NULL, c->qk_norm);
        if (c->qkv_bias) {
            assert_int_equal(l->bq.shape[0], Q);
            assert_int_equal(l->bv.shape[0], KV);
        }
        if (c->qk_norm) assert_int_equal(l->q_norm.shape[0], c->head_dim);
        assert_int_equal(l->wq.unpermute_heads, 0);   /* HF weights are not permuted */
    }
}

/* Config fields that every fixture shares with its config.json. */
static void check_against_config_json(const model *m, const char *dir) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *j = load_json(p);
    const model_config *c = &m->cfg;
    assert_int_equal(c->n_layers, jint(j, "num_hidden_layers"));
    assert_int_equal(c->hidden, jint(j, "hidden_size"));
    assert_int_equal(c->n_heads, jint(j, "num_attention_heads"));
    assert_int_equal(c->n_kv_heads, jint(j, "num_key_value_heads"));
    assert_int_equal(c->ffn, jint(j, "intermediate_size"));
    assert_int_equal(c->vocab, jint(j, "vocab_size"));
    assert_int_equal(c->max_pos, jint(j, "max_position_embeddings"));
    assert_int_equal(c->tied_embeddings, json_is_true(json_object_get(j, "tie_word_embeddings")));
    assert_float_equal(c->rms_eps, json_real_value(json_object_get(j, "rms_norm_eps")), 1e-12);
    assert_int_equal(c->bos_id, jint(j, "bos_token_id"));
    assert_int_equal(c->n_eos, 1);
    assert_int_equal(c->eos_ids[0], jint(j, "eos_token_id"));
    json_decref(j);
}

/* ---- fixture models load with the right config ---------------------------------------- */

static void test_llama_tiny_config_from_rope_parameters(void **state) {
    (void)state;
    char dir[400];
    fixture_model(dir, sizeof dir, "llama-tiny");
    model *m = load_ok(dir);
    const model_config *c = &m->cfg;
    check_against_config_json(m, dir);
    assert_int_equal(c->arch, MODEL_ARCH_LLAMA);
    assert_string_equal(c->arch_name, "LlamaForCausalLM");
    assert_int_equal(c->head_dim, 32);
    assert_int_equal(c->rope_type, ROPE_LLAMA3);
    assert_float_equal(c->rope_theta, 500000.0, 0);
    assert_float_equal(c->rope_factor, 8.0, 0);
    assert_float_equal(c->rope_low_freq_factor, 1.0, 0);
    assert_float_equal(c->rope_high_freq_factor, 4.0, 0);
    assert_int_equal(c->rope_orig_max_pos, 8192);
    assert_int_equal(c->tied_embeddings, 0);
    assert_int_equal(c->qkv_bias, 0);
    assert_int_equal(c->qk_norm, 0);
    assert_int_equal(m->is_gguf, 0);
    assert_int_equal(m->layers[0].wq.dtype, TDT_BF16);
    check_views(m);
    model_free(m);
}

static void test_qwen2_tiny_bias_tied_rope_theta_style(void **state) {
    (void)state;
    char dir[400];
    fixture_model(dir, sizeof dir, "qwen2-tiny");
    model *m = load_ok(dir);
    const model_config *c = &m->cfg;
    check_against_config_json(m, dir);
    assert_int_equal(c->arch, MODEL_ARCH_QWEN2);
    assert_int_equal(c->max_pos, 1048576);   /* read, never used to size anything */
    assert_int_equal(c->head_dim, 128 / 4);  /* no head_dim key: hidden / heads */
    assert_int_equal(c->rope_type, ROPE_DEFAULT);
    assert_float_equal(c->rope_theta, 1000000.0, 0);
    assert_int_equal(c->tied_embeddings, 1);
    assert_int_equal(c->qkv_bias, 1);
    assert_int_equal(c->qk_norm, 0);
    check_views(m);
    model_free(m);
}

static void test_qwen3_tiny_explicit_head_dim_and_qk_norm(void **state) {
    (void)state;
    char dir[400];
    fixture_model(dir, sizeof dir, "qwen3-tiny");
    model *m = load_ok(dir);
    const model_config *c = &m->cfg;
    check_against_config_json(m, dir);
    assert_int_equal(c->arch, MODEL_ARCH_QWEN3);
    assert_int_equal(c->head_dim, 64);
    assert_int_not_equal(c->head_dim, c->hidden / c->n_heads);
    assert_int_equal(c->qk_norm, 1);
    assert_int_equal(c->qkv_bias, 0);
    assert_int_equal(c->tied_embeddings, 1);
    assert_int_equal(m->layers[3].wq.shape[0], 256);
    assert_int_equal(m->layers[3].wo.shape[1], 256);
    assert_int_equal(m->layers[3].k_norm.shape[0], 64);
    check_views(m);
    model_free(m);
}

static void test_llama_draft_one_layer(void **state) {
    (void)state;
    char dir[400];
    fixture_model(dir, sizeof dir, "llama-draft");
    model *m = load_ok(dir);
    check_against_config_json(m, dir);
    assert_int_equal(m->cfg.n_layers, 1);
    assert_int_equal(m->cfg.n_kv_heads, 1);   /* MQA */
    assert_int_equal(m->cfg.rope_type, ROPE_LLAMA3);
    check_views(m);
    model_free(m);
}

/* ---- tensor conversion ---------------------------------------------------------------- */

static void test_bf16_to_f32_widens_raw_bits(void **state) {
    (void)state;
    char dir[400], st[512];
    fixture_model(dir, sizeof dir, "llama-tiny");
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    raw_st r;
    raw_st_load(&r, st);
    model *m = load_ok(dir);
    const char *names[] = {"model.layers.1.self_attn.k_proj.weight", "model.norm.weight",
                           "lm_head.weight"};
    const tensor_view *views[] = {&m->layers[1].wk, &m->out_norm, &m->lm_head};
    for (int t = 0; t < 3; t++) {
        size_t nb;
        const unsigned char *raw = raw_st_data(&r, names[t], &nb);
        int64_t n = tensor_numel(views[t]);
        assert_int_equal((size_t)n * 2, nb);
        float *f = malloc((size_t)n * sizeof *f);
        uint16_t *h = malloc((size_t)n * sizeof *h);
        assert_int_equal(tensor_to_f32(views[t], f), 0);
        assert_int_equal(tensor_to_bf16(views[t], h), 0);
        assert_memory_equal(h, raw, nb);   /* bf16 -> bf16 is the identity */
        int64_t idx[] = {0, 1, n / 2, n - 1};
        for (int k = 0; k < 4; k++) {
            uint16_t b = (uint16_t)(raw[2 * idx[k]] | raw[2 * idx[k] + 1] << 8);
            uint32_t bits = (uint32_t)b << 16, got;
            memcpy(&got, &f[idx[k]], 4);
            assert_int_equal(got, bits);
        }
        free(f);
        free(h);
    }
    model_free(m);
    raw_st_free(&r);
}

static void test_f32_to_bf16_rounds_to_nearest_even(void **state) {
    (void)state;
    /* 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties go to even (1.0);
     * 1 + 3*2^-8 is halfway between 1.0078125 (odd) and 1.015625: goes up. */
    float x[6] = {1.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, 1.0f + 1.0f / 128 + 1e-4f, 0};
    x[5] = nanf("");
    tensor_view t = { .data = x, .dtype = TDT_F32, .ndim = 1, .shape = {6, 0} };
    uint16_t h[6];
    assert_int_equal(tensor_to_bf16(&t, h), 0);
    assert_int_equal(h[0], 0x3f80);
    assert_int_equal(h[1], 0x3f80);
    assert_int_equal(h[2], 0x3f82);
    assert_int_equal(h[3], 0xc020);
    assert_int_equal(h[4], 0x3f81);
    assert_int_equal(h[5] & 0x7f80, 0x7f80);   /* still NaN */
    assert_int_not_equal(h[5] & 0x7f, 0);
}

static void test_f16_view_converts_exactly(void **state) {
    (void)state;
    /* 1.0, -2.5, 65504 (max), 2^-24 (smallest subnormal), -0.0, inf */
    uint16_t h[6] = {0x3c00, 0xc100, 0x7bff, 0x0001, 0x8000, 0x7c00};
    float want[6] = {1.0f, -2.5f, 65504.0f, 5.9604644775390625e-08f, -0.0f, INFINITY};
    tensor_view t = { .data = h, .dtype = TDT_F16, .ndim = 2, .shape = {2, 3} };
    float f[6];
    assert_int_equal(tensor_numel(&t), 6);
    assert_int_equal(tensor_to_f32(&t, f), 0);
    assert_memory_equal(f, want, sizeof want);
}

/* ---- config variants ------------------------------------------------------------------ */

static void test_generation_config_tokens_win(void **state) {
    (void)state;
    char dir[64], p[512];
    make_tmpdir(dir);
    copy_fixture("llama-tiny", dir);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    write_all(p, "{\"bos_token_id\": 5, \"eos_token_id\": [7, 9, 11]}", 47);
    model *m = load_ok(dir);
    assert_int_equal(m->cfg.bos_id, 5);
    assert_int_equal(m->cfg.n_eos, 3);
    assert_int_equal(m->cfg.eos_ids[0], 7);
    assert_int_equal(m->cfg.eos_ids[2], 11);
    model_free(m);

    /* Without generation_config.json, config.json's list is used. */
    unlink(p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *j = load_json(p);
    json_object_set_new(j, "eos_token_id", json_pack("[iii]", 2, 3, 4));
    save_json(p, j);
    json_decref(j);
    m = load_ok(dir);
    assert_int_equal(m->cfg.bos_id, 1);
    assert_int_equal(m->cfg.n_eos, 3);
    assert_int_equal(m->cfg.eos_ids[1], 3);
    model_free(m);
    rm_tmpdir(dir);
}

/* Rewrite llama-tiny's config.json through `edit`, then load. */
static void with_llama_config(void (*edit)(json_t *), const char *file_err, const char *problem,
                              void (*check)(const model *)) {
    char dir[64], p[512];
    make_tmpdir(dir);
    copy_fixture("llama-tiny", dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *j = load_json(p);
    edit(j);
    save_json(p, j);
    json_decref(j);
    if (check) {
        model *m = load_ok(dir);
        check(m);
        model_free(m);
    } else {
        expect_load_error(dir, file_err, problem);
    }
    rm_tmpdir(dir);
}

static void edit_hub_rope(json_t *j) {
    json_object_del(j, "rope_parameters");
    json_object_set_new(j, "rope_theta", json_real(250000.0));
    json_object_set_new(j, "rope_scaling",
                        json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor", 32.0,
                                  "low_freq_factor", 2.0, "high_freq_factor", 8.0,
                                  "original_max_position_embeddings", 4096));
}
static void check_hub_rope(const model *m) {
    assert_int_equal(m->cfg.rope_type, ROPE_LLAMA3);
    assert_float_equal(m->cfg.rope_theta, 250000.0, 0);
    assert_float_equal(m->cfg.rope_factor, 32.0, 0);
    assert_float_equal(m->cfg.rope_low_freq_factor, 2.0, 0);
    assert_float_equal(m->cfg.rope_high_freq_factor, 8.0, 0);
    assert_int_equal(m->cfg.rope_orig_max_pos, 4096);
}
static void test_rope_scaling_hub_style_llama3(void **state) {
    (void)state;
    with_llama_config(edit_hub_rope, NULL, NULL, check_hub_rope);
}

static void edit_yarn(json_t *j) {
    json_object_set_new(json_object_get(j, "rope_parameters"), "rope_type", json_string("yarn"));
}
static void test_unsupported_rope_type_is_named(void **state) {
    (void)state;
    with_llama_config(edit_yarn, "config.json", "rope type \"yarn\"", NULL);
}

static void edit_arch(json_t *j) {
    json_object_set_new(j, "architectures", json_pack("[s]", "GPT2LMHeadModel"));
}
static void test_unknown_architecture(void **state) {
    (void)state;
    with_llama_config(edit_arch, "config.json", "unknown architecture \"GPT2LMHeadModel\"", NULL);
}

/* Sliding windows change the math: Mistral's is read, a window in null means none, and
 * Qwen's per-layer variant is refused by name rather than ignored. */
static void edit_window(json_t *j) { json_object_set_new(j, "sliding_window", json_integer(64)); }
static void check_window(const model *m) { assert_int_equal(m->cfg.sliding_window, 64); }
static void edit_window_null(json_t *j) { json_object_set_new(j, "sliding_window", json_null()); }
static void check_no_window(const model *m) { assert_int_equal(m->cfg.sliding_window, 0); }
static void edit_qwen_window(json_t *j) {
    json_object_set_new(j, "architectures", json_pack("[s]", "Qwen2ForCausalLM"));
    json_object_set_new(j, "sliding_window", json_integer(64));
    json_object_set_new(j, "use_sliding_window", json_true());
}
static void test_sliding_window_read_or_refused(void **state) {
    (void)state;
    with_llama_config(edit_window, NULL, NULL, check_window);
    with_llama_config(edit_window_null, NULL, NULL, check_no_window);
    with_llama_config(edit_qwen_window, "config.json", "use_sliding_window", NULL);
}

static void edit_ffn(json_t *j) { json_object_set_new(j, "intermediate_size", json_integer(300)); }
static void test_shape_mismatch_vs_config(void **state) {
    (void)state;
    with_llama_config(edit_ffn, "model.safetensors",
                      "model.layers.0.mlp.gate_proj.weight has shape [344, 128], the config "
                      "implies [300, 128]",
                      NULL);
}

static void edit_tie(json_t *j) { json_object_set_new(j, "tie_word_embeddings", json_true()); }
static void check_tied(const model *m) {
    /* llama-tiny has an lm_head, but a tied config must use the embedding. */
    assert_int_equal(m->cfg.tied_embeddings, 1);
    assert_ptr_equal(m->lm_head.data, m->tok_embd.data);
}
static void test_tied_flag_uses_embedding(void **state) {
    (void)state;
    with_llama_config(edit_tie, NULL, NULL, check_tied);
}

static void edit_type(json_t *j) { json_object_set_new(j, "num_hidden_layers", json_string("4")); }
static void test_wrong_json_type_is_named(void **state) {
    (void)state;
    with_llama_config(edit_type, "config.json", "\"num_hidden_layers\" must be an integer", NULL);
}

static void edit_more_layers(json_t *j) { json_object_set_new(j, "num_hidden_layers", json_integer(5)); }
static void test_missing_layer_tensor(void **state) {
    (void)state;
    with_llama_config(edit_more_layers, "model.safetensors",
                      "missing tensor model.layers.4.input_layernorm.weight", NULL);
}

static void test_bad_config_json(void **state) {
    (void)state;
    char dir[64], p[512];
    make_tmpdir(dir);
    copy_fixture("qwen2-tiny", dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_all(p, "{\"architectures\": [\"Qwen2ForCausalLM\"], ", 40);
    expect_load_error(dir, "config.json", "bad JSON");
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    copy_fixture("qwen2-tiny", dir);
    write_all(p, "{\"eos_token_id\": [1,}", 21);
    expect_load_error(dir, "generation_config.json", "bad JSON");
    rm_tmpdir(dir);
}

static void test_untied_without_lm_head(void **state) {
    (void)state;
    char dir[64], p[512];
    make_tmpdir(dir);
    copy_fixture("qwen2-tiny", dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_t *j = load_json(p);
    json_object_set_new(j, "tie_word_embeddings", json_false());
    save_json(p, j);
    json_decref(j);
    expect_load_error(dir, "model.safetensors", "missing tensor lm_head.weight");
    rm_tmpdir(dir);
}

static void test_missing_dir_and_config(void **state) {
    (void)state;
    char dir[64];
    expect_load_error("/nonexistent/specd-model", "/nonexistent/specd-model", "no such file");
    make_tmpdir(dir);
    expect_load_error(dir, "config.json", "No such file");
    rm_tmpdir(dir);
}

/* ---- corrupted safetensors ------------------------------------------------------------ */

static void test_truncated_safetensors_fail_cleanly(void **state) {
    (void)state;
    char dir[64], st[512], src[512], m[400];
    fixture_model(m, sizeof m, "qwen3-tiny");
    snprintf(src, sizeof src, "%s/model.safetensors", m);
    size_t len;
    unsigned char *b = read_file(src, &len);
    uint64_t hl;
    memcpy(&hl, b, 8);
    size_t cuts[] = {0, 1, 7, 8, 9, 100, 8 + (size_t)hl - 1, 8 + (size_t)hl, 8 + (size_t)hl + 1,
                     8 + (size_t)hl + 4096, len / 2, len - 2, len - 1};
    make_tmpdir(dir);
    copy_fixture("qwen3-tiny", dir);
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        write_all(st, b, cuts[i]);
        expect_load_error(dir, "model.safetensors", "truncated");
    }
    write_all(st, b, len);   /* and the intact copy still loads */
    model_free(load_ok(dir));
    free(b);
    rm_tmpdir(dir);
}

/* Modify one field of one tensor's header entry and expect `problem`. */
static void corrupt_entry(const char *tensor, const char *field, json_t *value, const char *problem) {
    char dir[64], st[512], src[512], m[400];
    raw_st r;
    fixture_model(m, sizeof m, "llama-tiny");
    snprintf(src, sizeof src, "%s/model.safetensors", m);
    raw_st_load(&r, src);
    make_tmpdir(dir);
    copy_fixture("llama-tiny", dir);
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    json_t *h = json_deep_copy(r.header);
    if (field) json_object_set_new(json_object_get(h, tensor), field, value);
    else json_object_del(h, tensor);
    write_st(st, h, r.bytes + r.data_start, r.len - r.data_start);
    json_decref(h);
    expect_load_error(dir, "model.safetensors", problem);
    rm_tmpdir(dir);
    raw_st_free(&r);
}

static void test_offsets_beyond_file(void **state) {
    (void)state;
    corrupt_entry("model.norm.weight", "data_offsets", json_pack("[I, I]", (json_int_t)1 << 40,
                  ((json_int_t)1 << 40) + 256), "beyond the data section");
    corrupt_entry("model.norm.weight", "data_offsets", json_pack("[i, i]", 512, 0),
                  "begin <= end");
    corrupt_entry("model.norm.weight", "data_offsets", json_pack("[i, i]", -2, 254),
                  "data_offsets must be");
}

static void test_wrong_dtype_string(void **state) {
    (void)state;
    corrupt_entry("model.norm.weight", "dtype", json_string("BF17"), "unknown dtype \"BF17\"");
    /* A real dtype the loader does not take: I16 has BF16's size, so the header is valid. */
    corrupt_entry("model.norm.weight", "dtype", json_string("I16"), "has dtype I16");
}

static void test_size_mismatch_vs_shape(void **state) {
    (void)state;
    corrupt_entry("model.norm.weight", "shape", json_pack("[i]", 129), "needs 258");
    corrupt_entry("model.norm.weight", "shape", json_pack("[s]", "x"), "shape[0]");
}

static void test_missing_tensor_in_header(void **state) {
    (void)state;
    corrupt_entry("model.layers.2.mlp.up_proj.weight", NULL, NULL,
                  "missing tensor model.layers.2.mlp.up_proj.weight");
}

static void test_bad_header_length_and_json(void **state) {
    (void)state;
    char dir[64], st[512], src[512], m[400];
    size_t len;
    fixture_model(m, sizeof m, "llama-draft");
    snprintf(src, sizeof src, "%s/model.safetensors", m);
    unsigned char *b = read_file(src, &len);
    make_tmpdir(dir);
    copy_fixture("llama-draft", dir);
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    uint64_t orig, v = (uint64_t)1 << 62;
    memcpy(&orig, b, 8);
    memcpy(b, &v, 8);
    write_all(st, b, len);
    expect_load_error(dir, "model.safetensors", "bad header length");
    v = orig - 10;   /* JSON cut short */
    memcpy(b, &v, 8);
    write_all(st, b, len);
    expect_load_error(dir, "model.safetensors", "bad JSON header");
    memcpy(b, &orig, 8);
    b[8] = '[';      /* not an object */
    write_all(st, b, len);
    expect_load_error(dir, "model.safetensors", "bad JSON header");
    free(b);
    rm_tmpdir(dir);
}

/* ---- sharded checkpoints -------------------------------------------------------------- */

/* Split llama-tiny into two shards + index (tensors alternate between shards). */
static void write_sharded(const char *dir, const char *bad_shard_for) {
    char src[512], m[400], p[512];
    raw_st r;
    fixture_model(m, sizeof m, "llama-tiny");
    snprintf(src, sizeof src, "%s/model.safetensors", m);
    raw_st_load(&r, src);
    const char *shard[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    json_t *hdr[2] = {json_object(), json_object()}, *wm = json_object();
    unsigned char *data[2] = {malloc(r.len), malloc(r.len)};
    size_t dlen[2] = {0, 0};
    const char *key;
    json_t *val;
    int k = 0;
    json_object_foreach(r.header, key, val) {
        if (!strcmp(key, "__metadata__")) continue;
        int s = k++ % 2;
        size_t nb;
        const unsigned char *d = raw_st_data(&r, key, &nb);
        memcpy(data[s] + dlen[s], d, nb);
        json_t *e = json_deep_copy(val);
        json_object_set_new(e, "data_offsets", json_pack("[I, I]", (json_int_t)dlen[s],
                                                         (json_int_t)(dlen[s] + nb)));
        json_object_set_new(hdr[s], key, e);
        dlen[s] += nb;
        const char *f = shard[s];
        if (bad_shard_for && !strcmp(key, bad_shard_for)) f = shard[1 - s];
        json_object_set_new(wm, key, json_string(f));
    }
    for (int s = 0; s < 2; s++) {
        snprintf(p, sizeof p, "%s/%s", dir, shard[s]);
        write_st(p, hdr[s], data[s], dlen[s]);
        json_decref(hdr[s]);
        free(data[s]);
    }
    json_t *idx = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)r.len,
                            "weight_map", wm);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    save_json(p, idx);
    json_decref(idx);
    raw_st_free(&r);
}

static void assert_same_tensor(const tensor_view *a, const tensor_view *b) {
    int64_t n = tensor_numel(a);
    assert_int_equal(n, tensor_numel(b));
    float *x = malloc((size_t)n * 4), *y = malloc((size_t)n * 4);
    assert_int_equal(tensor_to_f32(a, x), 0);
    assert_int_equal(tensor_to_f32(b, y), 0);
    assert_memory_equal(x, y, (size_t)n * 4);
    free(x);
    free(y);
}

static void test_sharded_checkpoint_matches_single_file(void **state) {
    (void)state;
    char dir[64], p[512], ref[400];
    make_tmpdir(dir);
    copy_fixture("llama-tiny", dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    write_sharded(dir, NULL);
    fixture_model(ref, sizeof ref, "llama-tiny");
    model *a = load_ok(ref), *b = load_ok(dir);
    assert_memory_equal(&a->cfg, &b->cfg, sizeof a->cfg);
    assert_same_tensor(&a->tok_embd, &b->tok_embd);
    assert_same_tensor(&a->lm_head, &b->lm_head);
    for (int i = 0; i < a->cfg.n_layers; i++) {
        assert_same_tensor(&a->layers[i].wq, &b->layers[i].wq);
        assert_same_tensor(&a->layers[i].w_down, &b->layers[i].w_down);
        assert_same_tensor(&a->layers[i].ffn_norm, &b->layers[i].ffn_norm);
    }
    model_free(a);
    model_free(b);

    /* The index says a tensor is in the shard that does not hold it. */
    write_sharded(dir, "model.norm.weight");
    expect_load_error(dir, "safetensors", "missing tensor model.norm.weight");
    rm_tmpdir(dir);
}

/* ---- random models and presets -------------------------------------------------------- */

static void tiny_cfg(model_config *c) {
    memset(c, 0, sizeof *c);
    c->arch = MODEL_ARCH_QWEN2;
    strcpy(c->arch_name, "tiny");
    c->n_layers = 2; c->hidden = 64; c->n_heads = 4; c->n_kv_heads = 2; c->head_dim = 16;
    c->ffn = 96; c->vocab = 100; c->rms_eps = 1e-6f; c->rope_theta = 10000.0f;
    c->qkv_bias = 1; c->tied_embeddings = 1;
}

static void mean_std(const tensor_view *t, double *mean, double *std) {
    int64_t n = tensor_numel(t);
    const float *x = t->data;
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; i++) { s += x[i]; s2 += (double)x[i] * x[i]; }
    *mean = s / n;
    *std = sqrt(s2 / n - *mean * *mean);
}

static void test_random_model_deterministic_and_respects_flags(void **state) {
    (void)state;
    model_config c;
    char err[256];
    tiny_cfg(&c);
    model *a = model_random(&c, 42, err, sizeof err), *b = model_random(&c, 42, err, sizeof err);
    model *d = model_random(&c, 43, err, sizeof err);
    assert_non_null(a); assert_non_null(b); assert_non_null(d);
    check_views(a);
    assert_ptr_equal(a->lm_head.data, a->tok_embd.data);
    assert_int_equal(a->layers[1].bq.shape[0], 64);
    assert_int_equal(a->layers[1].bk.shape[0], 32);
    assert_memory_equal(a->layers[1].w_up.data, b->layers[1].w_up.data, 96 * 64 * 4);
    assert_memory_not_equal(a->layers[1].w_up.data, d->layers[1].w_up.data, 96 * 64 * 4);
    /* different tensors of one model are different streams */
    assert_memory_not_equal(a->layers[1].w_up.data, a->layers[1].w_gate.data, 96 * 64 * 4);
    double mean, std;
    mean_std(&a->tok_embd, &mean, &std);
    assert_true(fabs(mean) < 0.002);
    assert_true(std > 0.018 && std < 0.022);
    mean_std(&a->layers[0].attn_norm, &mean, &std);
    assert_true(fabs(mean - 1.0) < 0.01);
    model_free(a); model_free(b); model_free(d);

    c.arch = MODEL_ARCH_QWEN3; c.qkv_bias = 0; c.qk_norm = 1; c.tied_embeddings = 0;
    a = model_random(&c, 1, err, sizeof err);
    assert_non_null(a);
    check_views(a);
    assert_int_equal(a->layers[0].q_norm.shape[0], 16);
    assert_null(a->layers[0].bq.data);
    model_free(a);

    c.n_heads = 3;   /* not a multiple of 2 kv heads */
    assert_null(model_random(&c, 1, err, sizeof err));
    assert_non_null(strstr(err, "num_key_value_heads"));
}

static void test_shape_presets(void **state) {
    (void)state;
    model_config c;
    assert_int_equal(model_shape_preset("llama-3.1-8b", &c), 0);
    assert_int_equal(c.n_layers, 32); assert_int_equal(c.hidden, 4096);
    assert_int_equal(c.n_heads, 32); assert_int_equal(c.n_kv_heads, 8);
    assert_int_equal(c.head_dim, 128); assert_int_equal(c.ffn, 14336);
    assert_int_equal(c.vocab, 128256); assert_int_equal(c.rope_type, ROPE_LLAMA3);
    assert_float_equal(c.rope_theta, 500000, 0); assert_float_equal(c.rope_factor, 8, 0);
    assert_float_equal(c.rope_low_freq_factor, 1, 0); assert_float_equal(c.rope_high_freq_factor, 4, 0);
    assert_int_equal(c.rope_orig_max_pos, 8192); assert_float_equal(c.rms_eps, 1e-5f, 0);
    assert_int_equal(c.tied_embeddings, 0);
    assert_int_equal(model_kv_bytes_per_token(&c, 2), 2 * 32 * 8 * 128 * 2);

    assert_int_equal(model_shape_preset("llama-3.2-1b", &c), 0);
    assert_int_equal(c.n_layers, 16); assert_int_equal(c.hidden, 2048);
    assert_int_equal(c.head_dim, 64); assert_int_equal(c.ffn, 8192);
    assert_float_equal(c.rope_factor, 32, 0); assert_int_equal(c.tied_embeddings, 1);

    assert_int_equal(model_shape_preset("qwen2.5-1.5b", &c), 0);
    assert_int_equal(c.arch, MODEL_ARCH_QWEN2);
    assert_int_equal(c.n_layers, 28); assert_int_equal(c.hidden, 1536);
    assert_int_equal(c.n_heads, 12); assert_int_equal(c.n_kv_heads, 2);
    assert_int_equal(c.head_dim, 128); assert_int_equal(c.ffn, 8960);
    assert_int_equal(c.vocab, 151936); assert_float_equal(c.rope_theta, 1e6, 0);
    assert_float_equal(c.rms_eps, 1e-6f, 0); assert_int_equal(c.qkv_bias, 1);
    assert_int_equal(c.qk_norm, 0); assert_int_equal(c.tied_embeddings, 1);
    assert_int_equal(c.rope_type, ROPE_DEFAULT);

    assert_int_equal(model_shape_preset("qwen3-1.7b", &c), 0);
    assert_int_equal(c.arch, MODEL_ARCH_QWEN3);
    assert_int_equal(c.hidden, 2048); assert_int_equal(c.n_heads, 16);
    assert_int_equal(c.n_kv_heads, 8); assert_int_equal(c.ffn, 6144);
    assert_int_equal(c.qk_norm, 1); assert_int_equal(c.qkv_bias, 0);
    assert_int_equal(c.tied_embeddings, 1);
    assert_int_equal(model_kv_bytes_per_token(&c, 4), 2 * 28 * 8 * 128 * 4);

    assert_int_equal(model_shape_preset("gemma3-4b", &c), 0);
    assert_int_equal(c.arch, MODEL_ARCH_GEMMA3);
    assert_int_equal(c.n_layers, 34); assert_int_equal(c.hidden, 2560);
    assert_int_equal(c.n_heads, 8); assert_int_equal(c.n_kv_heads, 4);
    assert_int_equal(c.head_dim, 256); assert_int_equal(c.ffn, 10240); assert_int_equal(c.vocab, 262208);
    assert_int_equal(c.act, ACT_GELU_TANH); assert_int_equal(c.sandwich_norms, 1); assert_int_equal(c.qk_norm, 1);
    assert_float_equal(c.attn_scale, 1.0 / 16, 0); assert_float_equal(c.embed_scale, sqrtf(2560.0f), 0);
    assert_int_equal(c.rope_type, ROPE_LINEAR); assert_float_equal(c.rope_factor, 8, 0);
    assert_float_equal(c.rope_local_theta, 1e4, 0); assert_float_equal(c.rope_theta, 1e6, 0);
    int full = 0;
    for (int l = 0; l < c.n_layers; l++) full += model_layer_window(&c, l) == 0;
    assert_int_equal(full, 5);   /* layers 5, 11, 17, 23, 29; the other 29 slide over 1024 */
    assert_int_equal(model_layer_window(&c, 0), 1024);
    assert_int_equal(model_layer_window(&c, 5), 0);
    char err[256];
    model *m = model_shape(&c, err, sizeof err);
    if (!m) fail_msg("model_shape gemma3-4b: %s", err);
    model_free(m);

    assert_int_equal(model_shape_preset("gpt-5", &c), SPECD_ENOTFOUND);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_tiny_config_from_rope_parameters),
        cmocka_unit_test(test_qwen2_tiny_bias_tied_rope_theta_style),
        cmocka_unit_test(test_qwen3_tiny_explicit_head_dim_and_qk_norm),
        cmocka_unit_test(test_llama_draft_one_layer),
        cmocka_unit_test(test_bf16_to_f32_widens_raw_bits),
        cmocka_unit_test(test_f32_to_bf16_rounds_to_nearest_even),
        cmocka_unit_test(test_f16_view_converts_exactly),
        cmocka_unit_test(test_generation_config_tokens_win),
        cmocka_unit_test(test_rope_scaling_hub_style_llama3),
        cmocka_unit_test(test_unsupported_rope_type_is_named),
        cmocka_unit_test(test_unknown_architecture),
        cmocka_unit_test(test_sliding_window_read_or_refused),
        cmocka_unit_test(test_shape_mismatch_vs_config),
        cmocka_unit_test(test_tied_flag_uses_embedding),
        cmocka_unit_test(test_wrong_json_type_is_named),
        cmocka_unit_test(test_missing_layer_tensor),
        cmocka_unit_test(test_bad_config_json),
        cmocka_unit_test(test_untied_without_lm_head),
        cmocka_unit_test(test_missing_dir_and_config),
        cmocka_unit_test(test_truncated_safetensors_fail_cleanly),
        cmocka_unit_test(test_offsets_beyond_file),
        cmocka_unit_test(test_wrong_dtype_string),
        cmocka_unit_test(test_size_mismatch_vs_shape),
        cmocka_unit_test(test_missing_tensor_in_header),
        cmocka_unit_test(test_bad_header_length_and_json),
        cmocka_unit_test(test_sharded_checkpoint_matches_single_file),
        cmocka_unit_test(test_random_model_deterministic_and_respects_flags),
        cmocka_unit_test(test_shape_presets),
    };
    return cmocka_run_group_tests_name("formats", tests, NULL, NULL);
}
