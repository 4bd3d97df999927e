#!/usr/bin/env python3
"""Tokenizer test vectors for specd's GGUF pre-tokenizer table (tests/test_pretok.c).

Called by scripts/fetch-tokenizer-vectors.sh; writes into OUT (models/tokenizer-vectors):

  gguf   SRC_JSON PRE NAME   a vocabulary-only GGUF NAME.gguf made from an HF
                             tokenizer.json (tokens, merges, token types, specials) with
                             tokenizer.ggml.pre = PRE, plus NAME.gguf.inp / .out: the
                             test strings and HF tokenizers' ids for them
                             (add_special_tokens=False), in llama.cpp's vocab-test format.
  tekken TEKKEN_JSON NAME    Mistral's tekken vocabulary (mistral-common's file) as the
                             GGUF llama.cpp's converter makes of it (ranks -> byte-level
                             tokens after the 1000 special ids, merges recovered from the
                             ranks), with ids from tiktoken run on the file's pattern and
                             ranks, as mistral-common's Tekkenizer runs it.
  synth  BASE_JSON           for each pre-tokenizer family below, synth-<pre>.inp / .out:
                             HF tokenizers' ids on BASE_JSON's vocabulary (Llama 3's)
                             with the pre-tokenizer (and normalizer, ignore_merges) swapped
                             for that family's, written the way a tokenizer.json writes it
                             (Digits, Punctuation, Split with Oniguruma syntax such as
                             "&&" classes and possessive quantifiers). The C test loads
                             synth-base.gguf with tokenizer.ggml.pre rewritten to <pre>.

Everything is deterministic, so the files can be cached and regenerated at will.
"""
import json
import struct
import sys

from tokenizers import Tokenizer

SEP = "\n__ggml_vocab_test__\n"

# Strings that exercise what the families' patterns differ on: digits (ASCII and not),
# case changes, contractions, CJK / kana / Hangul / Han, combining marks, punctuation runs,
# whitespace runs, and the bytes ByteLevel maps to numeric chars (U+00B2 ...).
EXTRA = [
    "1234567 12 123 1234 12345678901",
    "\u0663\u0664\u0665 and \u0968\u0969 and \u00b2\u00b3 x\u00b2",
    "\u00f2\u00f3\u00b9 \u00bd \u00bc\u00be",
    "HTTPServerError parseJSONString iPhone McDonald's",
    "don't I'M WE'LL they've she'd It'S",
    "\u4e2d\u6587\u5b57\u7b26\u548c\u65e5\u672c\u8a9e\u306e\u3072\u3089\u304c\u306a\u30ab\u30bf\u30ab\u30ca",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 \u3131\u3134 \u3105\u3106",
    "e\u0301te\u0301 cafe\u0301 \u1100\u1161\u11a8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0646\u0639\u0645\u06d4",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e\u0964",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u1798\u17b6\u1793",
    "\u0130stanbul'da ya\u015f\u0131yorum, d\u00fcnya'n\u0131n",
    "!!!??? ... ,,, ;;; (((x))) [a]{b}<c> $5+3=8 ^_^ a|b ~x `y`",
    "\uff01\uff1f\u3002\uff0c\u3001\u201c\u201d\u2018\u2019\u2026\u2014",
    "tabs\tand\t\tspaces    and\r\nwindows\r\n\r\nlines\n\n\n\nend",
    "   leading and trailing   ",
    "<sentinel:12> IMGIMGABCZ text IMGIMGAZ",
    "x    y  z\t\tw",
    "\U0001f600\U0001f44d\U0001f3fd emoji \u2764\ufe0f",
    "def f(x):\n    return x**2  # square\n",
    "a.b,c!d?e\u2026f\u3002g",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u041f\u0440\u0438\u0432\u0435\u0442 \u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0",
    "\u00e9\u00e0\u00fc \u00b5 \u0130 \u0131 \u00df \ufb01",
    "\u2160\u2161\u2162 \u2460\u2461 \u00b9\u00b2\u00b3 \u0660\u0661",
    "1,234,567.89 and 3.14159 and 10^10",
    "https://example.com/path?query=1&b=2#frag",
    "\u200b\u200c\u200d\ufeff zero width",
    "ALLCAPS lowercase MixedCase camelCase snake_case",
]


