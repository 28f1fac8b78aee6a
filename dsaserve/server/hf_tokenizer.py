"""A checkpoint's tokenizer and chat template, without transformers (request path stages 1 and 10).

Owns: loading `tokenizer.json` with the `tokenizers` library, reading `tokenizer_config.json` (special
tokens, `chat_template`), and rendering the chat template with jinja2 the way transformers'
`apply_chat_template` does: an immutable sandbox with trim_blocks/lstrip_blocks and loop controls, a
`tojson` filter that does not HTML-escape, `raise_exception` and `strftime_now` globals, the special
tokens as variables, and the `{% generation %}` tag accepted (rendered as its body). Both the
TokenizerManager (encode) and the detokenizer process (decode) load it; jinja2 is imported with the first
chat template compiled (the detokenizer never renders one, and neither process needs it to start).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from dsaserve.config import read_json_object
from dsaserve.errors import CheckpointError
from dsaserve.weights.checkpoint_check import tokenizer_file

if TYPE_CHECKING:
    import jinja2

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character table, inverted (what a ByteLevel decoder undoes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _gpt2_byte_alphabet()


def _display_text(raw: bytes) -> str:
    """A token's bytes as logprobs show them: the text, or OpenAI's `bytes:\\xNN` where they are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class ChatTemplateError(ValueError):
    """The template is missing, or it raised (e.g. `raise_exception('unknown role')`)."""


@cache
def _generation_tag() -> type:
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text; here it is a no-op
    (the jinja2 extension class, made with the first compiled template)."""
    import jinja2.ext
    import jinja2.nodes

    class _GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return _GenerationTag


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(v: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as an AddedToken dict with 'content'."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json of one checkpoint directory."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        path = tokenizer_file(d)
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for unparsable files
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None
        self._strings: dict[int, tuple[str, list[int]]] = {}  # token_strings' memo
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = read_json_object(cfg_path) if cfg_path.is_file() else {}
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(self.config.get(k)))}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # transformers also allows [{"name": "default", "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._added = set(self.tokenizer.get_added_tokens_decoder())
        self._byte_level = type(self.tokenizer.decoder).__name__ == "ByteLevel"

    # ---- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token: a byte-level BPE piece maps back through GPT-2's byte alphabet
        (a piece may be half of a UTF-8 character); other tokens are the UTF-8 of their decoded text."""
        if token_id not in self._added and self._byte_level:
            piece = self.tokenizer.id_to_token(token_id)
            if piece is not None and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_strings(self, token_id: int) -> tuple[str, list[int]]:
        """(token_text, token_bytes as a list) of one token, memoised: logprob entries name every alternative of
        every position (a 32K-token prompt's top-20 is 690K names: 4.3 s unmemoised, once per vocabulary entry now)."""
        got = self._strings.get(token_id)
        if got is None:
            raw = self.token_bytes(token_id)  # once: the text is made of the same bytes
            got = self._strings[token_id] = (_display_text(raw), list(raw))
        return got

    def token_texts(self, ids: list[int]) -> list[str]:
        """token_text of each id, from token_strings' memo (a long prompt's entries name ~100K distinct ids: the
        memo read inline, not a method call each)."""
        memo = self._strings
        return [(memo.get(t) or self.token_strings(t))[0] for t in ids]

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs; a token that is not whole UTF-8 becomes OpenAI's `bytes:\\xNN`."""
        return _display_text(self.token_bytes(token_id))

    @cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text of B bytes has at least B / this many tokens (the door's
        bound on prompt text before tokenizing it)."""
        return max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)

    # ---- chat template ------------------------------------------------------------------------
    @cached_property
    def _compiled(self) -> jinja2.Template:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_tag(), jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template or "")
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat_template: syntax error at line {e.lineno}: {e.message}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text of `messages`, as transformers' apply_chat_template(tokenize=False) renders it."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat_template in tokenizer_config.json; "
                                    "use /v1/completions")
        variables = {**self.special_tokens, **kwargs}
        import jinja2  # imported here, with the first template (not at start-up)

        try:
            text = self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        if continue_final_message:  # transformers: cut the rendered text right after the last message
            final = messages[-1].get("content")
            if isinstance(final, list):
                final = "".join(p.get("text", "") for p in final)
            if final and final.strip() in text:
                text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text
