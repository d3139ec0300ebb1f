"""FLUX.2 [dev]'s prompt format for its Mistral Small 3.1 encoder, and the byte-level Tekken tokenizer its random
presets read.

What `Flux2Pipeline` tokenises: one system message (BFL's, `SYSTEM_MESSAGE`) and one user message rendered by the
processor's chat template, `<s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt}[/INST]` (no generation prompt;
"[IMG]" is removed from the prompt first), tokenised without added special tokens and padded to 512 with the
tokenizer's own pad token and padding side. `chat_prompt` renders that string (no folder's Jinja is run);
`check_chat_template` refuses a folder whose template renders it otherwise.

The real vocabulary (Tekken: 1000 control ids, then 130,072 byte-level BPE ranks) comes with a checkpoint's
`tokenizer/` folder: it is not shipped, since no packaged copy is shown here to give the published folder's ids.
`tekken_bytes_tokenizer` is the smallest faithful stand-in for the random presets, built from code with no asset:
Tekken's control tokens at their ids (mistral_common's list, filler `<SPECIAL_n>` up to 999) and its first 256 ranks,
the single bytes, at 1000 + byte, with no merges; a real prompt is more ids there than with the folder's merges.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .. import safe_files
from .tokenizer import bytes_to_unicode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# BFL's system message for prompt encoding (the pipeline's `SYSTEM_MESSAGE`, from black-forest-labs/flux2)
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
BOS, PAD = "<s>", "<pad>"
# Tekken's control tokens by id (mistral_common's list); ids 20..999 are fillers `<SPECIAL_n>`
CONTROLS = ("<unk>", BOS, "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", PAD, "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
            "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")
N_CONTROLS = 1000
VOCAB_SIZE = 131072  # Mistral Small 3.1's embedding rows
# the system + user turns of the processor's template (strings or lists of text parts), nothing else
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'] | selectattr('type', "
    "'equalto', 'text') | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}{%- endfor %}")


def chat_prompt(prompt: str, system: str = SYSTEM_MESSAGE) -> str:
    """The string the pipeline's template renders for `prompt` (its `format_input`: "[IMG]" removed)."""
    return f"{BOS}[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt.replace('[IMG]', '')}[/INST]"


def check_chat_template(tokenizer: "PreTrainedTokenizerFast") -> None:
    """ValueError unless the tokenizer's chat template (where it has one) renders a system and a user message as
    `chat_prompt` does."""
    if not getattr(tokenizer, "chat_template", None):
        return
    probe = [{"role": "system", "content": [{"type": "text", "text": "S"}]},
             {"role": "user", "content": [{"type": "text", "text": "P"}]}]
    rendered = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    if rendered != chat_prompt("P", "S"):
        raise ValueError(f"its chat template renders {rendered!r}, not Mistral Small 3.1's {chat_prompt('P', 'S')!r}; "
                         "restore the published tokenizer folder")


def read_tokenizer(folder: str, label: str) -> "PreTrainedTokenizerFast":
    """The tokenizer of a checkpoint's `tokenizer/` folder (`label` names it in errors), its JSON checked before the
    library parses it and its chat template checked (`check_chat_template`); each problem a one-line ValueError."""
    from transformers import AutoTokenizer

    bad = safe_files.bad_json_file(folder)
    if bad is not None:
        raise ValueError(f"{label}: {bad[0]} {bad[1]}")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{label} holds no tokenizer.json or tokenizer_config.json: give the checkpoint's tokenizer "
                         "folder")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    try:
        check_chat_template(tokenizer)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    return tokenizer


def tokenizer_source(path: str) -> tuple[str, int | None]:
    """(the tokenizer folder, the text encoder's attention head width or None) of a folder given for a split model's
    tokenizer: its `tokenizer/` folder itself, or the diffusers folder holding it, whose text_encoder/config.json
    says the head width (`text_config.head_dim`); a head width that is not a positive integer is a ValueError."""
    config = os.path.join(path, "text_encoder", "config.json")
    if not os.path.isdir(os.path.join(path, "tokenizer")):
        return path, None
    head = None
    if os.path.isfile(config):
        try:
            values = safe_files.read_json(config, 1 << 20)[0]
        except safe_files.UnusableFile as e:
            raise ValueError(f"{config} {e}") from None
        head = (values.get("text_config") or values).get("head_dim") if isinstance(values, dict) else None
        if head is not None and (not isinstance(head, int) or head <= 0):
            raise ValueError(f"{config}: head_dim {head!r} is not a positive integer; restore the published config")
    return os.path.join(path, "tokenizer"), head


def tekken_bytes_tokenizer() -> "PreTrainedTokenizerFast":
    """Tekken's control tokens and byte ranks without merges (see the module's docstring), right padding with
    `<pad>`, the template above; no special tokens added on encoding (the template writes `<s>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = bytes_to_unicode()
    vocab = {name: i for i, name in enumerate(CONTROLS)}
    vocab.update({f"<SPECIAL_{i}>": i for i in range(len(CONTROLS), N_CONTROLS)})
    vocab.update({alphabet[b]: N_CONTROLS + b for b in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(vocab)[:N_CONTROLS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token="</s>", unk_token="<unk>",
                                   pad_token=PAD, padding_side="right", truncation_side="right",
                                   model_max_length=VOCAB_SIZE, clean_up_tokenization_spaces=False,
                                   chat_template=CHAT_TEMPLATE)
