"""The shape of a request body, checked before it reaches an engine: what the gateway reads (the
model, ``stream``, token counts) and what an engine would fail on with a 500 instead of refusing
(a message whose role is not a string). Plain functions over the parsed JSON, no I/O.

The output a request may ask for is bounded here too: a model's catalog cap
(``ModelEntry.max_output_tokens``, handed over in the routing table) refuses more and is what a
request that names no limit gets; without a cap, the longest context the model runs with bounds it
(llama.cpp would otherwise keep generating past it, shifting its context).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import AboveCap, AboveContext, BadRequest, shown

GENERATING = frozenset({"chat/completions", "completions", "responses", "messages"})
# The fields an engine reads as the most tokens to generate: OpenAI's two and llama.cpp's own
# (``n_predict`` wins over the others there, so it is bounded alike).
OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
# Per API. llama.cpp turns a Responses body into a chat one that keeps its other fields, so those
# reach it too; a Messages body is rebuilt from the fields Anthropic defines (only ``max_tokens``).
OUTPUT_FIELDS_OF = {"chat/completions": OUTPUT_FIELDS, "completions": OUTPUT_FIELDS,
                    "responses": ("max_output_tokens", *OUTPUT_FIELDS), "messages": ("max_tokens",)}
# The field a model's cap is sent in when a request names no limit (Messages requires ``max_tokens``).
CAP_FIELD = {"responses": "max_output_tokens"}
CHOICE_FIELDS = ("n", "n_cmpl")  # completions per request (llama.cpp caps them at its slots)
MAX_CHOICES = 128  # OpenAI's own bound on ``n``


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_or_tokens(value: Any) -> bool:
    """A string, a list of strings, a list of token ids or a list of such lists (OpenAI's prompt and input)."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(item, str) for item in value) or all(_whole(item) for item in value):
        return True
    return all(isinstance(item, list) and item and all(_whole(t) for t in item) for item in value)


def _messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of messages.", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise BadRequest(f"`{where}` must be an object with a `role` and a `content`.", param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role.strip():
            raise BadRequest(f"`{where}.role` must be a string (system, user, assistant, tool…).",
                             param=f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str) and not (
                isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("type"), str)
                                                  for part in content)):
            raise BadRequest(f"`{where}.content` must be a string or a list of parts (objects with a `type`).",
                             param=f"{where}.content")


