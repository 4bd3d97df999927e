/* Tokenizer loader for GGUF metadata (tokenizer.ggml.*). Two models:
 *  - "gpt2": BPE with merges given as "a b" strings, byte-level (GPT-2's byte map) except
 *    for a few SentencePiece-style vocabularies; the normalizer and pre-tokenizer come
 *    from tokenizer.ggml.pre, one table below (FAMILIES) with every name llama.cpp's
 *    converter writes;
 *  - "llama": SentencePiece BPE with byte fallback; there are no merges in the file, so
 *    every split of a token into two tokens becomes a merge ranked by the token's score
 *    (highest score merges first), and the normalizer is HF's Llama one: prepend U+2581,
 *    spaces -> U+2581.
 * Token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Control
 * and user-defined tokens are matched in the text before BPE (as HF's added tokens). */
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/model/gguf.h"
#include "engine/text/tok_internal.h"

/* ---- pre-tokenizers of byte-level vocabularies, by tokenizer.ggml.pre ----
 *
 * llama.cpp's GGUF converter recognises a model's tokenizer by hashing the ids it gives
 * for a test text and writes one of the names below; the name stands for the pre-tokenizer
 * of that family's HF tokenizer.json, which the GGUF does not carry. This table is that
 * mapping: every name llama.cpp's vocabulary loader accepts for a "gpt2" model (as
 * vendored in llama-cpp-python 0.3.36), each with the steps of the original tokenizer.json
 * in order. A step is a Split with behavior Isolated (HF's Digits is the split \p{N} or
 * \p{N}+, its Punctuation a contiguous run of punctuation) or the ByteLevel step, with or
 * without its GPT-2 regex. Where llama.cpp rewrote a pattern for std::regex, the pattern
 * here is the original one (PCRE2 has \p{Lu}, (?i:...), possessive quantifiers); steps after
 * ByteLevel see the mapped chars, as in HF (tok_text.c). Regexes run in PCRE2 UTF+UCP mode
 * with \s as Unicode White_Space, as Oniguruma runs them for HF.
 *
 * The GGUF has no normalizer either: NFC is set for the families whose tokenizer.json is
 * known to have it (Qwen, OLMo 1.7); the others get none, as llama.cpp does.
 * "default" (a file that records no pre-tokenizer) gets GPT-2's split, the one HF applies
 * with a bare ByteLevel; llama.cpp falls back to a looser list of its own there.
 * Not here: "whitespace" (a tokenizer.ggml.model of its own, for one embedding model). */

/* GPT-2's split (HF ByteLevel's use_regex) */
static const char RE_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
/* cl100k (Llama 3, DBRX, GLM-4, ...): numbers in groups of up to three */
static const char RE_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen2: single digits */
static const char RE_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen3.5: combining marks stay with their letters */
static const char RE_QWEN35[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}"
    "\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen2's without the English contractions (Turkish suffixes after an apostrophe) */
static const char RE_UFAKZEKA[] =
    "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
/* Llama 3's with runs of whitespace cut in power-of-two lengths */
static const char RE_JAIS2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|"
    "\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|"
    "\\s{1,2}(?!\\S)|\\s{1}";