def inp_strings(fixture_inp):
    """llama.cpp's 46 test strings (from a fixture .inp) plus EXTRA."""
    text = open(fixture_inp, encoding="utf-8").read()
    parts = text.split(SEP)
    assert parts[-1] == "", "unexpected .inp tail"
    return parts[:-1] + EXTRA


def write_vectors(tok, strings, path):
    with open(path + ".inp", "w", encoding="utf-8", newline="") as f:
        for s in strings:
            f.write(s + SEP)
    with open(path + ".out", "w", encoding="utf-8") as f:
        for s in strings:
            ids = tok.encode(s, add_special_tokens=False).ids
            f.write(" ".join(str(i) for i in ids) + "\n")


# ---- a minimal GGUF v3 writer (metadata only, no tensors) ----

T_UINT32, T_INT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 7, 8, 9


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv(key, typ, val):
    out = _str(key) + struct.pack("<I", typ)
    if typ == T_STRING:
        return out + _str(val)
    if typ == T_UINT32:
        return out + struct.pack("<I", val)
    if typ == T_BOOL:
        return out + struct.pack("<B", 1 if val else 0)
    etyp, items = val
    out += struct.pack("<IQ", etyp, len(items))
    if etyp == T_STRING:
        return out + b"".join(_str(x) for x in items)
    return out + b"".join(struct.pack("<i", x) for x in items)


def write_gguf(src_json, pre, out_path):
    """tokenizer.json -> vocabulary GGUF, laid out as llama.cpp's converter lays it out."""
    j = json.load(open(src_json, encoding="utf-8"))
    model = j["model"]
    assert model["type"] == "BPE", "only BPE tokenizer.json files"
    vocab = dict(model["vocab"])
    added = {a["id"]: a for a in j.get("added_tokens", [])}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n   # unused
    for s, i in vocab.items():
        tokens[i] = s
        types[i] = 1
    for i, a in added.items():
        types[i] = 3 if a.get("special") else 4   # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    kvs = [
        _kv("general.architecture", T_STRING, "llama"),
        _kv("tokenizer.ggml.model", T_STRING, "gpt2"),
        _kv("tokenizer.ggml.pre", T_STRING, pre),
        _kv("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, tokens)),
        _kv("tokenizer.ggml.token_type", T_ARRAY, (T_INT32, types)),
        _kv("tokenizer.ggml.merges", T_ARRAY, (T_STRING, merges)),
        _kv("tokenizer.ggml.add_bos_token", T_BOOL, False),
    ]
    with open(out_path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))


# ---- the pre-tokenizer families as their tokenizer.json files write them ----


def split(p):
    return {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}


def digits(individual):
    return {"type": "Digits", "individual_digits": individual}


