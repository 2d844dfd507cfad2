"""Text in and out: the model's ``tokenizer.json``, its chat template, streaming detokenization, stop strings.

The chat template comes from ``tokenizer_config.json``: it is code handed in with a model, so it is
rendered in jinja2's immutable sandbox (no attribute access to Python internals, no mutation of the
objects passed in), never with a plain environment. Pure Python: no torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class TextError(ValueError):
    """A tokenizer or chat template that cannot be used; one line naming the file."""


class TemplateInputError(ValueError):
    """The chat template refused the messages (its ``raise_exception``): the client's fault."""


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ModelText:
    """A model's tokenizer and chat template; thread-safe for encode/decode."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        d = Path(model_dir)
        path = d / TOKENIZER_FILE
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises its own exception type
            raise TextError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0]})") from None
        self.config: dict[str, Any] = {}
        cfg_path = d / TOKENIZER_CONFIG_FILE
        if cfg_path.exists():
            try:
                self.config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise TextError(f"{cfg_path}: not valid JSON (line {e.lineno}: {e.msg})") from None
            if not isinstance(self.config, dict):
                raise TextError(f"{cfg_path}: expected a JSON object")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.template = None
        self.template_source = None
        chat = self.config.get("chat_template")
        if isinstance(chat, list):  # several named templates: take "default"
            chat = next((t.get("template") for t in chat if isinstance(t, dict) and t.get("name") == "default"), None)
        if chat is not None:
            if not isinstance(chat, str):
                raise TextError(f"{cfg_path}: field 'chat_template' must be a string")
            self.template = _compile_template(chat, cfg_path)
            self.template_source = str(cfg_path)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (role/content dicts), as Hugging Face renders it."""
        if self.template is None:
            raise TextError("the model has no chat template (tokenizer_config.json 'chat_template')")
        from jinja2 import TemplateError
        from jinja2.sandbox import SecurityError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateInputError:
            raise
        except SecurityError as e:
            raise TextError(f"{self.template_source}: the chat template did something the sandbox forbids "
                            f"({e})") from None
        except TemplateError as e:
            raise TextError(f"{self.template_source}: the chat template failed ({e})") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat; the template writes any special tokens itself."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _raise_exception(message: str) -> None:
    raise TemplateInputError(message)


def _compile_template(source: str, where: Path):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Hugging Face's settings: trim_blocks/lstrip_blocks, loop controls, raise_exception and tojson.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TextError(f"{where}: field 'chat_template' does not compile ({e})") from None


def load_text(model_dir: str | Path) -> ModelText | None:
    """The model's text side, or None where the directory has no ``tokenizer.json`` (token ids only)."""
    if not (Path(model_dir) / TOKENIZER_FILE).exists():
        return None
    return ModelText(model_dir)


# ------------------------------------------------------------------------------ streaming output


class Detokenizer:
    """Text of a growing list of token ids, piece by piece.

    Decodes a short window of recent ids (as vLLM and transformers' streamers do) and holds back
    text while it ends in an incomplete UTF-8 sequence, so that each piece is final.
    """

    def __init__(self, text: ModelText | None):
        self.text = text
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already emitted
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.text is None:
            return ""
        before = self.text.decode(self.ids[self._prefix: self._read])
        now = self.text.decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end, as the replacement character)."""
        if self.text is None or self._read == len(self.ids):
            return ""
        before = self.text.decode(self.ids[self._prefix: self._read])
        now = self.text.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return now[len(before):]


@dataclass
class StopResult:
    text: str  # text that may be sent now
    stopped: bool  # a stop string was found; nothing after it is sent


class StopMatcher:
    """Stop strings over streamed text: sends text only once no stop string can start inside it."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> StopResult:
        if not self.stops:
            return StopResult(piece, False)
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return StopResult(buf[: min(hits)], True)
        # Hold back the longest tail of buf that is a prefix of some stop string.
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return StopResult(buf[: len(buf) - keep], False)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