/* MiniCPM 5: Llama 3's with whole numbers (after a \p{N}{1,3} split) */
static const char RE_MINICPM5[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* o200k (GPT-4o, Llama 4, MiniMax-M2): words split at case changes */
static const char RE_GPT4O[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Mistral's tekken: o200k's without contractions, single digits */
static const char RE_TEKKEN[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Youtu: o200k's shape with single digits */
static const char RE_YOUTU[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}| ?[^\\s\\p{L}"
    "\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Kimi K2: o200k's with Han runs apart ("[X&&[^\\p{Han}]]" written as a lookahead) */
#define NOT_HAN(cls) "(?:(?!\\p{Han})[" cls "])"
static const char RE_KIMI_K2[] =
    "\\p{Han}+|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN("\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}") "*"
    NOT_HAN("\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}") "+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN("\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}") "+"
    NOT_HAN("\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}") "*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
#undef NOT_HAN
/* Cohere Tiny Aya: numbers in groups of three from the right, then o200k's */
static const char RE_AYA_DIGITS[] = "\\d{1,3}(?=(?:\\d{3})*\\b)";
/* Ling / BailingMoE: possessive quantifiers as in the original */
static const char RE_BAILING[] =
    "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]++"
    "[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+";
static const char RE_SEED_CODER[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}"
    "\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char RE_EXAONE_MOE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+";
/* DeepSeek V3 (and Hunyuan dense, JoyAI, Hy4): CJK and kana runs apart, punctuation
 * glued to the ASCII word after it */
static const char RE_CJK_KANA[] = "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+";
static const char RE_DEEPSEEK3[] =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char RE_SPARK[] =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\\r\\n]|\\s+(?!\\S)|\\s+";
static const char RE_YOUTU_CJK[] =
    "[\\x{AC00}-\\x{D7A3}\\x{3131}-\\x{318E}]+|[\\x{FF01}\\x{2026}\\x{201C}\\x{201D}\\x{2018}"
    "\\x{2019}\\x{2014}\\x{FF1A}\\x{FF1B}\\x{FF0C}\\x{3001}-\\x{303F}\\x{FE30}-\\x{FE4F}]+|"
    "[\\x{3105}-\\x{312F}]+|[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+";
/* Arcee AFMoE: numbers in groups of three from the right; CJK and Southeast Asian runs */
static const char RE_DIGITS_BY_3[] = "\\p{N}{1,3}(?=(?:\\p{N}{3})*(?!\\p{N}))";
static const char RE_AFMOE_CJK[] =
    "[\\x{4E00}-\\x{9FFF}\\x{3400}-\\x{4DBF}\\x{F900}-\\x{FAFF}\\x{3040}-\\x{309F}"
    "\\x{30A0}-\\x{30FF}\\x{FF65}-\\x{FF9F}\\x{2F00}-\\x{2FDF}\\x{E00}-\\x{E7F}"
    "\\x{E80}-\\x{EFF}\\x{1780}-\\x{17FF}\\x{1000}-\\x{109F}\\x{AA60}-\\x{AA7F}"
    "\\x{A9E0}-\\x{A9FF}\\x{AC00}-\\x{D7AF}\\x{1100}-\\x{11FF}]+";
/* DeepSeek LLM / Coder (2023): newlines, letter runs, punctuation runs, CJK + Hangul */
static const char RE_DEEPSEEK_LLM_LETTERS[] =
    "\\s?[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}"
    "\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}"
    "\\x{37F}\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}"
    "\\x{3F7}-\\x{481}\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}"
    "\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}"
    "\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}"
    "\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}"
    "\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}"
    "\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}"
    "\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}"
    "\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}"
    "\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}"
    "\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}\\x{2CF3}"
    "\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}\\x{A771}-\\x{A787}"
    "\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}"
    "\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}"
    "\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-\\x{118DF}"
    "\\x{1E900}-\\x{1E943}]+";
static const char RE_DEEPSEEK_LLM_PUNCT[] =
    "\\s?[!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}]+";
static const char RE_DEEPSEEK_CJK[] = "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+";
/* BLOOM, Poro, GPT-3 Finnish, Viking: anything up to whitespace or sentence punctuation
 * (the original "[^(\\s|[.,!?...])]" is Oniguruma's nested class, the same set) */
static const char RE_BLOOM[] =
    " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+";
/* Falcon: HF's Punctuation (ASCII punctuation or \p{P}), contiguous */
static const char RE_FALCON_PUNCT[] = "[\\p{P}$+<=>^`|~]+";
/* runs of newlines apart from the rest (SentencePiece-style vocabularies) */
static const char RE_NEWLINES[] = "[^\\n]+|[\\n]+";

/* One step of a family's pre-tokenizer: a Split (Isolated) or HF's ByteLevel step with or
 * without its GPT-2 regex (only steps after it see the mapped chars). */
enum { STEP_END, STEP_SPLIT, STEP_BYTELEVEL, STEP_BYTELEVEL_GPT2 };
typedef struct {
    int kind;
    const char *re;
} pre_step;

#define SPLIT(re) {STEP_SPLIT, re}
#define BYTELEVEL {STEP_BYTELEVEL, NULL}
#define BYTELEVEL_GPT2 {STEP_BYTELEVEL_GPT2, RE_GPT2}

typedef struct {
    const char *names[24];   /* tokenizer.ggml.pre values, NULL-terminated */
    pre_step steps[8];       /* ended by STEP_END or the array's end */
    int ignore_merges;       /* the BPE model's ignore_merges: a whole-token piece is kept */
    int nfc;                 /* the tokenizer.json normalizes NFC */
    int add_bos;             /* llama.cpp adds BOS when tokenizer.ggml.add_bos_token is absent */
    int spm_bpe;             /* raw UTF-8 symbols with <0xNN> byte fallback, spaces as U+2581 */
} pre_family;

static const pre_family FAMILIES[] = {
    /* GPT-2's ByteLevel alone (the BPE-only NeoX and RoBERTa vocabularies too) */
    {.names = {"gpt-2", "gpt2", "default", "mpt", "phi-2", "jina-es", "jina-de", "gigachat",
               "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "exaone4",
               "jais", "trillion", "granite-docling", "jina-v1-en", "jina-v2-code",
               "roberta-bpe", NULL},
     .steps = {BYTELEVEL_GPT2}},
    {.names = {"olmo", NULL},
     .steps = {BYTELEVEL_GPT2}, .nfc = 1},
    /* Digits(individual_digits) before the ByteLevel */
    {.names = {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
               "minerva-7b", "mellum2", NULL},
     .steps = {SPLIT("\\p{N}"), BYTELEVEL_GPT2}},
    /* Punctuation, ByteLevel, then Digits and three-digit groups over the mapped chars */
    {.names = {"falcon", NULL},
     .steps = {SPLIT(RE_FALCON_PUNCT), BYTELEVEL_GPT2, SPLIT("\\p{N}+"),
               SPLIT("[0-9][0-9][0-9]")}},
    {.names = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
               "midm-2.0", "lfm2", "jina-v5-nano", NULL},
     .steps = {SPLIT(RE_LLAMA3), BYTELEVEL}, .ignore_merges = 1, .add_bos = 1},
    {.names = {"dbrx", "smaug-bpe", NULL},
     .steps = {SPLIT(RE_LLAMA3), BYTELEVEL}, .ignore_merges = 1},
    {.names = {"chatglm-bpe", NULL},
     .steps = {SPLIT(RE_LLAMA3), BYTELEVEL}},
    {.names = {"glm4", "glm5", NULL},
     .steps = {SPLIT(RE_LLAMA3), BYTELEVEL}, .ignore_merges = 1},
    {.names = {"jais-2", NULL},
     .steps = {SPLIT(RE_JAIS2), BYTELEVEL}},
    {.names = {"minicpm5", NULL},
     .steps = {SPLIT("\\p{N}{1,3}"), SPLIT(RE_MINICPM5), BYTELEVEL}, .ignore_merges = 1},
    {.names = {"qwen2", "deepseek-r1-qwen", "f2llmv2", NULL},
     .steps = {SPLIT(RE_QWEN2), BYTELEVEL}, .nfc = 1},
    /* Qwen3.5 has no normalizer: llama.cpp's vectors hold a decomposed e + U+0301 */
    {.names = {"qwen35", NULL},
     .steps = {SPLIT(RE_QWEN35), BYTELEVEL}},
    {.names = {"kormo", "stablelm2", "hunyuan", "solar-open", "megrez", "grok-2", NULL},
     .steps = {SPLIT(RE_QWEN2), BYTELEVEL}},
    {.names = {"laguna", NULL},
     .steps = {SPLIT(RE_NEWLINES), SPLIT(RE_QWEN2), BYTELEVEL}},
    {.names = {"ufakzeka", NULL},
     .steps = {SPLIT(RE_UFAKZEKA), BYTELEVEL}},
    {.names = {"seed-coder", NULL},
     .steps = {SPLIT(RE_SEED_CODER), BYTELEVEL}},
    {.names = {"bailingmoe", "bailingmoe2", "llada-moe", NULL},
     .steps = {SPLIT(RE_BAILING), BYTELEVEL}},
    {.names = {"exaone-moe", NULL},
     .steps = {SPLIT(RE_EXAONE_MOE), BYTELEVEL}},
    {.names = {"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2", NULL},
     .steps = {SPLIT(RE_GPT4O), BYTELEVEL}},
    {.names = {"granite-embed-multi-97m", NULL},
     .steps = {SPLIT(RE_GPT4O), BYTELEVEL}, .ignore_merges = 1},
    {.names = {"tiny_aya", "cohere2moe", NULL},
     .steps = {SPLIT(RE_AYA_DIGITS), SPLIT(RE_GPT4O), BYTELEVEL}},
    {.names = {"tekken", NULL},
     .steps = {SPLIT(RE_TEKKEN), BYTELEVEL}, .ignore_merges = 1, .add_bos = 1},
    {.names = {"youtu", NULL},
     .steps = {SPLIT(RE_YOUTU_CJK), SPLIT(RE_YOUTU), BYTELEVEL}, .ignore_merges = 1},
    {.names = {"kimi-k2", NULL},
     .steps = {SPLIT(RE_KIMI_K2), BYTELEVEL}},
    {.names = {"deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4", NULL},
     .steps = {SPLIT("\\p{N}{1,3}"), SPLIT(RE_CJK_KANA), SPLIT(RE_DEEPSEEK3), BYTELEVEL}},
    {.names = {"spark2_5", NULL},
     .steps = {SPLIT("\\p{N}{1,3}"), SPLIT(RE_CJK_KANA), SPLIT(RE_SPARK), SPLIT("\\p{N}"),
               BYTELEVEL}},
    {.names = {"afmoe", NULL},
     .steps = {SPLIT(RE_DIGITS_BY_3), SPLIT(RE_AFMOE_CJK), SPLIT(RE_DEEPSEEK3), BYTELEVEL}},
    {.names = {"deepseek-llm", NULL},
     .steps = {SPLIT("[\\r\\n]"), SPLIT(RE_DEEPSEEK_LLM_LETTERS), SPLIT(RE_DEEPSEEK_LLM_PUNCT),
               SPLIT("\\s+$"), SPLIT(RE_DEEPSEEK_CJK), SPLIT("\\p{N}+"), BYTELEVEL}},
    {.names = {"deepseek-coder", NULL},
     .steps = {SPLIT("[\\r\\n]"), SPLIT("\\s?\\p{L}+"), SPLIT("\\s?\\p{P}+"),
               SPLIT(RE_DEEPSEEK_CJK), SPLIT("\\p{N}"), BYTELEVEL}},
    {.names = {"bloom", "poro-chat", "gpt3-finnish", NULL},
     .steps = {SPLIT(RE_BLOOM), BYTELEVEL}},
    {.names = {"viking", NULL},
     .steps = {SPLIT(RE_BLOOM), SPLIT("\\p{N}"), BYTELEVEL}},
    /* SuperBPE tokens cross spaces: only numbers are split, in threes from the right */
    {.names = {"superbpe", NULL},
     .steps = {SPLIT("\\p{N}+"), SPLIT("(?=(\\d{3})+(?!\\d))"), BYTELEVEL}},
    {.names = {"chameleon", NULL},
     .steps = {SPLIT("<sentinel:[0-9]+>"), SPLIT("(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"),
               SPLIT("([\\t\\n]|    |  )"), SPLIT("\\p{N}"), SPLIT("[\\p{P}!-/:-@\\[-`{-~]"),
               BYTELEVEL_GPT2}, .add_bos = 1},
    /* SentencePiece-style vocabularies in a BPE file (tokenizer.ggml.model "gemma4" sets
     * this one itself) */
    {.names = {"gemma4", "granite-embed-multi-311m", "sarvam-moe", NULL},
     .steps = {SPLIT(RE_NEWLINES)}, .spm_bpe = 1},
};

