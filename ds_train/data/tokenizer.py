"""Tokenizers: the byte-level BPE `prepare` trains when none is given, and loading a tokenizer
directory with one line naming the file and the fix when it cannot be loaded."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ds_train.data.fingerprint import TOKENIZER_FILES
from ds_train.data.meta import META
from ds_train.errors import UserError

EOS = "<|endoftext|>"
MARKER = re.compile(r"<\|[A-Za-z0-9_.:-]{1,40}\|>")  # a chat template's role and turn markers: <|im_start|>, <|eot_id|>


def template_markers(chat_template: str) -> list[str]:
    """The `<|...|>` markers a chat template writes, in order of first use: each becomes one special token of
    the BPE, as in the tokenizers the templates come from (so a turn ends with one token, which stops a
    completion, and no marker is split or merged with text)."""
    return [m for m in dict.fromkeys(MARKER.findall(chat_template)) if m != EOS]


# --- prepare -------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, chat_template: str = "",
                    split_digits: bool = False):
    """A byte-level BPE (GPT-2 style) trained locally: no hub needed. Saved as a HF tokenizer dir. The chat
    template's markers are special tokens (template_markers).
    split_digits: every digit is its own token (as in Llama's and DeepSeek's tokenizers), so a number
    reads the same digit by digit wherever it stands."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    markers = template_markers(chat_template)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, *markers], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   **({"additional_special_tokens": markers} if markers else {}))
    if chat_template:
        fast.chat_template = chat_template  # saved with it: a model exported from the run renders chats alike
    fast.save_pretrained(str(out_dir))
    return fast


def _is_prepared_tokenizer(path: Path) -> bool:
    """`path` is the BPE `prepare` trained into a data directory (data.dir/tokenizer)."""
    return path.name == "tokenizer" and (path.parent / META).is_file()


def _tokenizer_fix(path: Path) -> str:
    """How to repair the tokenizer directory `path`: it is a prepared data.dir's own, a model
    directory's, or one given as data.tokenizer."""
    if _is_prepared_tokenizer(path):
        return (f"it is the tokenizer `ds-train prepare` trained into {str(path.parent)!r}: prepare that "
                f"directory again (data.reprepare=true with data.sources, or `ds-train prepare --overwrite`)")
    if (path / "config.json").is_file():
        return "re-export or re-download the model directory"
    return "save the tokenizer there again (save_pretrained), or point data.tokenizer at another one"


def _tokenizer_file_problem(path: Path) -> str:
    """The first tokenizer JSON file in `path` that is not a UTF-8 JSON object, as `FILE is ...`."""
    for name in (*[n for n in TOKENIZER_FILES if n.endswith(".json")], "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            return f"{str(file)!r} is not UTF-8 text"
        except json.JSONDecodeError as e:
            return f"{str(file)!r} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        if not isinstance(value, dict):
            return f"{str(file)!r} is not a JSON object"
    return ""


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer in directory `path`; one line naming the file and the fix when it
    cannot be loaded."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' config validators
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        fix = (_tokenizer_fix(path) if _is_prepared_tokenizer(path) else
               "point data.tokenizer (or model.path) at a tokenizer directory")
        raise UserError(f"tokenizer: {str(path)!r} is not a directory; {fix}")
    problem = _tokenizer_file_problem(path)
    if problem:
        raise UserError(f"tokenizer: {problem}; {_tokenizer_fix(path)}")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as e:
        said = " ".join(f"{type(e).__name__}: {e}".split())
        said = said if len(said) <= 200 else said[:200] + "..."
        raise UserError(f"tokenizer: cannot load {str(path)!r} ({said}); {_tokenizer_fix(path)}") from None


def vocabulary_id(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary: the same ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def content_id(tokenizer) -> str:
    """A short hash of what a tokenizer is, not where it lies: its model, vocabulary, merges,
    normaliser, pre-tokeniser, added tokens (tokenizer.json's contents, without the padding and
    truncation settings, which are the caller's), its special tokens and chat template. A copy saved
    elsewhere (save_pretrained) hashes the same; another tokenizer does not."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("padding", None)
        spec.pop("truncation", None)
    else:  # a slow tokenizer: its vocabulary
        spec = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])}
    spec["special_tokens"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    spec["chat_template"] = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_content_id(path: str | Path) -> str:
    """content_id of the tokenizer in directory `path` (load_tokenizer's checks)."""
    return content_id(load_tokenizer(path))
