"""CLIP's real 49,408-token BPE vocabulary, as tokenizer folders that transformers' CLIPTokenizer reads.

Owns the vendored merge list (`assets/clip/bpe_simple_vocab_16e6.txt.gz`, from open-clip-torch 3.3.0, MIT; its
licence lies beside it) and the one recipe that turns it into CLIP's vocabulary, the way OpenAI's CLIP
`simple_tokenizer` does: skip the version header, keep the first 48,894 merges; ids are the 256 byte-alphabet
characters, the same with "</w>", each merge joined in merge order, then <|startoftext|> (49406) and
<|endoftext|> (49407). Hands model loading a folder (vocab.json, merges.txt, tokenizer_config.json,
special_tokens_map.json) laid out like the Hugging Face repos' `tokenizer/` (pad with the end token, SD1.x)
or `tokenizer_2/` (pad with "!", SD2 and SDXL), built once under a cache root and reused.

Standard library only: importing this module never loads torch or transformers.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile

from .tokenizer import BOS, EOS, bytes_to_unicode

VOCAB_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "clip",
                          "bpe_simple_vocab_16e6.txt.gz")
VOCAB_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
VOCAB_SIZE = 49408
MAX_LENGTH = 77
# 49152 BPE tokens in CLIP, less the 256 byte tokens and the 2 specials; the file holds more merges than CLIP used
N_MERGES = 49152 - 256 - 2
# bumped whenever the files written below change, so an old cached folder is never reused for a new layout
FOLDER_FORMAT = 1


def _read_merges() -> list[str]:
    """The merge lines CLIP uses ("a b", rank order), after checking the vendored file is the one we shipped."""
    try:
        with open(VOCAB_FILE, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"CLIP's vocabulary file {VOCAB_FILE} cannot be read ({e}); the diffgraph install is "
                         f"damaged: reinstall it (pip install --force-reinstall diffgraph)") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256:
        raise ValueError(f"CLIP's vocabulary file {VOCAB_FILE} has sha256 {digest}, expected {VOCAB_SHA256}; the "
                         f"diffgraph install is damaged: reinstall it (pip install --force-reinstall diffgraph)")
    lines = gzip.decompress(data).decode("utf-8").split("\n")
    return [" ".join(line.split()) for line in lines[1:N_MERGES + 1]]


def build_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """CLIP's vocabulary (token -> id) and its merge list ("a b" strings, rank order), from the vendored file."""
    merges = _read_merges()
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet] + [m.replace(" ", "") for m in merges] + [BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(merges) != N_MERGES or len(vocab) != VOCAB_SIZE:
        raise ValueError(f"CLIP's vocabulary file {VOCAB_FILE} gave {len(merges)} merges and {len(vocab)} tokens, "
                         f"expected {N_MERGES} and {VOCAB_SIZE}; reinstall diffgraph")
    return vocab, merges


def write_clip_tokenizer(folder: str, pad_token: str = EOS) -> None:
    """Writes CLIP's tokenizer files into `folder`, as the Hugging Face repos ship them. SD1.x's tokenizer pads
    with the end token (the default), SD2's and SDXL's `tokenizer_2` with "!" (id 0)."""
    vocab, merges = build_vocab_and_merges()
    if pad_token not in vocab:
        # an unknown pad token would be added as id 49408, past the end of the text encoder's embedding table
        raise ValueError(f"pad token {pad_token!r} is not in CLIP's vocabulary; use {EOS!r} (SD1.x) or '!' "
                         f"(SD2, SDXL's second tokenizer)")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": pad_token}
    config = {
        **specials,
        "add_prefix_space": False,
        "do_lower_case": True,
        "errors": "replace",
        "model_max_length": MAX_LENGTH,
        "tokenizer_class": "CLIPTokenizer",
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(specials, f, indent=2)


def _folder_name(pad_token: str) -> str:
    """`clip-<pad kind>-v<format>-<vocab hash prefix>`: one folder per pad token, file layout and vocabulary."""
    kind = {EOS: "pad-eos", "!": "pad-bang"}.get(pad_token)
    if kind is None:
        kind = "pad-" + hashlib.sha256(pad_token.encode("utf-8")).hexdigest()[:8]
    return f"clip-{kind}-v{FOLDER_FORMAT}-{VOCAB_SHA256[:12]}"


def clip_tokenizer_folder(cache_root: str, pad_token: str = EOS) -> str:
    """The path of a CLIP tokenizer folder under `cache_root`, written on the first call and reused after.

    The files are written to a temporary folder beside the final one and renamed into place, so a folder that
    exists is complete. Processes that race both build; the first rename wins and the others use its folder.
    """
    final = os.path.join(cache_root, _folder_name(pad_token))
    if os.path.isdir(final):
        return final
    os.makedirs(cache_root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}-", dir=cache_root)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared by several users
        write_clip_tokenizer(tmp, pad_token)
        os.rename(tmp, final)
    except OSError:
        # another process renamed its folder into place first (the rename of a folder onto a non-empty one fails)
        if not os.path.isdir(final):
            raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def default_cache_root() -> str:
    """Where tokenizer folders are cached: $DIFFGRAPH_CACHE, else $XDG_CACHE_HOME/diffgraph, else
    ~/.cache/diffgraph."""
    if os.environ.get("DIFFGRAPH_CACHE"):
        return os.environ["DIFFGRAPH_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diffgraph")