#undef SPLIT
#undef BYTELEVEL
#undef BYTELEVEL_GPT2

static const pre_family *find_family(const char *pre, size_t n) {
    for (size_t f = 0; f < sizeof FAMILIES / sizeof FAMILIES[0]; f++)
        for (const char *const *nm = FAMILIES[f].names; *nm; nm++)
            if (strlen(*nm) == n && !memcmp(*nm, pre, n)) return &FAMILIES[f];
    return NULL;
}

/* Fills the normalizer, pre-tokenizer and model quirks of a "gpt2" vocabulary. */
static int setup_bpe_pre(tok_tokenizer *t, const pre_family *fam, char *err, size_t errlen) {
    int n = 0, max = (int)(sizeof fam->steps / sizeof fam->steps[0]);
    while (n < max && fam->steps[n].kind != STEP_END) n++;
    t->pres = calloc((size_t)n + 1, sizeof *t->pres);
    t->norms = calloc(2, sizeof *t->norms);
    if (!t->pres || !t->norms) return SPECD_ENOMEM;
    for (int i = 0; i < n; i++) {
        const pre_step *st = &fam->steps[i];
        tok_pre *p = &t->pres[t->n_pres];
        p->kind = st->kind == STEP_SPLIT ? TOK_PRE_SPLIT : TOK_PRE_BYTELEVEL;
        p->behavior = TOK_SPLIT_ISOLATED;
        if (st->re && !(p->re = tok_regex_compile(st->re, strlen(st->re), 0, err, errlen)))
            return SPECD_EFORMAT;
        t->n_pres++;
    }
    if (fam->nfc) t->norms[t->n_norms++].kind = TOK_NORM_NFC;
    t->ignore_merges = fam->ignore_merges;
    if (fam->spm_bpe) {   /* spaces are U+2581 in the vocabulary, bytes are <0xNN> */
        t->bytelevel = t->dec_bytelevel = 0;
        t->byte_fallback = t->dec_byte_fallback = 1;
        tok_norm *nm = &t->norms[t->n_norms++];
        *nm = (tok_norm){TOK_NORM_REPLACE, strdup(" "), strdup("\xe2\x96\x81"), 1, 3};
        if (!nm->a || !nm->b) return SPECD_ENOMEM;
        memcpy(t->dec_from, "\xe2\x96\x81", 3);
        t->dec_from_len = 3;
        t->dec_to[0] = ' ';
        t->dec_to_len = 1;
    }
    return 0;
}

