"""Shared by scripts that compare specd with Hugging Face on the same tokenizer file
(scripts/tokcheck_gguf.py, scripts/bench_grammar_peers.py): HF's tokenizer for a
tokenizer.json, a checkpoint directory or a GGUF file (transformers' own conversion, which
reads metadata only, so torch may be absent: a stand-in module satisfies the imports), and
specd's ids for a text."""
import json
import os
import subprocess
import sys
import tempfile
import types


# --- torch stand-in (only where torch is absent) ---------------------------------------

class _Anything:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Anything()

    def __getattr__(self, n):
        return _Anything()


class _Torch(types.ModuleType):
    def __getattr__(self, n):
        return _Anything


def torch_stand_in():
    try:
        import torch  # noqa: F401
        return False
    except ImportError:
        pass
    try:
        import tvm_ffi  # noqa: F401  (xgrammar's FFI: imported first, so it sees no torch)
    except ImportError:
        pass
    import transformers  # noqa: F401  (checks for torch by spec: before the stand-in)
    sys.modules["torch"] = _Torch("torch")
    return True


# --- tokenizers ------------------------------------------------------------------------

def hf_tokenizer(path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if path.endswith(".gguf"):
        import transformers.modeling_gguf_pytorch_utils as g
        g.is_torch_available = lambda: True   # metadata only: no tensor is read
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    if os.path.isdir(path):
        return PreTrainedTokenizerFast.from_pretrained(path)
    # tokenizer.json: with its directory's tokenizer_config.json (eos) when there is one
    d = os.path.dirname(path) or "."
    if os.path.exists(os.path.join(d, "tokenizer_config.json")) and os.path.basename(path) == "tokenizer.json":
        return PreTrainedTokenizerFast.from_pretrained(d)
    return PreTrainedTokenizerFast(tokenizer_file=path)


def specd_ids(specd, path, text):
    with tempfile.NamedTemporaryFile("w", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        r = subprocess.run([specd, "tokenize", "--tokenizer", path, "--text-file", f.name, "--json"],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(r.stdout)["ids"]