def _input_items(value: Any) -> bool:
    """A Responses ``input``: text, or a non-empty list of items (objects: messages, tool outputs…)."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value)
                                      and all(isinstance(item, dict) for item in value))


def _system(value: Any) -> bool:
    """A Messages ``system``: text, or a list of blocks (objects with a ``type``)."""
    return isinstance(value, str) or (isinstance(value, list) and all(
        isinstance(block, dict) and isinstance(block.get("type"), str) for block in value))


def cap_field(endpoint: str) -> str:
    return CAP_FIELD.get(endpoint, "max_tokens")


def check(endpoint: str, payload: dict) -> None:
    """Refuse (400 ``invalid_request``, naming the field in ``param``) a body the gateway or the
    engine cannot take. ``payload`` is a JSON object holding a string ``model``."""
    if payload.get("stream") is not None and not isinstance(payload["stream"], bool):
        raise BadRequest("`stream` must be true or false.", param="stream")
    if payload.get("stream_options") is not None and not isinstance(payload["stream_options"], dict):
        raise BadRequest("`stream_options` must be an object.", param="stream_options")
    if endpoint in ("chat/completions", "messages", "messages/count_tokens"):
        _messages(payload.get("messages"))
        if endpoint != "chat/completions" and payload.get("system") is not None and not _system(payload["system"]):
            raise BadRequest("`system` must be a string or a list of blocks (objects with a `type`).", param="system")
    elif endpoint in ("responses", "responses/input_tokens"):
        if not _input_items(payload.get("input")):
            raise BadRequest("`input` must be a string or a non-empty list of items (objects).", param="input")
        if payload.get("instructions") is not None and not isinstance(payload["instructions"], str):
            raise BadRequest("`instructions` must be a string.", param="instructions")
    elif endpoint == "completions":
        if not _text_or_tokens(payload.get("prompt")):
            raise BadRequest("`prompt` must be a string, a list of strings or token ids.", param="prompt")
    elif endpoint == "embeddings":
        if not _text_or_tokens(payload.get("input")):
            raise BadRequest("`input` must be a string, a list of strings or token ids.", param="input")
    elif endpoint == "rerank":
        if not isinstance(payload.get("query"), str):
            raise BadRequest("`query` must be a string.", param="query")
        documents = payload.get("documents")
        if not isinstance(documents, list) or not documents or not all(isinstance(d, (str, dict)) for d in documents):
            raise BadRequest("`documents` must be a non-empty list of strings (or objects).", param="documents")
    if endpoint in GENERATING:
        for field in OUTPUT_FIELDS_OF[endpoint]:
            value = payload.get(field)
            if value is not None and (not _whole(value) or value < 1):
                raise BadRequest(f"`{field}` must be a whole number of tokens, at least 1 (not {shown(repr(value))}).",
                                 param=field)
        for field in CHOICE_FIELDS:
            value = payload.get(field)
            if value is not None and (not _whole(value) or not 1 <= value <= MAX_CHOICES):
                raise BadRequest(f"`{field}` must be a whole number from 1 to {MAX_CHOICES} "
                                 f"(not {shown(repr(value))}).", param=field)


def output_default(endpoint: str, payload: dict, route) -> int | None:
    """Check the output the request asks for against ``route`` (a ``serving.control.routing.ModelRoute``):
    above the model's cap, or with no cap above its context, is refused (400, naming the bound).
    Returns the cap to send (in ``cap_field(endpoint)``) when the request names no limit (None: send
    the body as it is)."""
    if endpoint not in GENERATING:
        return None
    cap, context = route.max_output_tokens, route.context
    asked = [(field, payload[field]) for field in OUTPUT_FIELDS_OF[endpoint] if payload.get(field) is not None]
    for field, value in asked:  # whole numbers ≥ 1: ``check`` ran first
        if cap is not None and value > cap:
            raise AboveCap(f"`{field}` is {value}, above {route.name}'s cap of {cap} output tokens a request "
                           f"(the catalog's max_output_tokens): ask for {cap} or fewer.", param=field,
                           details={"model": route.name, "max_output_tokens": cap, "asked": value})
        if cap is None and context is not None and value > context:
            raise AboveContext(f"`{field}` is {value}, above the {context} tokens of {route.name}'s context: "
                               f"ask for {context} or fewer.", param=field,
                               details={"model": route.name, "context": context, "asked": value})
    return cap if cap is not None and not asked else None


# A prompt's tokens before the engine has counted them, for a budget reservation, at most: no
# tokenizer makes more than one token of a byte (byte fallback is the worst case), and the body's
# bytes are at least its text's; plus what a chat template may add beyond the messages' own bytes
# (a default system prompt). Generous for English (about four bytes a token), never short.
TEMPLATE_TOKENS = 64


def reservation(endpoint: str, payload: dict, size: int, output_cap: int | None, route,
                default_output: int) -> tuple[int, int | None]:
    """What the request may cost at most, reserved against a hard token budget at admission: its
    prompt (bounded by the body's ``size`` in bytes) and the output it may produce, times its choices.

    A request that names an output limit is reserved at it; one that names none at the model's cap
    (``output_cap``), else at ``default_output`` within the model's context. For a request that
    named none, that output is returned second: it is sent as its limit, so that no engine (a
    fallback's included) produces more than was reserved."""
    prompt = size + TEMPLATE_TOKENS
    if endpoint not in GENERATING:
        return prompt, None
    asked = next((payload[field] for field in OUTPUT_FIELDS_OF[endpoint] if payload.get(field) is not None), None)
    limit = None
    if asked is None:
        limit = output_cap if output_cap is not None else \
            min(default_output, route.context) if route.context else default_output
    choices = max(int(payload.get(field) or 1) for field in CHOICE_FIELDS)
    return prompt + (asked or limit) * choices, limit