static int opt_id(const gguf *g, const char *key, int n_vocab) {
    int64_t v;
    if (gguf_get_i64(g, key, &v) != 0 || v < 0 || v >= n_vocab) return -1;
    return (int)v;
}

typedef struct { int id; double score; } scored;

static int score_cmp(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->id - y->id;
}

/* SentencePiece BPE: a merge (left, right) exists for every token that splits into two
 * tokens; its rank is the merged token's place in score order. */
static int spm_merges(tok_tokenizer *t, const gguf *g, const char *path, char *err,
                      size_t errlen) {
    int n = t->n_vocab;
    scored *v = malloc((size_t)n * sizeof *v);
    if (!v) return SPECD_ENOMEM;
    for (int i = 0; i < n; i++) {
        v[i].id = i;
        if (gguf_arr_f64(g, "tokenizer.ggml.scores", (uint64_t)i, &v[i].score) != 0) {
            free(v);
            return specd_errf(err, errlen, SPECD_EFORMAT,
                              "%s: tokenizer.ggml.scores missing or short", path);
        }
    }
    qsort(v, (size_t)n, sizeof *v, score_cmp);
    int rc = tok_mergemap_init(&t->merges, (size_t)n * 4);
    for (int r = 0; r < n && !rc; r++) {
        int id = v[r].id;
        const char *s = t->tok_str[id];
        size_t len = t->tok_len[id];
        for (size_t k = 1; k < len; k++) {
            if (((unsigned char)s[k] & 0xC0) == 0x80) continue;   /* char boundaries only */
            int a = tok_strmap_get(&t->vocab, s, k), b = tok_strmap_get(&t->vocab, s + k, len - k);
            if (a >= 0 && b >= 0) tok_mergemap_add(&t->merges, a, b, r, id);
        }
    }
    free(v);
    return rc;
}