def bytelevel(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": use_regex}


PUNCT = {"type": "Punctuation", "behavior": "Contiguous"}
C = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3 = C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
UP, LO = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{UP}*{LO}+{C}?|[^\r\n\p{{L}}\p{{N}}]?{UP}+{LO}*{C}?|\p{{N}}{{1,3}}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DS3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
HANGUL_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
BLOOM = " ?[^(\\s|[.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c])]+"
KUP = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KLO = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"

FAMILIES = {   # pre name: (pre_tokenizer steps, normalizer NFC, ignore_merges)
    "gpt-2": ([bytelevel(True)], False, False),
    "olmo": ([bytelevel(True)], True, False),
    "starcoder": ([digits(True), bytelevel(True)], False, False),
    "falcon": ([PUNCT, bytelevel(True), digits(False), split("[0-9][0-9][0-9]")], False, False),
    "llama-bpe": ([split(LLAMA3), bytelevel(False)], False, True),
    "dbrx": ([split(LLAMA3), bytelevel(False)], False, True),
    "chatglm-bpe": ([split(LLAMA3), bytelevel(False)], False, False),
    "glm4": ([split(LLAMA3), bytelevel(False)], False, True),
    "jais-2": ([split(C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                      r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
                      r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"),
                bytelevel(False)], False, False),
    "minicpm5": ([split(r"\p{N}{1,3}"),
                  split(C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                            r"|\s*[\r\n]+|\s+(?!\S)|\s+"), bytelevel(False)], False, True),
    "qwen2": ([split(QWEN2), bytelevel(False)], True, False),
    "qwen35": ([split(C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+"), bytelevel(False)], False, False),
    "stablelm2": ([split(QWEN2), bytelevel(False)], False, False),
    "laguna": ([split(r"[^\n]+|[\n]+"), split(QWEN2), bytelevel(False)], False, False),
    "ufakzeka": ([split(r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                        r"|\s+(?!\S)|\s+"), bytelevel(False)], False, False),
    "seed-coder": ([split(C + "|[^\r\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\r\n]+"
                          "|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"), bytelevel(False)], False, False),
    "bailingmoe": ([split(r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}"
                          r"| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"),
                    bytelevel(False)], False, False),
    "exaone-moe": ([split(C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                          r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"),
                    bytelevel(False)], False, False),
    "gpt-4o": ([split(GPT4O), bytelevel(False)], False, False),
    "granite-embed-multi-97m": ([split(GPT4O), bytelevel(False)], False, True),
    "tiny_aya": ([split(r"\d{1,3}(?=(?:\d{3})*\b)"), split(GPT4O), bytelevel(False)], False, False),
    "tekken": ([split(rf"[^\r\n\p{{L}}\p{{N}}]?{UP}*{LO}+|[^\r\n\p{{L}}\p{{N}}]?{UP}+{LO}*|\p{{N}}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                bytelevel(False)], False, True),
    "youtu": ([split("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014"
                     "\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|"
                     "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),
               split(rf"[^\r\n\p{{L}}\p{{N}}]?{UP}*{LO}+{C}?|[^\r\n\p{{L}}\p{{N}}]?{UP}+{LO}*{C}?"
                     r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
               bytelevel(False)], False, True),
    "kimi-k2": ([split(rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{KUP}*{KLO}+{C}?"
                       rf"|[^\r\n\p{{L}}\p{{N}}]?{KUP}+{KLO}*{C}?|\p{{N}}{{1,3}}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                 bytelevel(False)], False, False),
    "deepseek-v3": ([split(r"\p{N}{1,3}"), split(KANA), split(DS3), bytelevel(False)], False, False),
    "spark2_5": ([split(r"\p{N}{1,3}"), split(KANA),
                  split(r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                        r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]"
                        r"|\s+(?!\S)|\s+"), digits(True), bytelevel(False)], False, False),
    "afmoe": ([split(r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"),
               split("[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff"
                     "\uff65-\uff9f\u2f00-\u2fdf\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff"
                     "\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+"),
               split(DS3), bytelevel(False)], False, False),
    "deepseek-llm": ([split("[\r\n]"),
                      split("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf"
                            "\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d"
                            "\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
                            "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
                            "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
                            "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
                            "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
                            "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
                            "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
                            "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
                            "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
                            "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
                            "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
                            "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
                            "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
                            "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
                            "\U0001e900-\U0001e943]+"),
                      split("\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"),
                      split(r"\s+$"), split(HANGUL_CJK), digits(False), bytelevel(False)],
                     False, False),
    "deepseek-coder": ([split("[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"),
                        split(HANGUL_CJK), digits(True), bytelevel(False)], False, False),
    "bloom": ([split(BLOOM), bytelevel(False)], False, False),
    "viking": ([split(BLOOM), digits(True), bytelevel(False)], False, False),
    "superbpe": ([split(r"\p{N}+"), split(r"(?=(\d{3})+(?!\d))"), bytelevel(False)], False, False),
    "chameleon": ([split("<sentinel:[0-9]+>"), split("(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"),
                   split("([\\t\\n]|    |  )"), digits(True), split(r"[\p{P}!-/:-@\[-`{-~]"),
                   bytelevel(True)], False, False),
}


def synth(base_json, fixture_inp, out_dir):
    base = json.load(open(base_json, encoding="utf-8"))
    strings = inp_strings(fixture_inp)
    for pre, (steps, nfc, ignore_merges) in FAMILIES.items():
        j = json.loads(json.dumps(base))
        j["normalizer"] = {"type": "NFC"} if nfc else None
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": steps}
        j["model"]["ignore_merges"] = ignore_merges
        j["post_processor"] = None
        tok = Tokenizer.from_str(json.dumps(j))
        write_vectors(tok, strings, f"{out_dir}/synth-{pre}")
    write_gguf(base_json, "llama-bpe", f"{out_dir}/synth-base.gguf")
    with open(f"{out_dir}/synth-families.txt", "w") as f:
        f.write("\n".join(FAMILIES) + "\n")


# ---- tekken (tiktoken ranks) ----

def byte_level(b):
    """GPT-2's byte -> char map: printable Latin-1 stays, the rest go to U+0100.."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for x in range(256):
        if x in keep:
            table[x] = chr(x)
        else:
            table[x] = chr(256 + extra)
            extra += 1
    return "".join(table[x] for x in b)


def rank_split(ranks, token, max_rank):
    """The two parts BPE over `ranks` builds `token` from, using only ranks < max_rank."""
    parts = [bytes([x]) for x in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def write_tekken(tekken_json, fixture_inp, out_dir, name):
    import base64
    import tiktoken
    j = json.load(open(tekken_json, encoding="utf-8"))
    cfg = j["config"]
    n_special = cfg["default_num_special_tokens"]
    n_ranks = cfg["default_vocab_size"] - n_special
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in j["vocab"][:n_ranks]}
    tokens = [f"<SPECIAL_{i}>" for i in range(n_special)]
    types = [3] * n_special
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    merges = []
    for b, r in by_rank:
        tokens.append(byte_level(b))
        types.append(1)
        if len(b) > 1:
            parts = rank_split(ranks, b, r)
            assert len(parts) == 2, (b, parts)
            merges.append(byte_level(parts[0]) + " " + byte_level(parts[1]))
    kvs = [
        _kv("general.architecture", T_STRING, "llama"),
        _kv("tokenizer.ggml.model", T_STRING, "gpt2"),
        _kv("tokenizer.ggml.pre", T_STRING, "tekken"),
        _kv("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, tokens)),
        _kv("tokenizer.ggml.token_type", T_ARRAY, (T_INT32, types)),
        _kv("tokenizer.ggml.merges", T_ARRAY, (T_STRING, merges)),
        _kv("tokenizer.ggml.add_bos_token", T_BOOL, False),
    ]
    path = f"{out_dir}/{name}.gguf"
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    enc = tiktoken.Encoding(name="tekken", pat_str=cfg["pattern"], mergeable_ranks=ranks,
                            special_tokens={})
    strings = inp_strings(fixture_inp)
    with open(path + ".inp", "w", encoding="utf-8", newline="") as f:
        for s in strings:
            f.write(s + SEP)
    with open(path + ".out", "w", encoding="utf-8") as f:
        for s in strings:
            f.write(" ".join(str(i + n_special) for i in enc.encode_ordinary(s)) + "\n")


def main():
    cmd, out_dir = sys.argv[1], sys.argv[2]
    if cmd == "gguf":
        src, pre, name, fixture_inp = sys.argv[3:7]
        write_gguf(src, pre, f"{out_dir}/{name}.gguf")
        write_vectors(Tokenizer.from_file(src), inp_strings(fixture_inp), f"{out_dir}/{name}.gguf")
    elif cmd == "tekken":
        write_tekken(sys.argv[3], sys.argv[5], out_dir, sys.argv[4])
    elif cmd == "synth":
        synth(sys.argv[3], sys.argv[4], out_dir)
    else:
        sys.exit(f"tokvec.py: unknown command {cmd}")


if __name__ == "__main__":
    main()