static int gpt2_merges(tok_tokenizer *t, const gguf *g, const char *path, char *err,
                       size_t errlen) {
    gguf_type et;
    uint64_t n;
    if (gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n) != 0 || et != GGUF_T_STRING)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: tokenizer.ggml.merges missing", path);
    int rc = tok_mergemap_init(&t->merges, (size_t)n);
    for (uint64_t i = 0; i < n && !rc; i++) {
        const char *s;
        size_t len;
        if (gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &len) != 0) return SPECD_EFORMAT;
        /* from the second byte, as llama.cpp splits: a first token " " stays whole */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp)
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: merge %llu has no space", path,
                              (unsigned long long)i);
        int r = tok_add_merge(t, s, (size_t)(sp - s), sp + 1, len - (size_t)(sp - s) - 1,
                              (int32_t)i);
        if (r == SPECD_ENOMEM) rc = r;   /* a merge of unknown tokens is skipped, as HF */
    }
    return rc;
}

/* Control and user-defined tokens become added tokens matched in raw text. */
static int gguf_added(tok_tokenizer *t, const gguf *g, char *err, size_t errlen) {
    int n = t->n_vocab, k = 0;
    tok_added *v = calloc((size_t)n + 1, sizeof *v);
    if (!v) return SPECD_ENOMEM;
    for (int i = 0; i < n; i++) {
        int64_t ty = 1;
        gguf_arr_i64(g, "tokenizer.ggml.token_type", (uint64_t)i, &ty);
        if (ty != 2 && ty != 3 && ty != 4) continue;
        if (ty != 4) t->is_special[i] = 1;
        if (ty == 2) continue;   /* <unk> is special but HF does not match it in text */
        tok_added *a = &v[k];
        a->id = i;
        a->special = ty == 3;
        /* byte-level user-defined tokens are stored in mapped form: match their bytes */
        const char *s = t->tok_str[i];
        size_t len = t->tok_len[i];
        a->s = malloc(len + 1);
        if (!a->s) break;
        memcpy(a->s, s, len);
        a->s[len] = 0;
        a->len = (uint32_t)len;
        k++;
    }
    return tok_set_added(t, v, k, err, errlen);
}

int tok_load_gguf(tok_tokenizer *t, const char *path, char *err, size_t errlen) {
    gguf *g = gguf_open(path, err, errlen);
    if (!g) return SPECD_EFORMAT;
    int rc = SPECD_EFORMAT;
    const char *model, *pre = "default";
    size_t model_len, pre_len = 7;
    gguf_type et;
    uint64_t n;
    if (gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len) != 0) {
        specd_errf(err, errlen, SPECD_EFORMAT, "%s: no tokenizer.ggml.model", path);
        goto fail;
    }
    gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len);
    if (gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n) != 0 || et != GGUF_T_STRING ||
        n == 0 || n > (1u << 24)) {
        specd_errf(err, errlen, SPECD_EFORMAT, "%s: tokenizer.ggml.tokens missing", path);
        goto fail;
    }
    if ((rc = tok_alloc_vocab(t, (int)n))) goto nomem;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if (gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &len) != 0) {
            rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: token %llu unreadable", path,
                            (unsigned long long)i);
            goto fail;
        }
        if ((rc = tok_set_token(t, (int)i, s, len))) goto nomem;
    }
    if ((rc = tok_index_vocab(t))) goto nomem;
    for (int i = 0; i < t->n_vocab; i++) tok_strmap_add(&t->vocab, (uint32_t)i);
    t->unk_id = opt_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab);
    t->bos_id = opt_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
    t->eos_id = opt_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
    t->pad_id = opt_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab);
    const pre_family *fam = NULL;
    int gemma4 = model_len == 6 && !memcmp(model, "gemma4", 6);   /* its own model name */
    if (gemma4) {
        pre = "gemma4";
        pre_len = 6;
    }
    if ((model_len == 4 && !memcmp(model, "gpt2", 4)) || gemma4) {
        if (!(fam = find_family(pre, pre_len))) {
            rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                            "%s: tokenizer.ggml.pre '%.*s' is not a pre-tokenizer specd knows "
                            "(the names are listed in engine/text/tok_gguf.c)",
                            path, (int)pre_len, pre);
            goto fail;
        }
        t->bytelevel = t->dec_bytelevel = 1;
        if ((rc = setup_bpe_pre(t, fam, err, errlen))) goto fail;
        if ((rc = gpt2_merges(t, g, path, err, errlen))) goto fail;
    } else if (model_len == 5 && !memcmp(model, "llama", 5)) {
        t->byte_fallback = t->dec_byte_fallback = 1;
        int prefix = 1;   /* add_space_prefix = false: no leading U+2581 */
        gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &prefix);
        t->norms = calloc(2, sizeof *t->norms);
        if (!t->norms) goto nomem;
        if (prefix)
            t->norms[t->n_norms++] =
                (tok_norm){TOK_NORM_PREPEND, strdup("\xe2\x96\x81"), NULL, 3, 0};
        t->norms[t->n_norms++] =
            (tok_norm){TOK_NORM_REPLACE, strdup(" "), strdup("\xe2\x96\x81"), 1, 3};
        for (int i = 0; i < t->n_norms; i++)
            if (!t->norms[i].a || (t->norms[i].kind == TOK_NORM_REPLACE && !t->norms[i].b))
                goto nomem;
        memcpy(t->dec_from, "\xe2\x96\x81", 3);
        t->dec_from_len = 3;
        t->dec_to[0] = ' ';
        t->dec_to_len = 1;
        t->dec_strip = TOK_STRIP_FUSED;
        t->dec_strip_n = prefix;
        if ((rc = spm_merges(t, g, path, err, errlen))) goto fail;
    } else {
        rc = specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                        "%s: tokenizer.ggml.model '%.*s' is not supported (gpt2, gemma4, llama)",
                        path, (int)model_len, model);
        goto fail;
    }
    if ((rc = gguf_added(t, g, err, errlen))) goto fail;
    int add_bos = 0, add_eos = 0;
    if (gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos) != 0)
        add_bos = !fam || fam->add_bos;   /* llama.cpp's defaults: SentencePiece adds BOS */
    gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &add_eos);
    if (add_bos && t->bos_id >= 0) t->prefix_ids[t->n_prefix++] = t->bos_id;
    if (add_eos && t->eos_id >= 0) t->suffix_ids[t->n_suffix++] = t->eos_id;
    const char *tmpl;
    size_t tlen;
    if (gguf_get_str(g, "tokenizer.chat_template", &tmpl, &tlen) == 0) {
        t->chat_template = malloc(tlen + 1);
        if (!t->chat_template) goto nomem;
        memcpy(t->chat_template, tmpl, tlen);
        t->chat_template[tlen] = 0;
    }
    rc = tok_finish(t, err, errlen);
    gguf_close(g);
    return rc;
nomem:
    rc = specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", path);
fail:
    gguf_close(g);
    return rc;
}
